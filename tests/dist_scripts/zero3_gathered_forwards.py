"""Run under `torchrun --nproc_per_node 2` on CPU (gloo): off-policy DHPO-A steps under DeepSpeed ZeRO-3 with every
parameter partitioned, so that every forward gathers each layer's parameters from both ranks.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/zero3_gathered_forwards.py OUT_DIR PATH [PATH ...]

PATH: `packed` (the default path on CPU), `dynamic` (dynamic batching, padding_free=False) or `shared` (packed rows
with shared prompts); one run each, in one launch. DeepSpeed keeps a parameter of fewer than `stage3_param_persistence_threshold` elements
resident on every rank, which is every parameter of a tiny model at the default (1e5): a forward then gathers nothing,
and a rank running more forwards than the other goes unnoticed. Here the threshold is 0 and the prefetch and bucket
sizes small, so each forward is a sequence of all-gathers that the other rank must match: a rank that runs a
forward the other does not blocks, or pairs its collectives with the wrong ones.

Rank 0's completions are long and rank 1's short: under the token budget, the no-gradient pass over the generation
batch (pi_old's log-probs) needs more forwards on rank 0 than rank 1 by its own count, and the policy passes too.
A collective times out after 60 s (`ddp_timeout`, which DHPOConfig hands to the CPU process group), so a rank blocked by an unmatched forward fails
in about a minute instead of hanging. Each rank writes OUT_DIR/<PATH>/rank{r}.json: its no-gradient forwards and policy forwards, the no-gradient forwards its
own rows needed, whether any parameter stayed resident (persistent) or is gathered outside a forward, and the
parameters' norm after training (gathered), once every run and the release have finished, and the gloo threads
the release left (none: it found every engine and group the runs built).
"""

import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from dhpo_trl.demo.tiny import use_deepspeed_on_cpu  # noqa: E402

use_deepspeed_on_cpu()  # before deepspeed is first imported

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from dhpo_trl import DHPOTrainer  # noqa: E402
from dhpo_trl.core.presets import config_for  # noqa: E402
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3  # noqa: E402
from dhpo_trl.training import batching  # noqa: E402
from dhpo_trl.training.teardown import release_process_groups  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from zero3_config import zero3  # noqa: E402

BUDGET = 48
ROWS = 8  # per rank and generation batch: per_device_train_batch_size 2 x steps_per_generation 4
ZERO3 = zero3(stage3_prefetch_bucket_size=64, stage3_max_live_parameters=1024, stage3_max_reuse_distance=0,
              reduce_bucket_size=256, allgather_bucket_size=256)  # fmt: skip


def rollout(tok):
    """Rank 0: completions of 30-39 tokens; rank 1: 2-4 tokens (deterministic, ending in EOS)."""

    def run(prompts, trainer):
        rank = trainer.accelerator.process_index
        prompt_ids, completion_ids = [], []
        for index, prompt in enumerate(prompts):
            length = 30 + index % 10 if rank == 0 else 2 + index % 3
            body = [3 + (7 * index + 5 * position) % (len(tok) - 3) for position in range(length - 1)]
            prompt_ids.append(tok(prompt, add_special_tokens=False)["input_ids"])
            completion_ids.append(body + [tok.eos_token_id])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return run


def reward(completions, **kwargs):
    return [float((len(text) + sum(map(ord, text))) % 7) for text in completions]


class CountingTrainer(DHPOTrainer):
    own_needed: list[int] = []

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           *args, **kwargs):  # fmt: skip
        if batch_size is not None and not torch.is_grad_enabled():  # a no-gradient pass over the generation batch
            lengths = attention_mask.sum(1).clamp(min=1).tolist()
            if self.args.padding_free is False:  # dynamic batching: length-sorted padded chunks
                plan = batching.forward_plan(attention_mask, logits_to_keep, None)
                own = plan.groups_needed(self.args.max_tokens_per_micro_batch)
            else:  # packed rows (the shared rows of a generation batch need at most as many)
                own = batching.rows_needed(lengths, self.args.max_tokens_per_micro_batch)
            self.own_needed.append(max(math.ceil(input_ids.size(0) / batch_size), own))
        return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                          batch_size, *args, **kwargs)  # fmt: skip


def train(out_dir: Path, path: str, tok) -> tuple[int, dict]:
    CountingTrainer.own_needed = []
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_qwen3(tok, seed=0)  # before the config: a ZeRO-3 config switches model construction
    forwards = {"no_grad": 0, "policy": 0}

    def count(module, args):
        forwards["policy" if torch.is_grad_enabled() else "no_grad"] += 1

    model.register_forward_pre_hook(count)
    extra = {"dynamic": {"padding_free": False}, "packed": {}, "shared": {"share_prompts": True}}[path]
    args = config_for(
        "DHPO-A", output_dir=str(out_dir / "run"), per_device_train_batch_size=2, num_generations=2,
        gradient_accumulation_steps=2, steps_per_generation=4, max_completion_length=40, max_steps=2,
        max_tokens_per_micro_batch=BUDGET, optim="sgd", learning_rate=0.5, use_cpu=True, bf16=False,
        report_to="none", seed=0, data_seed=0, save_strategy="no", logging_steps=1, disable_tqdm=True,
        deepspeed=ZERO3, ddp_timeout=60, **extra,
    )  # fmt: skip
    prompts = Dataset.from_dict({"prompt": [f"{'x' * (a % 5)}{a}+{3 * a + 1}=" for a in range(16)]})
    trainer = CountingTrainer(model=model, reward_funcs=reward, args=args, train_dataset=prompts,
                              processing_class=tok, rollout_func=rollout(tok))  # fmt: skip
    trainer.train()
    rank = trainer.accelerator.process_index
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    params = list(model.parameters())
    persistent = sum(bool(p.ds_persist) for p in params)
    resident = sum(p.ds_status != ZeroParamStatus.NOT_AVAILABLE for p in params)
    with GatheredParameters(params):
        norm = float(torch.sqrt(sum((p.detach().double() ** 2).sum() for p in params)))
    record = {"forwards": forwards, "own_needed": CountingTrainer.own_needed, "persistent": persistent,
              "resident": resident, "parameters": len(params), "norm": norm, "path": trainer._update.path.name}
    return rank, record


def main() -> tuple[Path, int, dict]:
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    records = {}
    for path in sys.argv[2:]:
        rank, records[path] = train(Path(sys.argv[1]) / path, path, tok)
    return Path(sys.argv[1]), rank, records


if __name__ == "__main__":
    out, rank, records = main()
    left = release_process_groups()  # in a forked rank too, the release finds every engine and group
    for path, record in records.items():
        (out / path / f"rank{rank}.json").write_text(json.dumps({**record, "gloo_threads_left": left}))
