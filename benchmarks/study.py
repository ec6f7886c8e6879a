"""Side-by-side study of the paper's seven objectives on the embedded CPU task (small scale, not the paper's run).

    python benchmarks/study.py --seeds 0 1 2 --workers 2 --out-dir outputs/study --docs-dir docs/study

Every (algorithm, seed) run is `dhpo_trl.demo.embedded.run_embedded`: the same warm-started tiny Qwen3, the same
synthetic addition task, the same budget (optimizer steps, batch, learning rate), off-policy (two optimizer steps
per generation batch); only the objective and the RL seed change. Runs whose `summary.json` already exists are
reused, so an interrupted study resumes. Writes to `--docs-dir`: `README.md` (the table and the command),
`results.json` (per-run and aggregate numbers) and the overlaid training curves (PNG), each curve the mean over
seeds of one algorithm.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from dhpo_trl.core.presets import PAPER_ALGORITHMS
from dhpo_trl.demo.cell_pool import cell_pool, reported
from dhpo_trl.demo.embedded import run_embedded
from dhpo_trl.evaluation.plotting import plot_runs
from dhpo_trl.user_errors import DEBUG_FLAG, DEBUG_HELP, debug_given, repeated_values, seed_int


def saved_summary(job: tuple[str, int, Path, int | None]) -> dict | None:
    """The summary of `job`'s finished run (a stopped one writes none), or None; a run of another budget is refused
    (SystemExit naming its folder)."""
    algorithm, seed, out_dir, max_steps = job
    run_dir = out_dir / f"{algorithm}-seed{seed}"
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        return None
    summary = json.loads(summary_path.read_text())
    if max_steps is not None and summary.get("optimizer_steps") != max_steps:
        raise SystemExit(f"{summary_path} ran {summary.get('optimizer_steps')} optimizer steps, not --max-steps "
                         f"{max_steps}: remove {run_dir} (or pass its --max-steps) to run it again.")
    return summary


def _run_one(job: tuple[str, int, Path, int | None]) -> dict:
    summary = saved_summary(job)  # a finished run is reused
    if summary is not None:
        return summary
    algorithm, seed, out_dir, max_steps = job
    run_dir = out_dir / f"{algorithm}-seed{seed}"
    summary = run_embedded(algorithm, seed=seed, max_steps=max_steps, output_dir=run_dir, disable_tqdm=True)
    print(f"[study] {algorithm} seed {seed}: {summary['heldout_accuracy_before']:.3f} -> "
          f"{summary['heldout_accuracy_after']:.3f} in {summary['train_seconds']:.0f}s", flush=True)  # fmt: skip
    return summary


def in_plan_order(jobs: list[tuple[str, int, Path, int | None]], finished: Iterable[dict]) -> list[dict]:
    """The summaries of `jobs`' cells, `finished` in any order, in the order of `jobs` (the page's rows): each job's
    own, found by its objective and seed."""
    by_cell = {(summary["algorithm"], summary["seed"]): summary for summary in finished}
    return [by_cell[algorithm, seed] for algorithm, seed, _, _ in jobs]


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def steps_to_target(accuracies: list[list[float]], target: float) -> float | None:
    """First evaluated step whose held-out accuracy reaches `target`, or None if it never does."""
    return next((step for step, accuracy in accuracies if accuracy >= target), None)


def late_entropy(entropy: list[list[float]], fraction: float = 0.2) -> float:
    """Mean policy entropy over the last `fraction` of the logged steps."""
    values = [value for _, value in entropy]
    tail = values[-max(1, int(len(values) * fraction)) :]
    return statistics.fmean(tail)


def mean_log_history(states: list[Path]) -> list[dict]:
    """Average every numeric metric over runs, step by step (entries of the same step are merged first)."""
    per_step: dict[int, dict[str, list[float]]] = {}
    for state in states:
        merged: dict[int, dict[str, float]] = {}
        for entry in json.loads(state.read_text())["log_history"]:
            if "step" in entry:
                merged.setdefault(entry["step"], {}).update(
                    {k: v for k, v in entry.items() if isinstance(v, (int, float)) and k != "step"}
                )
        for step, metrics in merged.items():
            for key, value in metrics.items():
                per_step.setdefault(step, {}).setdefault(key, []).append(float(value))
    return [{"step": step, **{k: statistics.fmean(v) for k, v in sorted(m.items())}} for step, m in sorted(per_step.items())]


def aggregate(summaries: list[dict], target: float) -> dict[str, dict]:
    table = {}
    for algorithm in PAPER_ALGORITHMS:
        runs = [s for s in summaries if s["algorithm"] == algorithm]
        if not runs:
            continue
        finals = [s["heldout_accuracy_after"] for s in runs]
        peaks = [max(a for _, a in s["heldout_accuracies"]) for s in runs]
        reached = [steps_to_target(s["heldout_accuracies"], target) for s in runs]
        entropies = [late_entropy(s["entropy"]) for s in runs]
        table[algorithm] = {
            "seeds": [s["seed"] for s in runs],
            "accuracy_before": runs[0]["heldout_accuracy_before"],
            "final_accuracy": _mean_std(finals),
            "peak_accuracy": _mean_std(peaks),
            "steps_to_target": [r for r in reached],
            "late_entropy": _mean_std(entropies),
            "train_seconds": statistics.fmean(s["train_seconds"] for s in runs),
        }
    return table


def markdown(table: dict[str, dict], target: float, command: str, steps: int, train_minutes: float,
             commits: list[str], machine: str, eval_every: int, parameters: int, num_heldout: int) -> str:
    lines = [
        "# Side-by-side study on the embedded CPU task",
        "",
        "**Small-scale study, not the paper's experiment**: a tiny warm-started Qwen3-architecture model",
        f"({parameters:,} parameters) on synthetic two-digit addition, trained off-policy (two optimizer steps per generation batch) with",
        "each of the paper's seven objectives and identical budgets. It checks that every objective trains and shows how",
        "they behave on this toy task; it says nothing about the paper's Table 1 at scale.",
        "",
        f"Produced on {machine} with the code at commit {', '.join(commits)} ({train_minutes:.0f} min of RL training",
        "over all runs) by:",
        "",
        "```bash",
        command,
        "```",
        "",
        f"Held-out accuracy is greedy exact match on {num_heldout} problems (math-verify `\\boxed{{}}` reward), measured every",
        f"{eval_every} of {steps} optimizer steps; mean ± sample std over seeds. *Steps to {target:.0%}*: first evaluated step at",
        "which held-out accuracy reached the target, per seed (— never). *Late entropy*: mean policy entropy over the",
        "last 20% of steps.",
        "",
        f"| objective | seeds | accuracy before | final accuracy | peak accuracy | steps to {target:.0%} | late entropy |",
        "|---|---|---|---|---|---|---|",
    ]
    means = [row["final_accuracy"][0] for row in table.values()]
    spread, noise = max(means) - min(means), statistics.fmean(row["final_accuracy"][1] for row in table.values())
    for algorithm, row in table.items():
        final, peak, entropy = row["final_accuracy"], row["peak_accuracy"], row["late_entropy"]
        reached = ", ".join("—" if r is None else str(r) for r in row["steps_to_target"])
        lines.append(
            f"| {algorithm} | {len(row['seeds'])} | {row['accuracy_before']:.1%} | {final[0]:.1%} ± {final[1]:.1%} | "
            f"{peak[0]:.1%} ± {peak[1]:.1%} | {reached} | {entropy[0]:.3f} ± {entropy[1]:.3f} |"
        )
    verdict = "smaller than" if spread < 2 * noise else "larger than"
    lines += [
        "",
        f"The final accuracies of the objectives span {spread:.1%} (best minus worst mean), {verdict} twice the typical",
        f"seed-to-seed standard deviation ({noise:.1%}): with {len(next(iter(table.values()))['seeds'])} seeds on this toy task,"
        " read the ranking accordingly.",
        "",
        "Curves (mean over seeds per objective): ![accuracy](accuracy.png) ![entropy](entropy.png)",
        "![response length](response_length.png) ![mixing weight](mixing_weight.png) ![clip fractions](clip_fraction.png)",
        "",
    ]
    return "\n".join(lines)


def page_from_json(results: dict) -> str:
    """The page `README.md` for the saved `results.json`."""
    return markdown(results["aggregate"], results["target"], results["command"], results["steps"],
                    results["train_minutes"], results["commits"], results["machine"],
                    results["runs"][0]["heldout_accuracies"][1][0] - results["runs"][0]["heldout_accuracies"][0][0],
                    results["runs"][0]["parameters"], results["runs"][0]["num_heldout"])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", nargs="+", default=list(PAPER_ALGORITHMS), choices=list(PAPER_ALGORITHMS))
    parser.add_argument("--seeds", nargs="+", type=seed_int, default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps per run (default: the embedded default)")
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (one torch thread each)")
    # The warm start begins near 50% held-out accuracy and runs end near 85-90%: 80% separates fast from slow.
    parser.add_argument("--target", type=float, default=0.80, help="held-out accuracy for 'steps to target'")
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/study"))
    parser.add_argument("--docs-dir", type=Path, default=Path("docs/study"))
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)  # acted on by `cli` (cell_pool.reported)
    args = parser.parse_args(argv)
    if len(args.seeds) < 1 or args.workers < 1:
        parser.error("--seeds needs at least one seed and --workers must be >= 1")
    if repeated := repeated_values(args, "algorithms", "seeds"):
        parser.error(repeated)

    jobs = [(algorithm, seed, args.out_dir, args.max_steps) for seed in args.seeds for algorithm in args.algorithms]
    for job in jobs:  # here, before anything trains: a saved run of another budget is refused by the main process
        saved_summary(job)
    started = time.perf_counter()
    # Warm start once, before the workers, so they all load it from the cache instead of racing to train it.
    run_embedded(args.algorithms[0], seed=args.seeds[0], max_steps=1, output_dir=args.out_dir / "_warmup",
                 num_heldout=1, disable_tqdm=True)  # fmt: skip
    # A stop signal or an error ends the workers too (dhpo_trl/demo/cell_pool.py). The cells are taken as they finish,
    # so a cell that raises ends the study at once: the finished ones are saved, the ones still running are rerun.
    with cell_pool(args.workers) as pool:
        summaries = in_plan_order(jobs, pool.imap_unordered(_run_one, jobs))
    wall_minutes = (time.perf_counter() - started) / 60
    budgets = {(s["algorithm"], s["seed"]): s["optimizer_steps"] for s in summaries}
    if len(set(budgets.values())) != 1:  # a stale run from another budget in --out-dir would skew the comparison
        raise SystemExit(f"Runs in {args.out_dir} have different step budgets {budgets}: remove the stale ones.")

    table = aggregate(summaries, args.target)
    args.docs_dir.mkdir(parents=True, exist_ok=True)
    mean_dirs = []
    for algorithm in table:
        states = [args.out_dir / f"{algorithm}-seed{seed}" / "trainer_state.json" for seed in args.seeds]
        mean_dir = args.out_dir / "mean" / algorithm
        mean_dir.mkdir(parents=True, exist_ok=True)
        (mean_dir / "trainer_state.json").write_text(json.dumps({"log_history": mean_log_history(states)}))
        mean_dirs.append(mean_dir)
    figures = plot_runs(mean_dirs, list(table), args.out_dir / "plots")
    for name, figure in figures.items():
        figure.savefig(args.docs_dir / f"{name}.png", dpi=100)

    given = argv if argv is not None else sys.argv[1:]
    command = "python benchmarks/study.py " + " ".join(arg for arg in given if not debug_given([arg]))
    fields = ("algorithm", "seed", "heldout_accuracy_before", "heldout_accuracy_after", "heldout_accuracies",
              "optimizer_steps", "train_seconds", "commit", "parameters", "num_heldout")  # fmt: skip
    runs = [{k: s.get(k) for k in fields} for s in summaries]
    results = {
        "machine": f"{platform.machine()} CPU, {multiprocessing.cpu_count()} cores, {args.workers} workers",
        "wall_minutes": wall_minutes, "target": args.target, "command": command.strip(),
        "steps": summaries[0]["optimizer_steps"], "train_minutes": sum(s["train_seconds"] for s in summaries) / 60,
        "commits": sorted({str(s.get("commit")) for s in summaries}), "aggregate": table, "runs": runs,
    }  # fmt: skip
    (args.docs_dir / "results.json").write_text(json.dumps(results, indent=1))
    # The page is written from the JSON just saved, so every figure on it is the JSON's (tests/test_study_pages.py).
    (args.docs_dir / "README.md").write_text(page_from_json(json.loads((args.docs_dir / "results.json").read_text())))
    print((args.docs_dir / "README.md").read_text())
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`main`, with a stop or a lost cell (a dead worker, a cell's `SystemExit`) reported on one line of stderr: the
    exit status."""
    return reported(main, argv, "[study]")


if __name__ == "__main__":
    sys.exit(cli())
