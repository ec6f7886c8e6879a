"""`BenchmarkEvalCallback`: benchmark accuracy every N training steps, logged as `eval/<benchmark>` and `eval/avg`.

One run then yields accuracy-over-steps curves (the paper's Figs. 1c, 3-5) next to entropy and clip fractions.
Sampling uses the trainer's own model through transformers `generate`, with small limits, and restores the model's
train mode and the global RNG state afterwards so the evaluation does not change the training trajectory.

Logging goes through `transformers.Trainer.log`, which appends to `state.log_history` and calls every callback's
`on_log` (the wandb / tensorboard / trackio integrations), so the numbers reach the enabled trackers. The base-class
method is called on purpose: `GRPOTrainer.log` would fold the pending training metrics into this entry and clear them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import Trainer, TrainerCallback

from .backends import SamplingSettings, TransformersBackend
from .benchmarks import load_benchmark, resolve_benchmark_names, resolve_sources
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
        if self.eval_on_start:
            self._evaluate_and_log(state, control, model, processing_class)

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step % self.every_n_steps == 0:
            self._evaluate_and_log(state, control, model, processing_class)

    def evaluate(self, model, tokenizer) -> dict[str, float]:
        """{"eval/<benchmark>": accuracy in percent, ..., "eval/avg": their mean} for `model` as it is now."""
        backend = TransformersBackend(model, tokenizer, batch_size=self.batch_size)
        results = evaluate_problems(backend, tokenizer, self.problems, self.settings, self.samples)
        metrics = {f"eval/{name}": result["score"] for name, result in results["benchmarks"].items()}
        metrics["eval/avg"] = results["average"]
        return metrics

    def _evaluate_and_log(self, state, control, model, processing_class) -> None:
        if model is None or processing_class is None:
            raise ValueError("BenchmarkEvalCallback needs the trainer's model and processing_class (tokenizer).")
        if self.trainer is not None:
            model = self.trainer.accelerator.unwrap_model(model)
        tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a processor wraps its tokenizer
        metrics = self.evaluate(model, tokenizer)
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
