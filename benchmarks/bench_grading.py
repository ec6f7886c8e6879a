"""Grading throughput: the bounded worker process against the old in-process grade, on the seven test sets.

    python benchmarks/bench_grading.py [DATA_DIR]      # default: the nearest shared/benchmarks above the repository

Every gold's generated correct rewrite and its near misses (`dhpo_trl.evaluation.audit`), each written as a
completion with a box, are graded by three arms, interleaved answer by answer in one process, after one warm-up pass
(training grades the same golds over and over, so every arm's gold cache is warm):

- `in-process`: the old main-thread path, `answers_match_with_deadline` (SIGALRM; C code cannot be interrupted and
  memory is unbounded, which is why it is gone);
- `worker`: `score_answer`, one completion per round trip to the worker process (time, memory and CPU bounded);
- `worker, batch of 16`: `math_verify_reward` on 16 completions at a time, as TRL calls a reward function (one round
  trip per batch), its time divided by 16 per answer.

Prints the mean, p50 and p99 milliseconds per answer of each arm and the ratio of means to the in-process arm.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from dhpo_trl.evaluation.audit import near_misses, rewrite
from dhpo_trl.evaluation.benchmarks import BENCHMARKS, load_benchmark
from dhpo_trl.scoring import _math_verify_core, rewards

DEFAULT_DIR = next(
    (p / "shared" / "benchmarks" for p in Path(__file__).resolve().parents if (p / "shared" / "benchmarks").is_dir()),
    Path("shared/benchmarks"),
)
BATCH = 16


def in_process(completion: str, gold: str) -> float:
    """The grade as the main thread did it before the worker: same extraction, SIGALRM deadline, no memory bound."""
    answer, gold = rewards.extract_answer(completion), rewards.gold_text(gold)
    if not answer or not gold:
        return 0.0
    return float(_math_verify_core.answers_match_with_deadline(answer, gold, rewards.DEFAULT_TIMEOUT_S))


def pairs_from(data_dir: Path, names: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for name in names:
        for problem in load_benchmark(name, data_dir / name):
            gold = problem.answer
            for answer in [rewrite(gold), *(wrong for _, wrong in near_misses(gold))]:
                pairs.append((f"The answer is $\\boxed{{{answer}}}$.", gold))
    return pairs


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--benchmarks", default=",".join(BENCHMARKS))
    args = parser.parse_args(argv)
    if not args.data_dir.is_dir():
        print(f"No benchmark data at {args.data_dir}; nothing to measure.")
        return 0
    pairs = pairs_from(args.data_dir, args.benchmarks.split(","))
    batches = [pairs[i : i + BATCH] for i in range(0, len(pairs), BATCH)]
    times: dict[str, list[float]] = {"in-process": [], "worker": [], f"worker, batch of {BATCH}": []}
    disagreements = 0
    for timed in (False, True):  # a warm-up pass, then the measured one
        for number, batch in enumerate(batches):
            arms, scores = ["in-process", "worker", "batch"], {}
            for arm in arms if number % 2 == 0 else arms[::-1]:  # interleaved, order alternating
                if arm == "batch":
                    started = time.perf_counter()
                    scores[arm] = rewards.math_verify_reward([c for c, _ in batch], answer=[g for _, g in batch])
                    elapsed = (time.perf_counter() - started) / len(batch)
                    if timed:
                        times[f"worker, batch of {BATCH}"].extend([elapsed] * len(batch))
                    continue
                grade = in_process if arm == "in-process" else rewards.score_answer
                scores[arm] = []
                for completion, gold in batch:
                    started = time.perf_counter()
                    scores[arm].append(grade(completion, gold))
                    if timed:
                        times[arm].append(time.perf_counter() - started)
            if timed:
                disagreements += sum(len(set(triple)) > 1 for triple in zip(*scores.values()))
    base = statistics.fmean(times["in-process"])
    print(f"{len(pairs)} completions ({args.benchmarks}): correct rewrites and near misses of every gold\n")
    print("| arm | mean ms | p50 ms | p99 ms | mean / in-process |\n|---|---|---|---|---|")
    for arm, values in times.items():
        mean = statistics.fmean(values)
        print(f"| {arm} | {1e3 * mean:.2f} | {1e3 * percentile(values, 0.5):.2f} | {1e3 * percentile(values, 0.99):.2f}"
              f" | {mean / base:.2f}x |")  # fmt: skip
    print(f"\nthe three arms' scores differ on {disagreements} completions (the guards refuse before the old path parses)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
