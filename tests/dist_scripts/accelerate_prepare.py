"""Child of tests/test_accelerate_configs.py: prepare a tiny dense and a tiny MoE Qwen3 under each accelerate config.

argv[1] is a JSON list of {"name", "env", "cpu"}: `env` is what `accelerate launch --config_file <name>` puts in the
environment (computed by the test with accelerate's own launcher code), `cpu` asks for accelerate's CPU counterpart of
multi-GPU data parallelism (DDP over gloo). One process (LOCAL_RANK=0, WORLD_SIZE=1), DeepSpeed's CPU accelerator.
For each config and model, one training step, then one JSON line: what accelerate built, or the error it raised.
Under ZeRO-3 no parameter stays resident (`zero3_config.EVERY_FORWARD_GATHERS`), so the step's forwards gather.
accelerate runs FSDP on GPUs only, so for FSDP configs the plugin is built from the environment and its auto-wrap
policy applied to the model instead.
"""

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

from dhpo_trl.training.teardown import release_process_groups  # noqa: E402
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3, use_deepspeed_on_cpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from zero3_config import EVERY_FORWARD_GATHERS, residency  # noqa: E402


def prepare_and_step(model, cpu: bool) -> dict:
    accelerator = Accelerator(cpu=cpu)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.zero_stage == 3:  # accelerate's config leaves DeepSpeed's 1e5-element default
        plugin.deepspeed_config["zero_optimization"].update(EVERY_FORWARD_GATHERS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = torch.utils.data.DataLoader(torch.randint(3, 90, (4, 8)), batch_size=2)
    model, optimizer, batches = accelerator.prepare(model, optimizer, batches)
    for batch in batches:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    result = {"distributed_type": str(accelerator.distributed_type).split(".")[-1],
              "wrapped": type(model).__name__, "loss": loss.item()}  # fmt: skip
    if result["distributed_type"] == "DEEPSPEED":
        from importlib import import_module

        from deepspeed.utils import z3_leaf_module

        backend = import_module("deepspeed.comm.comm").cdb  # DeepSpeed's communication backend for this process
        zero = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
        result.update(
            zero_stage=zero["stage"], offload_optimizer=zero.get("offload_optimizer", {}).get("device", "none"),
            leaves=sum(map(z3_leaf_module, model.module.modules())),
            base_optimizer=type(optimizer.optimizer.optimizer).__name__,  # what ZeRO steps (on CPU when offloaded)
            shm_all_reduce=backend.shm_comm_op is not None,  # the JIT-built op use_deepspeed_on_cpu() turns off
            zero3=residency(model.module),
        )  # fmt: skip
    return result


def fsdp_wrap_plan(model) -> dict:
    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables the launcher set
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = sorted({type(module).__name__ for module in model.modules() if policy(module)})
    return {"distributed_type": "FSDP", "fsdp_version": plugin.fsdp_version, "wrapped_classes": wrapped,
            "wrapped_count": sum(1 for module in model.modules() if policy(module))}  # fmt: skip


def main() -> None:
    use_deepspeed_on_cpu()
    tokenizer = build_char_tokenizer()
    for case in json.loads(sys.argv[1]):
        for key in [key for key in os.environ if key.startswith(("ACCELERATE_", "FSDP_"))]:
            del os.environ[key]
        os.environ.update(case["env"])
        for moe in (False, True):
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
            model = build_tiny_qwen3(tokenizer, moe=moe, hidden_size=32)
            result = {"config": case["name"], "moe": moe}
            try:
                if os.environ.get("ACCELERATE_USE_FSDP") == "true":
                    result.update(fsdp_wrap_plan(model))
                else:
                    result.update(prepare_and_step(model, case["cpu"]))
            except Exception as error:  # noqa: BLE001 (the test asserts which configs may refuse which model)
                result["error"] = f"{type(error).__name__}: {error}"
            print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
    release_process_groups()
