"""Run under `torchrun --nproc_per_node N` on CPU (gloo): DHPO training and a fixed-batch loss, dumped per rank.

Usage: torchrun --nproc_per_node N tests/dist_scripts/dhpo_distributed.py OUT_DIR [--train] [--fixed-batch B]

--train: a few off-policy DHPO steps with entropy_norm_scope="global"; every call of the global entropy range and
    every logged token-ratio mean is dumped together with this rank's local inputs to it (train_rank{r}.json).
--fixed-batch B: the DHPO loss and gradient on sequences [r*B, (r+1)*B) of a fixed 2-process batch of 2*B
    sequences (all of it when N=1), with the policy wrapped as in training (DDP when N>1); dumps the loss, the
    reduced dhpo/ metrics and the all-reduced gradient (fixed_rank{r}.pt).
"""

import json
import os
import sys

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from dhpo_trl.training.teardown import release_process_groups  # noqa: E402
from dhpo_trl import DHPOConfig, DHPOTrainer  # noqa: E402
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3  # noqa: E402

FIXED_SEQUENCES_PER_PROCESS_PAIR = 2  # the fixed batch always holds 2*B sequences: one slice per process of a pair
PROMPT_LEN, COMPLETION_LEN = 6, 10


class RecordingDHPOTrainer(DHPOTrainer):
    """Records what each rank feeds into, and gets back from, the cross-process reductions."""

    records = {"entropy_range": [], "token_ratio": []}

    def _global_entropy_range(self, entropies, mask):
        low, high = super()._global_entropy_range(entropies, mask)
        valid = entropies.detach()[mask.bool()]
        self.records["entropy_range"].append({
            "local_min": valid.min().item(), "local_max": valid.max().item(), "min": float(low), "max": float(high),
        })  # fmt: skip
        return low, high

    def _log_loss_metrics(self, mode, info, entropies, mask, per_token_kl, *extra):
        super()._log_loss_metrics(mode, info, entropies, mask, per_token_kl, *extra)
        fmask = mask.float()
        self.records["token_ratio"].append({
            "local_sum": (info["token_ratio"].detach() * fmask).sum().item(), "local_tokens": fmask.sum().item(),
            "logged_mean": self._metrics[mode]["dhpo/token_ratio/mean"][-1],
        })  # fmt: skip


def _reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


def _config(out_dir, **overrides):
    kwargs = dict(
        output_dir=out_dir, use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0,
        per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=1, steps_per_generation=2,
        max_completion_length=8, max_steps=4, logging_steps=1, learning_rate=1e-2, entropy_norm_scope="global",
        # What is compared is the cross-process reduction, to 1e-6: the forwards must give every sequence the same
        # values in both runs. Packed rows put a sequence next to different neighbours in a 2-process and a
        # 1-process run (float rounding ~1e-7 relative in the metrics); dynamic batching's trimmed rows do not here.
        padding_free=False,
    )  # fmt: skip
    kwargs.update(overrides)
    return DHPOConfig(**kwargs)


def run_training(out_dir):
    tokenizer = build_char_tokenizer()
    dataset = Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(16)]})
    trainer = RecordingDHPOTrainer(
        build_tiny_qwen3(tokenizer), _reward, args=_config(out_dir), train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    rank = trainer.accelerator.process_index
    dump = dict(trainer.records, world_size=trainer.accelerator.num_processes, log_history=trainer.state.log_history)
    with open(os.path.join(out_dir, f"train_rank{rank}.json"), "w") as handle:
        json.dump(dump, handle)


def _fixed_batch(tokenizer, sequences):
    """The same `sequences` prompt/completion pairs on every process, with completions of different lengths."""
    generator = torch.Generator().manual_seed(1234)
    low, high = 3, len(tokenizer)  # skip the special tokens
    prompt_ids = torch.randint(low, high, (sequences, PROMPT_LEN), generator=generator)
    completion_ids = torch.randint(low, high, (sequences, COMPLETION_LEN), generator=generator)
    lengths = torch.randint(3, COMPLETION_LEN + 1, (sequences,), generator=generator)
    completion_mask = (torch.arange(COMPLETION_LEN)[None, :] < lengths[:, None]).long()
    advantages = torch.randn(sequences, generator=generator)
    logp_noise = 0.3 * torch.randn(sequences, COMPLETION_LEN, generator=generator)  # makes the batch off-policy
    return prompt_ids, completion_ids, completion_mask, advantages, logp_noise


def run_fixed_batch(out_dir, per_process):
    tokenizer = build_char_tokenizer()
    dataset = Dataset.from_dict({"prompt": ["1+1="] * 8})
    trainer = RecordingDHPOTrainer(
        build_tiny_qwen3(tokenizer), _reward, args=_config(out_dir), train_dataset=dataset, processing_class=tokenizer
    )
    accelerator = trainer.accelerator
    rank, world = accelerator.process_index, accelerator.num_processes
    prompt_ids, completion_ids, completion_mask, advantages, logp_noise = _fixed_batch(
        tokenizer, FIXED_SEQUENCES_PER_PROCESS_PAIR * per_process
    )
    rows = slice(rank * per_process, (rank + 1) * per_process) if world == 2 else slice(None)
    prompt_ids, completion_ids, completion_mask = prompt_ids[rows], completion_ids[rows], completion_mask[rows]
    advantages, logp_noise = advantages[rows], logp_noise[rows]
    prompt_mask = torch.ones_like(prompt_ids)

    model = accelerator.prepare_model(trainer.model)  # DDP over gloo when world > 1, as in train()
    model.train()
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
            COMPLETION_LEN,
        )  # fmt: skip
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": logps + logp_noise,
        "num_items_in_batch": accelerator.reduce(completion_mask.sum().float(), reduction="sum"),
    }  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer._compute_loss(model, inputs)
    loss.backward()  # DDP averages the gradient over processes here
    gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items() if key.startswith("dhpo/")}
    torch.save(
        {"loss": loss.item(), "metrics": metrics, "gradient": gradient, "world_size": world,
         "entropy_range": trainer.records["entropy_range"][-1]},
        os.path.join(out_dir, f"fixed_rank{rank}.pt"),
    )  # fmt: skip


if __name__ == "__main__":
    output_dir = sys.argv[1]
    os.makedirs(output_dir, exist_ok=True)
    if "--train" in sys.argv:
        run_training(output_dir)
    if "--fixed-batch" in sys.argv:
        run_fixed_batch(output_dir, int(sys.argv[sys.argv.index("--fixed-batch") + 1]))
    release_process_groups()
