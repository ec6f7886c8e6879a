"""Run under `torchrun --nproc_per_node N` on CPU (gloo): a few off-policy DHPO-A steps on long-tailed completions,
on every update path.

Usage: torchrun --nproc_per_node N tests/dist_scripts/update_paths_distributed.py OUT_DIR [--zero3]

Four runs in one launch (one launch serves the two-process tests of dynamic batching, packing and shared prompts):
`trl`, TRL's batching (dynamic_batching=False); `budget`, dynamic batching with a token budget small enough that
micro-steps split into several passes, and into different numbers on different ranks before the ranks agree;
`packed`, padding_free with a budget of real tokens that splits micro-steps into several packed rows, likewise;
`shared`, the packed run with share_prompts=True. Rank 0 saves each run's final parameters
(OUT_DIR/<run>/params.pt); every rank dumps, per planned generation batch of each run but `trl`, the sequences of
each row of each micro-step, the passes its own windows needed and, on packed rows, each row's tokens and the prompt
tokens the rows forward (OUT_DIR/<run>/plan_rank{r}.json). --zero3: every run under DeepSpeed ZeRO-3 on CPU
(DS_ACCELERATOR=cpu); the extra passes then backpropagate through DeepSpeed without stepping its engine.
"""

import contextlib
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared long-tailed rollout, prompt counts

from long_tail import dataset, length_reward, long_tailed_rollout  # noqa: E402
import shared_rows  # noqa: E402
from zero3_config import residency, zero3  # noqa: E402

from dhpo_trl.training.teardown import release_process_groups  # noqa: E402
from dhpo_trl import DHPOTrainer  # noqa: E402
from dhpo_trl.core.presets import config_for  # noqa: E402
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3  # noqa: E402
from dhpo_trl.training import batching  # noqa: E402

BUDGET = 30  # padded tokens of one pass (dynamic batching)
PACKED_BUDGET = 45  # real tokens of one packed row
ZERO3 = zero3()  # every forward gathers from both ranks: a pass count the ranks did not agree on blocks


class RecordingTrainer(DHPOTrainer):
    plans = []

    def _plan_micro_batches(self, buffered):
        steps = self.args.gradient_accumulation_steps
        windows = [batching.concat(buffered[i : i + steps]) for i in range(0, len(buffered), steps)]
        if self._update.padding_free:
            own = [batching.rows_needed(batching.token_counts(w["prompt_mask"], w["completion_mask"]), PACKED_BUDGET)
                   for w in windows]  # fmt: skip
        else:
            own = [batching.plan_for(window).groups_needed(BUDGET) for window in windows]
        planned = super()._plan_micro_batches(buffered)
        rows = [[part["completion_mask"].size(0) for part in (m if isinstance(m, list) else [m])] for m in planned]
        plan = {"own_needed": own, "rows_per_pass": rows}
        if self._update.padding_free:
            plan["tokens_per_pass"] = [[sum(batching.token_counts(part["prompt_mask"], part["completion_mask"]))
                                        for part in (m if isinstance(m, list) else [m])] for m in planned]  # fmt: skip
            parts = [part for m in planned for part in (m if isinstance(m, list) else [m])]
            plan["prompt_tokens"] = shared_rows.prompt_tokens(parts)
        self.plans.append(plan)
        return planned


RUNS = {
    "trl": {"dynamic_batching": False},
    # the dynamic run is dynamic batching itself (padding_free=False; the automatic default packs on CPU)
    "budget": {"max_tokens_per_micro_batch": BUDGET, "padding_free": False},
    "packed": {"padding_free": True, "max_tokens_per_micro_batch": PACKED_BUDGET},
    "shared": {"padding_free": True, "max_tokens_per_micro_batch": PACKED_BUDGET, "share_prompts": True},
}


def train(out_dir: Path, mode: str, tok, zero3: bool) -> None:
    RecordingTrainer.plans = []
    model = build_tiny_qwen3(tok, seed=0)  # before the config: a ZeRO-3 config switches model construction
    args = config_for(
        "DHPO-A", output_dir=str(out_dir / "run"), per_device_train_batch_size=4, num_generations=4,
        gradient_accumulation_steps=2, steps_per_generation=4, max_completion_length=40, max_steps=4,
        optim="sgd", learning_rate=0.5, use_cpu=True, bf16=False, report_to="none", seed=0, data_seed=0,
        save_strategy="no", logging_steps=1, disable_tqdm=True, deepspeed=ZERO3 if zero3 else None, **RUNS[mode],
    )  # fmt: skip
    trainer = RecordingTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=dataset(32),
                               processing_class=tok, rollout_func=long_tailed_rollout(tok))  # fmt: skip
    trainer.train()
    rank = trainer.accelerator.process_index
    (out_dir / f"plan_rank{rank}.json").write_text(json.dumps(RecordingTrainer.plans))
    (out_dir / f"residency_rank{rank}.json").write_text(json.dumps(residency(model)))
    gather = contextlib.nullcontext()
    if zero3:  # parameters are partitioned across ranks: gather them to save the full tensors
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with gather:
        if rank == 0:
            torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, out_dir / "params.pt")


def main() -> None:
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    for mode in RUNS:
        out_dir = Path(sys.argv[1]) / mode
        out_dir.mkdir(parents=True, exist_ok=True)
        train(out_dir, mode, tok, zero3="--zero3" in sys.argv)


if __name__ == "__main__":
    main()
    release_process_groups()
