"""Run under `torchrun --nproc_per_node 2` on CPU (DeepSpeed's CPU accelerator, gloo): the non-finite check under
DeepSpeed, whose engine steps inside backward, before transformers reads the norm.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/nonfinite_deepspeed.py OUT_DIR

Two runs, rank 1's forwards returning NaN during optimizer step 2:
- "zero2" (ZeRO stage 2, fp32, `stop_on_nonfinite_gradients` automatic): the engine's overflow check skips the step
  and reports an inf norm; both ranks raise `NonFiniteGradientError` for step 2, the message saying DeepSpeed stepped,
  and the parameters are those after step 1.
- "zero0_true" (no ZeRO, fp32: the engine computes no norm) with the setting `True`: refused naming the setting.
Each rank dumps OUT_DIR/rank{r}.json (checked by tests/test_nonfinite.py).
"""

import json
import os
import sys

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from dhpo_trl.demo.tiny import use_deepspeed_on_cpu  # noqa: E402

use_deepspeed_on_cpu()  # before deepspeed is first imported

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from dhpo_trl import DHPOConfig, DHPOTrainer, NonFiniteGradientError  # noqa: E402
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3  # noqa: E402
from dhpo_trl.training.teardown import release_process_groups  # noqa: E402


class AfterStep1(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.after = trainer, {}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:  # the engine's module: ZeRO-2 keeps every parameter whole on every rank
            self.after = {name: p.detach().clone() for name, p in self.trainer.model.named_parameters()}


def run(out_dir, stage: int, setting) -> dict:
    rank = int(os.environ["RANK"])
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer, hidden_size=32, num_layers=2, seed=0)
    box = []

    def nan_on_rank_1(module, inputs, output):
        if rank == 1 and torch.is_grad_enabled() and box[0].state.global_step == 1:
            return output * float("nan")
        return None

    model.model.norm.register_forward_hook(nan_on_rank_1)
    deepspeed = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                 "bf16": {"enabled": False}}  # fmt: skip
    args = DHPOConfig(
        os.path.join(out_dir, f"zero{stage}"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        max_steps=2, logging_steps=1, per_device_train_batch_size=2, num_generations=2, gradient_accumulation_steps=2,
        steps_per_generation=4, max_completion_length=6, learning_rate=1e-2, deepspeed=deepspeed,
        stop_on_nonfinite_gradients=setting,
    )  # fmt: skip
    trainer = DHPOTrainer(model, lambda completions, **kw: [float(sum(map(ord, c)) % 7) for c in completions],
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["1+1=", "2+3=", "4+4=", "9+1="] * 2}),
                          processing_class=tokenizer)  # fmt: skip
    box.append(trainer)
    after = AfterStep1(trainer)
    trainer.add_callback(after)
    result = {"outcome": "finished", "step": None, "norm": None, "deepspeed_named": False, "refused_setting": None}
    try:
        trainer.train()
    except NonFiniteGradientError as error:
        result.update(outcome="stopped", step=error.step, norm=error.norm, deepspeed_named="DeepSpeed" in str(error))
    except ValueError as error:
        result.update(outcome="refused", refused_setting="stop_on_nonfinite_gradients" in str(error))
    parameters = dict(trainer.model.named_parameters())
    result["unchanged"] = bool(after.after) and all(
        torch.equal(parameters[name].detach(), kept) for name, kept in after.after.items()
    )
    result["finite"] = all(bool(torch.isfinite(p).all()) for p in parameters.values())
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    results = {"zero2": run(out, 2, None), "zero0_true": run(out, 0, True)}
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as handle:
        json.dump(results, handle)
    release_process_groups(barrier=False)
