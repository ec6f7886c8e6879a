"""`BenchmarkEvalCallback`: benchmark accuracy every N training steps, logged as `eval/<benchmark>` and `eval/avg`.

One run then yields accuracy-over-steps curves (the paper's Figs. 1c, 3-5) next to entropy and clip fractions.
Sampling uses the trainer's own model through transformers `generate`, with small limits, and restores the model's
train mode and the global RNG state afterwards so the evaluation does not change the training trajectory.

On N processes the problems are split: each benchmark is cut into units of about one `generate` batch, unit i is
sampled by process i mod N with the seed `seed + i`, and the per-sample correctness is gathered. A unit's samples do
not depend on which process drew them, so the logged numbers are those of one process evaluating everything. Under
DeepSpeed ZeRO-3 (or FSDP) the weights are gathered once per evaluation, as TRL does for its own generation, instead
of layer by layer at every decoding step (unless `ds3_gather_for_generation=False`, TRL's switch for models too
large to gather); ZeRO-3 decodes in lockstep, so every process runs as many units (a short one repeats unit 0).

Logging goes through `transformers.Trainer.log`, which appends to `state.log_history` and calls every callback's
`on_log` (the wandb / tensorboard / trackio integrations), so the numbers reach the enabled trackers. The base-class
method is called on purpose: `GRPOTrainer.log` would fold the pending training metrics into this entry and clear them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch.distributed as dist
from transformers import Trainer, TrainerCallback
from transformers.distributed.fsdp import is_fsdp_managed_module
from transformers.integrations import is_deepspeed_zero3_enabled

from .backends import SamplingSettings, TransformersBackend
from .benchmarks import BENCHMARKS, check_benchmark_keys, load_benchmark, resolve_benchmark_names, resolve_sources
from .metrics import average_score, benchmark_score
from .runner import evaluate_problems

logger = logging.getLogger(__name__)


class BenchmarkEvalCallback(TrainerCallback):
    """Score a subset of benchmarks every `every_n_steps` optimizer steps.

    `benchmarks`: {name: source} (a JSONL path, a directory with test.jsonl, a Hub dataset id, or a list of dict
    rows in that benchmark's format), or a list of names read from `data_dir/<name>/test.jsonl`. All data is loaded
    and validated here, before training starts. `samples` is samples per problem (one int, or {name: k}).

    Attach it with `callback.attach(trainer)` (or pass `trainer=`) so it can log to the trackers; added only via
    `callbacks=[...]`, it writes to `trainer.state.log_history` alone and warns once.
    """

    def __init__(
        self,
        benchmarks: Mapping[str, Any] | Sequence[str],
        *,
        data_dir: str | None = None,
        every_n_steps: int = 50,
        limit: int | None = 32,
        samples: int | Mapping[str, int] = 1,
        max_new_tokens: int = 1024,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        batch_size: int = 16,
        eval_on_start: bool = False,
        split: str = "test",
        trainer: Trainer | None = None,
    ):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        names = resolve_benchmark_names(list(benchmarks))
        # Checked here, as the CLI checks --samples: at the first evaluation, steps into training, a 0 would stop the
        # run with a ZeroDivisionError and a misspelt name would silently get the paper's default (32 for AIME).
        if isinstance(samples, int):
            if samples < 1:
                raise ValueError(f"samples must be >= 1, got {samples}.")
        else:
            check_benchmark_keys(samples, "samples")
            for name, k in samples.items():
                if not isinstance(k, int) or k < 1:
                    raise ValueError(f"samples['{name}'] must be a whole number >= 1, got {k!r}.")
        sources = (
            resolve_sources(names, data=benchmarks)
            if isinstance(benchmarks, Mapping)
            else resolve_sources(names, data_dir=data_dir)
        )
        self.problems = {name: load_benchmark(name, sources[name], split=split, limit=limit) for name in names}
        self.samples = {name: samples for name in names} if isinstance(samples, int) else dict(samples)
        self.settings = SamplingSettings(max_new_tokens, temperature, top_p, seed)
        self.every_n_steps = every_n_steps
        self.batch_size = batch_size
        self.eval_on_start = eval_on_start
        self.trainer = trainer
        self.history: list[dict[str, float]] = []  # one entry per evaluation, with its step
        self._warned_unattached = False

    def attach(self, trainer: Trainer) -> BenchmarkEvalCallback:
        """Register on `trainer` and keep a reference to log through it."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.trainer is None and (is_deepspeed_zero3_enabled() or args.fsdp):
            raise ValueError(
                "BenchmarkEvalCallback under DeepSpeed ZeRO-3 or FSDP needs the trainer to gather the weights for "
                "generation: register it with callback.attach(trainer) instead of callbacks=[...]."
            )
        if self.eval_on_start:
            self._evaluate_and_log(args, state, control, model, processing_class)

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step % self.every_n_steps == 0:
            self._evaluate_and_log(args, state, control, model, processing_class)

    def evaluate(self, model, tokenizer) -> dict[str, float]:
        """{"eval/<benchmark>": accuracy in percent, ..., "eval/avg": their mean} for `model` as it is now.

        Called on every process of a torch.distributed run (each samples its share); all return the same numbers.
        """
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        # transformers decodes in lockstep across processes under ZeRO-3 / FSDP: unequal work would hang.
        lockstep = world > 1 and (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model))
        backend = TransformersBackend(model, tokenizer, batch_size=self.batch_size)
        local: dict[str, dict[int, list[list[float]]]] = {}  # benchmark -> unit index -> per-problem correctness
        for name, problems in self.problems.items():
            num_samples = self.samples.get(name, BENCHMARKS[name].num_samples)
            size = max(1, self.batch_size // num_samples)  # problems per unit: about one generate() batch
            units = [problems[start : start + size] for start in range(0, len(problems), size)]
            mine = list(range(rank, len(units), world))
            if lockstep:  # pad with a repeat of unit 0 (same number of generate() calls), result dropped
                mine += [None] * (-(-len(units) // world) - len(mine))
            local[name] = {}
            for index in mine:
                settings = replace(self.settings, seed=self.settings.seed + (index or 0))
                result = evaluate_problems(
                    backend, tokenizer, {name: units[index or 0]}, settings, {name: num_samples}
                )
                if index is not None:
                    local[name][index] = [record["correct"] for record in result["benchmarks"][name]["problems"]]
        shares = [local]
        if world > 1:
            shares = [None] * world
            dist.all_gather_object(shares, local)
        scores = {}
        for name in self.problems:
            units = {index: correct for share in shares for index, correct in share[name].items()}
            scores[name] = benchmark_score([correct for index in sorted(units) for correct in units[index]])
        metrics = {f"eval/{name}": score for name, score in scores.items()}
        metrics["eval/avg"] = average_score(scores)
        return metrics

    @contextmanager
    def _generation_model(self, args, model):
        """The model to sample from: with the trainer, unwrapped and (ZeRO-3, FSDP) gathered as TRL does."""
        if self.trainer is None:
            yield model
            return
        from trl.distributed import DistributedBackend
        from trl.models import unwrap_model_for_generation

        wrapped, accelerator = self.trainer.model_wrapped, self.trainer.accelerator
        with (
            unwrap_model_for_generation(
                wrapped,
                accelerator,
                gather_deepspeed3_params=getattr(args, "ds3_gather_for_generation", True),
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            DistributedBackend(accelerator).summon_full_params(wrapped, recurse=False),
        ):
            yield unwrapped

    def _evaluate_and_log(self, args, state, control, model, processing_class) -> None:
        if model is None or processing_class is None:
            raise ValueError("BenchmarkEvalCallback needs the trainer's model and processing_class (tokenizer).")
        tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a processor wraps its tokenizer
        with self._generation_model(args, model) as generation_model:
            metrics = self.evaluate(generation_model, tokenizer)
        self.history.append({"step": state.global_step, **metrics})
        if self.trainer is not None:
            # on_log clears control.should_log, which DefaultFlowCallback has just set for this step's training
            # log: put it back, or logging the evaluation would silently drop the training metrics.
            should_log = control.should_log
            Trainer.log(self.trainer, dict(metrics))
            control.should_log = should_log
        else:
            if not self._warned_unattached:
                logger.warning(
                    "BenchmarkEvalCallback is not attached to a trainer: eval/* metrics go to "
                    "trainer.state.log_history only. Use callback.attach(trainer) to reach the trackers."
                )
                self._warned_unattached = True
            state.log_history.append({**metrics, "step": state.global_step})
