"""Run under `torchrun --nproc_per_node 2` on CPU (gloo): a NaN in rank 1's forwards at optimizer step 2 stops both.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/nonfinite_distributed.py OUT_DIR

Rank 1's final norm returns NaN in every forward that takes gradients during step 2; DDP's all-reduce gives both
ranks the NaN gradients and the same norm, so both must raise `NonFiniteGradientError` for step 2 before the
optimizer step. Each rank dumps OUT_DIR/rank{r}.json: the step it stopped at and whether its parameters are still
those after step 1 (checked by tests/test_nonfinite.py). A rank that went on would take the step, then meet the
other's exit in its next collective (`ddp_timeout` bounds the wait).
"""

import json
import os
import sys

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from dhpo_trl import DHPOConfig, DHPOTrainer, NonFiniteGradientError  # noqa: E402
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3  # noqa: E402
from dhpo_trl.training.teardown import release_process_groups  # noqa: E402


class AfterStep1(TrainerCallback):
    """Keeps the trainer's parameters after optimizer step 1 (under DeepSpeed the engine's module: ZeRO-2 keeps every
    parameter whole on every rank)."""

    def __init__(self, trainer):
        self.trainer, self.after = trainer, {}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.after = {name: p.detach().clone() for name, p in self.trainer.model.named_parameters()}

    def unchanged(self) -> bool:
        """Whether the parameters are still those after step 1 (False if step 1 never ended)."""
        parameters = dict(self.trainer.model.named_parameters())
        return bool(self.after) and all(torch.equal(parameters[n].detach(), kept) for n, kept in self.after.items())


def nonfinite_trainer(output_dir: str, **settings) -> tuple[DHPOTrainer, AfterStep1]:
    """A tiny off-policy DHPO trainer whose rank 1 returns NaN from the model's final norm in every forward that takes
    gradients during optimizer step 2, and the callback keeping its parameters after step 1. `settings` go to
    `DHPOConfig` (max_steps, ddp_timeout, deepspeed, stop_on_nonfinite_gradients)."""
    rank = int(os.environ["RANK"])
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer, hidden_size=32, num_layers=2, seed=0)
    box = []

    def nan_on_rank_1(module, inputs, output):
        if rank == 1 and torch.is_grad_enabled() and box[0].state.global_step == 1:
            return output * float("nan")
        return None

    model.model.norm.register_forward_hook(nan_on_rank_1)
    args = DHPOConfig(
        output_dir, use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1,
        per_device_train_batch_size=2, num_generations=2, gradient_accumulation_steps=2, steps_per_generation=4,
        max_completion_length=6, learning_rate=1e-2, **settings,
    )  # fmt: skip
    trainer = DHPOTrainer(model, lambda completions, **kw: [float(sum(map(ord, c)) % 7) for c in completions],
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["1+1=", "2+3=", "4+4=", "9+1="] * 2}),
                          processing_class=tokenizer)  # fmt: skip
    box.append(trainer)
    after = AfterStep1(trainer)
    trainer.add_callback(after)
    return trainer, after


def run(out_dir) -> dict:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    trainer, after = nonfinite_trainer(out_dir, max_steps=3, ddp_timeout=60)
    assert trainer.accelerator.num_processes == 2
    try:
        trainer.train()
        stopped = None
    except NonFiniteGradientError as error:
        stopped = error.step
    result = {"rank": rank, "stopped": stopped, "unchanged": after.unchanged()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    return result


if __name__ == "__main__":
    outcome = run(sys.argv[1])
    release_process_groups(barrier=False)  # a rank that went on may be gone or still training
    sys.exit(0 if outcome["stopped"] is not None else 1)
