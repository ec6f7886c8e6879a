"""The embedded CPU default: DHPO-E on a warm-started tiny Qwen3 and synthetic addition, offline, in minutes.

    python -m dhpo_trl                      # DHPO-E, the paper's off-policy setting, a few minutes on 2 cores
    python -m dhpo_trl --algorithm GRPO     # any row of dhpo_trl.core.presets.PAPER_ALGORITHMS

Steps: build the synthetic task (train / held-out splits from the seed), load or create the cached warm start
(`dhpo_trl.demo.warmstart`), measure greedy held-out accuracy, train with `DHPOTrainer` scored by
`dhpo_trl.scoring.rewards.math_verify_reward` (the real recipes' reward), re-measure the held-out accuracy every
`eval_every` steps, then save the checkpoint, the log history, a plot and a JSON summary. `run_embedded` is the
Python entry point used by the study script, the notebook and the tests.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from ..core.presets import PAPER_ALGORITHMS, config_for
from ..scoring.rewards import math_verify_reward
from ..training.nonfinite import NonFiniteGradientError
from ..user_errors import DEBUG_FLAG, DEBUG_HELP, make_folder, positive_int, report, run_command, seed_int
from .arithmetic import Problem, make_splits, to_dataset
from .stops import TrainingStopped  # re-exported: the studies and the tests import it from here
from .warmstart import WarmStartSettings, greedy_completions, load_or_warm_start


@dataclass(frozen=True)
class EmbeddedSettings:
    """Defaults of the embedded run (measured: DHPO-E 61.5% -> 91.5% held-out accuracy, RL 86 s on 2 cores)."""

    task: ClassVar[str] = "addition"
    title: ClassVar[str] = "synthetic addition"

    digits: tuple[int, int] = (2, 2)  # operand widths of the synthetic additions
    num_train: int = 2000
    num_heldout: int = 200
    # Supervised warm start, stopped early so that RL has accuracy left to gain: at the first check where the policy
    # writes the right answer for `warmup_target_accuracy` of 100 training problems (at most `warmup_steps` steps).
    warmup_steps: int = 600
    warmup_target_accuracy: float | None = 0.5
    max_steps: int = 120  # optimizer steps of RL: 60 generation batches of k = 2 steps
    learning_rate: float = 2e-4
    prompts_per_generation: int = 32  # prompts per generation batch; x num_generations completions
    num_generations: int = 8
    # Optimizer steps per generation batch (k): the generation batch is split into k equal optimizer steps, each
    # sample used once, so k >= 2 is off-policy (the paper: 2) and the drift from pi_old grows with k.
    steps_per_generation: int = 2
    # Micro-batches per optimizer step: dynamic batching regroups sequences by length within these windows.
    gradient_accumulation_steps: int = 1
    max_completion_length: int = 12
    eval_every: int = 10

    def per_device_train_batch_size(self) -> int:
        return split_generation_batch(self)


def split_generation_batch(settings) -> int:
    """Sequences per micro-batch: the generation batch split into k optimizer steps of GA micro-batches."""
    completions = settings.prompts_per_generation * settings.num_generations
    micro_batches = settings.steps_per_generation * settings.gradient_accumulation_steps
    if completions % micro_batches:
        raise ValueError(
            f"{type(settings).__name__}: prompts_per_generation x num_generations = {completions} completions do not "
            f"split into steps_per_generation x gradient_accumulation_steps = {micro_batches} equal micro-batches: "
            "make the product divide the generation batch."
        )
    return completions // micro_batches


def memoized_reward(reward):
    """`reward(completions, answer)` with each (completion, answer) pair scored once per process.

    The reward is a pure function of the pair, so the scores are unchanged; what changes is the time. math-verify
    parses a completion in milliseconds, and a sharpening policy repeats the same completions (within a group of
    samples, and in every held-out evaluation), so on this task most calls become look-ups.
    """
    memo: dict[tuple[str, str], float] = {}

    @functools.wraps(reward)  # keeps the name: TRL logs rewards/<name>/mean
    def memoized(completions, answer, **kwargs):
        pairs = list(zip(completions, answer, strict=True))
        missing = [pair for pair in dict.fromkeys(pairs) if pair not in memo]
        if missing:
            memo.update(zip(missing, reward([c for c, _ in missing], [a for _, a in missing]), strict=True))
        return [memo[pair] for pair in pairs]

    return memoized


def greedy_scores(model, tokenizer, problems: list[Problem], *, max_new_tokens: int, batch_size: int = 200,
                  reward=math_verify_reward, by_length: bool = False) -> list[float]:  # fmt: skip
    """`reward` (math-verify's) of each problem's greedy completion, in the order of `problems`.

    `by_length`: batch the problems in the order of their taught completion's length, so that each batch stops near
    its own longest completion instead of every batch running as long as the longest of the set (on the long task,
    about a third of the decoding of a large set)."""
    was_training = model.training
    model.eval()
    order = list(range(len(problems)))
    if by_length:
        order.sort(key=lambda j: len(problems[j].target_completion()))
    scores: list[float] = [0.0] * len(problems)
    for start in range(0, len(order), batch_size):
        chunk = [problems[j] for j in order[start : start + batch_size]]
        texts = greedy_completions(model, tokenizer, [p.prompt for p in chunk], max_new_tokens=max_new_tokens)
        for j, score in zip(order[start : start + batch_size], reward(texts, [p.answer for p in chunk]), strict=True):
            scores[j] = score
    model.train(was_training)
    return scores


def greedy_accuracy(model, tokenizer, problems: list[Problem], *, max_new_tokens: int, batch_size: int = 200,
                    reward=math_verify_reward) -> float:  # fmt: skip
    """Fraction of `problems` whose greedy completion `reward` (math-verify's) scores 1.0."""
    scores = greedy_scores(model, tokenizer, problems, max_new_tokens=max_new_tokens, batch_size=batch_size,
                           reward=reward)  # fmt: skip
    return sum(scores) / len(scores)


class HeldoutAccuracyCallback(TrainerCallback):
    """Logs `eval/heldout_accuracy` (greedy, scored by the math reward) into the log history every `every` steps."""

    def __init__(self, tokenizer, problems: list[Problem], *, every: int, max_new_tokens: int, initial: float,
                 reward=math_verify_reward):  # fmt: skip
        self.tokenizer, self.problems, self.every, self.max_new_tokens = tokenizer, problems, every, max_new_tokens
        self.initial, self.reward = initial, reward  # initial: measured before training, logged at step 0
        self.seconds = 0.0  # time spent evaluating during training

    def on_train_begin(self, args, state, control, **kwargs):
        state.log_history.append({"eval/heldout_accuracy": self.initial, "step": 0})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            started = time.perf_counter()
            accuracy = greedy_accuracy(model, self.tokenizer, self.problems, max_new_tokens=self.max_new_tokens,
                                       reward=self.reward)  # fmt: skip
            self.seconds += time.perf_counter() - started
            state.log_history.append({"eval/heldout_accuracy": accuracy, "step": state.global_step})
            if state.is_world_process_zero:
                print(f"\n[step {state.global_step}] held-out accuracy {accuracy:.1%}", flush=True)


class CompactProgressCallback(ProgressCallback):
    """The progress bar with reward and entropy as its postfix, instead of one printed dict per logged step."""

    shown: dict | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Only generation steps log a reward: keep the last value of each so the postfix stays put.
        self.shown = {**(self.shown or {}), **{k: f"{v:.3f}" for k, v in (logs or {}).items()
                                                if k in ("reward", "entropy") and isinstance(v, float)}}  # fmt: skip
        if self.training_bar is not None and self.shown:
            self.training_bar.set_postfix(self.shown, refresh=False)


def _series(log_history: list[dict], key: str) -> list[list[float]]:
    return [[entry["step"], entry[key]] for entry in log_history if key in entry and "step" in entry]


def _plot(log_history: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward", "mean reward"), ("eval/heldout_accuracy", "held-out accuracy"), ("entropy", "entropy")]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for axis, (key, label) in zip(axes, panels):
        points = _series(log_history, key)
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o" if len(points) < 30 else None)
        axis.set_xlabel("optimizer step")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def load_task(settings: EmbeddedSettings, num_heldout: int | None = None, *, cache_dir=None, use_cache=True):
    """`(train problems, held-out problems, (model, tokenizer, from_cache))`: the task and its (cached) warm start.

    Both depend on the task settings and `num_heldout` only (training problems avoid the held-out ones), not on the
    RL seed or the RL settings: every algorithm, seed and staleness of a study starts from the same policy. A task
    other than the two-digit one (`LongSettings`) loads through its settings' own `load_task`.
    """
    if not isinstance(settings, EmbeddedSettings):
        return settings.load_task(num_heldout, cache_dir=cache_dir, use_cache=use_cache)
    num_heldout = settings.num_heldout if num_heldout is None else num_heldout
    train_problems, heldout_problems = make_splits(settings.num_train, num_heldout, digits=settings.digits, seed=0)
    warm = WarmStartSettings(steps=settings.warmup_steps, target_accuracy=settings.warmup_target_accuracy,
                             problems=train_problems)  # fmt: skip
    return train_problems, heldout_problems, load_or_warm_start(warm, cache_dir=cache_dir, use_cache=use_cache)


def source_commit() -> str | None:
    """The git commit of the `dhpo_trl` that ran (`<sha>-dirty` with uncommitted changes to it), None outside git.

    Study pages state it, so a reader can check out the code that produced every figure."""
    package = Path(__file__).resolve().parents[1]  # dhpo_trl/, not demo/
    try:
        sha = subprocess.run(["git", "-C", str(package), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(package), "status", "--porcelain", "--", str(package)],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha


def run_embedded(
    algorithm: str = "DHPO-E",
    seed: int = 0,
    max_steps: int | None = None,
    output_dir: str | Path = "outputs/embedded",
    *,
    eval_every: int | None = None,
    num_heldout: int | None = None,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    settings: EmbeddedSettings | None = None,
    disable_tqdm: bool = False,
    num_threads: int = 1,
    config_overrides: dict | None = None,
    final_heldout: int | None = None,
) -> dict:
    """Warm-start (or load), train `algorithm` on the synthetic task, evaluate, save; return the summary dict.

    `config_overrides`: `DHPOConfig` fields set on top of the row's preset (e.g. `{"delta": 3.0}`), recorded in the
    summary; the run's own batch, schedule and logging fields are not overridable.

    `final_heldout`: after training, also measure the greedy accuracy on this many further problems, disjoint from
    the training and the curve's held-out problems (`settings.final_heldout`, the long task's), so that the final
    accuracy has less evaluation noise than the curve's `num_heldout` give; the warm start is unchanged. Saved as
    the summary's `final_heldout` (accuracy, problem count, and each problem's 0/1 in order).

    `num_threads` torch threads for the run (restored afterwards): one thread is barely slower than two on an idle
    2-core machine for a model this small, and many times faster when other processes share the cores.
    """
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        return _run(algorithm, seed, max_steps, output_dir, eval_every, num_heldout, cache_dir, use_cache, settings,
                    disable_tqdm, config_overrides or {}, final_heldout)  # fmt: skip
    finally:
        torch.set_num_threads(previous_threads)


def _run(algorithm, seed, max_steps, output_dir, eval_every, num_heldout, cache_dir, use_cache, settings, disable_tqdm,
         config_overrides, final_heldout):  # fmt: skip
    from .. import DHPOTrainer  # heavy import, deferred so that `--help` answers at once

    if algorithm not in PAPER_ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is unknown: choose one of {list(PAPER_ALGORITHMS)}.")
    settings = settings or EmbeddedSettings()
    max_steps = settings.max_steps if max_steps is None else max_steps
    eval_every = settings.eval_every if eval_every is None else eval_every
    num_heldout = settings.num_heldout if num_heldout is None else num_heldout
    for name, value in (("max_steps", max_steps), ("eval_every", eval_every), ("num_heldout", num_heldout)):
        if value < 1:
            raise ValueError(f"{name}={value} must be a positive integer.")
    if final_heldout is not None:
        if not hasattr(settings, "final_heldout"):
            raise ValueError(f"final_heldout={final_heldout}: {type(settings).__name__} has no final held-out set; "
                             "use the long task (LongSettings) or leave final_heldout unset.")  # fmt: skip
        if final_heldout < 1:
            raise ValueError(f"final_heldout={final_heldout} must be a positive integer.")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    run_fields = dict(
        output_dir=str(output_dir),
        # Off-policy as in the paper: one generation batch feeds k = settings.steps_per_generation optimizer steps
        # (TRL's steps_per_generation counts micro-batches: k x gradient_accumulation_steps).
        per_device_train_batch_size=settings.per_device_train_batch_size(),
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        steps_per_generation=settings.steps_per_generation * settings.gradient_accumulation_steps,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        temperature=1.0,
        top_p=1.0,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        beta=0.0,
        max_steps=max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=seed,
        data_seed=seed,
        disable_tqdm=disable_tqdm,
    )
    fixed = sorted(set(config_overrides) & set(run_fields))
    if fixed:
        raise ValueError(f"config_overrides={fixed} are set by the embedded run itself: change EmbeddedSettings instead.")
    # Built before the warm start, so that a bad override fails at once.
    args = config_for(algorithm, **run_fields, **config_overrides)

    train_problems, heldout_problems, (model, tokenizer, from_cache) = load_task(
        settings, num_heldout, cache_dir=cache_dir, use_cache=use_cache
    )
    # Drawn before training, so that a set too large for the task's problem space fails before any RL step.
    final_problems = None if final_heldout is None else settings.final_heldout(final_heldout, train_problems,
                                                                               heldout_problems)  # fmt: skip
    warm_seconds = time.perf_counter() - started
    reward = memoized_reward(math_verify_reward)  # one memo for training and evaluation: same scores, less time
    before = greedy_accuracy(model, tokenizer, heldout_problems, max_new_tokens=settings.max_completion_length,
                             reward=reward)  # fmt: skip
    baseline_seconds = time.perf_counter() - started - warm_seconds
    warm_steps, probe_accuracy = model.config.warm_start_steps, model.config.warm_start_probe_accuracy
    stopped = "" if probe_accuracy is None else f", right on {probe_accuracy:.0%} of the training probe"
    print(f"Warm start ({warm_steps} supervised steps{stopped}) {'loaded from cache' if from_cache else 'trained'} "
          f"in {warm_seconds:.1f}s; held-out accuracy before RL: {before:.1%}", flush=True)  # fmt: skip

    callback = HeldoutAccuracyCallback(
        tokenizer, heldout_problems, every=eval_every, max_new_tokens=settings.max_completion_length, initial=before,
        reward=reward,
    )  # fmt: skip
    trainer = DHPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=to_dataset(train_problems),
        processing_class=tokenizer,
        callbacks=[callback],
    )
    if disable_tqdm:
        trainer.remove_callback(PrinterCallback)  # no bar, no per-step dicts: the summary and evals still print
    else:
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(CompactProgressCallback)
    train_started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - train_started
    if (stop := trainer.graceful_stop) is not None:
        raise TrainingStopped(
            f"stopped by {stop['signal']} after step {stop['step']} of {trainer.state.max_steps} (checkpoint "
            f"{stop['checkpoint']}): not a finished run, no summary written; run it again", stop,
        )  # fmt: skip
    final, final_seconds = None, 0.0
    if final_problems is not None:
        final_started = time.perf_counter()
        scores = greedy_scores(model, tokenizer, final_problems, max_new_tokens=settings.max_completion_length,
                               reward=reward, by_length=True)  # fmt: skip
        final = {"num_problems": len(final_problems), "accuracy": sum(scores) / len(final_problems),
                 "correct": "".join("1" if score == 1.0 else "0" for score in scores)}  # fmt: skip
        final_seconds = time.perf_counter() - final_started
        print(f"Final held-out accuracy on {len(final_problems)} further problems: {final['accuracy']:.1%}", flush=True)
    save_started = time.perf_counter()

    checkpoint_dir = output_dir / "checkpoint-final"
    trainer.save_model(str(checkpoint_dir))
    # TRL writes the model card (with the DHPO settings) into args.output_dir; the checkpoint must carry it.
    trainer.create_model_card(model_name=f"tiny-qwen3-{settings.task}-{algorithm}")
    shutil.move(output_dir / "README.md", checkpoint_dir / "README.md")
    log_history_path = output_dir / "trainer_state.json"
    trainer.state.save_to_json(str(log_history_path))
    plot_path = output_dir / "training_curves.png"
    _plot(trainer.state.log_history, plot_path, f"{algorithm} on {settings.title} (seed {seed})")

    accuracies = _series(trainer.state.log_history, "eval/heldout_accuracy")
    phases = {  # seconds per phase; "rl" includes the held-out evaluations during training ("rl_evaluation")
        "warm_start": warm_seconds, "baseline_evaluation": baseline_seconds, "rl": train_seconds,
        "rl_evaluation": callback.seconds, "final_evaluation": final_seconds, "save": time.perf_counter() - save_started,
    }  # fmt: skip
    summary = {
        "algorithm": algorithm,
        "seed": seed,
        "heldout_accuracy_before": before,
        "heldout_accuracy_after": accuracies[-1][1],
        "heldout_accuracies": accuracies,
        "reward": _series(trainer.state.log_history, "reward"),
        "entropy": _series(trainer.state.log_history, "entropy"),
        "optimizer_steps": trainer.state.global_step,
        "parameters": sum(p.numel() for p in model.parameters()),
        "num_heldout": num_heldout,
        "final_heldout": final,
        "warm_start_from_cache": from_cache,
        "warm_start_key": getattr(model.config, "warm_start_key", None),  # None: a model not from load_or_warm_start
        "warm_start_steps": warm_steps,
        "warm_start_seconds": round(warm_seconds, 2),
        "train_seconds": round(train_seconds, 2),
        "wall_seconds": round(time.perf_counter() - started, 2),
        "phase_seconds": {name: round(seconds, 2) for name, seconds in phases.items()},
        "checkpoint_dir": str(checkpoint_dir),
        "plot_path": str(plot_path),
        "log_history_path": str(log_history_path),
        "summary_path": str(output_dir / "summary.json"),
        "settings": {**asdict(settings), "max_steps": max_steps, "eval_every": eval_every},
        "config_overrides": config_overrides,
        "commit": source_commit(),
        "task": settings.task,
    }
    write_atomically(Path(summary["summary_path"]), json.dumps(summary, indent=2))
    return summary


def write_atomically(path: Path, text: str) -> None:
    """`path.write_text(text)` through a temporary file: a process killed mid-write never leaves a truncated file
    under the final name (a study reads a cell's summary.json to decide that the cell is done)."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _print_summary(summary: dict) -> None:
    gain = summary["heldout_accuracy_after"] - summary["heldout_accuracy_before"]
    phases = summary["phase_seconds"]
    print(
        f"\n{summary['algorithm']} done: held-out accuracy {summary['heldout_accuracy_before']:.1%} -> "
        f"{summary['heldout_accuracy_after']:.1%} ({gain * 100:+.1f} points) on {summary['num_heldout']} problems\n"
        f"  optimizer steps : {summary['optimizer_steps']}\n"
        f"  wall time       : {summary['wall_seconds']:.0f}s = warm start {phases['warm_start']:.0f}s"
        f"{' (cached)' if summary['warm_start_from_cache'] else ''} + accuracy before RL "
        f"{phases['baseline_evaluation']:.0f}s + RL {phases['rl']:.0f}s (of which held-out evaluations "
        f"{phases['rl_evaluation']:.0f}s) + saving {phases['save']:.0f}s\n"
        f"  checkpoint      : {summary['checkpoint_dir']}\n"
        f"  plot            : {summary['plot_path']}\n"
        f"  log history     : {summary['log_history_path']}\n"
        f"  summary         : {summary['summary_path']}\n"
        "Next: how the objectives compare as updates go off-policy, docs/study/staleness.md; the Python API on this "
        "task, examples/notebooks/dhpo_quickstart.ipynb"
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m dhpo_trl`: 0, 2 after a one-line error for bad input (see `dhpo_trl.user_errors`), or 1 after one
    for a non-finite gradient norm; `--debug` prints the traceback instead of the line, with the same status."""
    parser = argparse.ArgumentParser(
        prog="python -m dhpo_trl",
        description="Train DHPO (or a paper baseline) on CPU, offline: a warm-started tiny Qwen3 on synthetic addition.",
    )
    parser.add_argument("--algorithm", default="DHPO-E", choices=list(PAPER_ALGORITHMS))
    parser.add_argument("--task", default="addition", choices=["addition", "long"],
                        help="addition: two-digit sums, completions <= 12 tokens (default); long: chained arithmetic "
                             "with a scratchpad, completions of about 30-400 tokens (dhpo_trl.demo.long_task)")  # fmt: skip
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--max-steps", type=positive_int, default=None,
                        help=f"RL optimizer steps ({EmbeddedSettings.max_steps})")  # fmt: skip
    parser.add_argument("--output-dir", default="outputs/embedded")
    parser.add_argument("--eval-every", type=positive_int, default=None, help=f"({EmbeddedSettings.eval_every})")
    parser.add_argument("--num-heldout", type=positive_int, default=None, help=f"({EmbeddedSettings.num_heldout})")
    parser.add_argument("--cache-dir", default=None, help="warm-start cache (default ~/.cache/dhpo_trl)")
    parser.add_argument("--no-cache", action="store_true", help="always retrain the warm start, save nothing")
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    options = parser.parse_args(argv)
    if options.no_cache and options.cache_dir is not None:
        parser.error("--cache-dir has no effect with --no-cache (the warm start is retrained and not saved): drop one.")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the network

    def setup() -> None:
        make_folder(options.output_dir, "--output-dir")
        if options.cache_dir is not None:
            make_folder(options.cache_dir, "--cache-dir")

    def work(_) -> None:
        from .long_task import LongSettings  # imports this module: loaded here, not at the top

        try:
            summary = run_embedded(
                options.algorithm, options.seed, options.max_steps, options.output_dir, eval_every=options.eval_every,
                num_heldout=options.num_heldout, cache_dir=options.cache_dir, use_cache=not options.no_cache,
                settings=LongSettings() if options.task == "long" else None,
            )  # fmt: skip
        except TrainingStopped as stopped:
            raise SystemExit(stopped.report("python -m dhpo_trl:")) from None
        except NonFiniteGradientError as error:  # one line (--debug: its traceback) and status 1, as dhpo-train
            report("python -m dhpo_trl", error, debug=options.debug)
            raise SystemExit(1) from None
        _print_summary(summary)

    return run_command("python -m dhpo_trl", setup, work, debug=options.debug)
