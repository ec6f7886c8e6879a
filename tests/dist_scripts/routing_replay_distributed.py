"""Run under `torchrun --nproc_per_node N` on CPU (gloo): off-policy DHPO-A steps on the tiny Qwen3-MoE with
`routing_replay="old"`, TRL's batching (each policy pass one padded forward of its micro-batch).

Usage: torchrun --nproc_per_node N tests/dist_scripts/routing_replay_distributed.py OUT_DIR [--zero3]

Every rank compares, in every policy pass, the experts each expert block received (a spy on the `experts` modules)
with the micro-batch's recorded routing, token by token, and writes OUT_DIR/rank{r}.json: the passes checked, the
token-layer decisions that differed, and the logged `moe/` metrics.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

if "--zero3" in sys.argv:
    from dhpo_trl.demo.tiny import use_deepspeed_on_cpu

    use_deepspeed_on_cpu()  # before deepspeed is first imported

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from dhpo_trl.training.teardown import release_process_groups  # noqa: E402

from dhpo_trl import DHPOTrainer  # noqa: E402
from dhpo_trl.core.presets import config_for  # noqa: E402
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3  # noqa: E402
from dhpo_trl.training import routing_replay  # noqa: E402

ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto", "bf16": {"enabled": False}}  # fmt: skip


class CheckingTrainer(DHPOTrainer):
    """Checks the experts of every policy pass against the micro-batch's recorded routing."""

    checked = 0
    differing = 0

    def _compute_loss(self, model, inputs):
        calls = []
        handles = [m.register_forward_pre_hook(lambda m, args: calls.append(args[1].clone()))
                   for name, m in self.model.named_modules() if name.endswith("mlp.experts")]  # fmt: skip
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            for handle in handles:
                handle.remove()
        ids, mask = routing_replay.sequence_inputs(inputs)
        rows = inputs[routing_replay.ROUTED_EXPERTS]
        recorded = rows[rows[:, :, 0, 0] >= 0].long()  # (tokens, layers, top_k), row-major
        used = torch.stack([c.view(*ids.shape, -1)[mask.bool()] for c in calls[: recorded.size(1)]], 1)
        type(self).checked += 1
        type(self).differing += int((used.sort(-1).values != recorded.sort(-1).values).any(-1).sum())
        return loss


def reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


def main() -> None:
    torch.set_num_threads(1)
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    zero3 = "--zero3" in sys.argv
    model = build_tiny_qwen3(tok, moe=True, seed=0)  # before the config: a ZeRO-3 config switches construction
    args = config_for(
        "DHPO-A", output_dir=str(out_dir / "run"), per_device_train_batch_size=4, num_generations=4,
        gradient_accumulation_steps=1, steps_per_generation=4, max_completion_length=8, max_steps=4,
        learning_rate=5e-2, use_cpu=True, bf16=False, report_to="none", seed=0, data_seed=0, save_strategy="no",
        logging_steps=1, disable_tqdm=True, deepspeed=ZERO3 if zero3 else None, dynamic_batching=False,
        padding_free=False, routing_replay="old",
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(16)]})
    trainer = CheckingTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=tok)  # fmt: skip
    trainer.train()
    logs = [e for e in trainer.state.log_history if "moe/routing_flip_fraction" in e]
    rank = trainer.accelerator.process_index
    (out_dir / f"rank{rank}.json").write_text(json.dumps({
        "checked": CheckingTrainer.checked, "differing": CheckingTrainer.differing,
        "flip": [e["moe/routing_flip_fraction"] for e in logs], "replayed": [e["moe/replayed_fraction"] for e in logs],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
    release_process_groups()
