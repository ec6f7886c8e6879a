"""Check the benchmark loaders against the real test sets (not part of CI: the data is not in the repository).

    python scripts/check_shared_benchmarks.py [DATA_DIR]   # default: ../shared/benchmarks next to the repository

For each of the seven benchmarks: the number of problems must match the official test set, every question and
answer must be non-empty, and the gold answer written as a model would (`\\boxed{answer}`) must score 1.0 with the
project's own scorer. Also reported: how many gold answers math-verify parses into a mathematical object (the rest
can only match a string-identical prediction, e.g. text answers). Exits 1 on a count, emptiness or self-score failure.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from math_verify import LatexExtractionConfig, parse

from dhpo_trl.evaluation.benchmarks import BENCHMARKS, load_benchmark
from dhpo_trl.rewards import score_answer

DEFAULT_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "benchmarks"


def check(data_dir: Path) -> bool:
    all_ok = True
    print(f"{'benchmark':<14}{'problems':>9}{'expected':>9}{'self-score':>12}{'parsed':>10}  first answers")
    for name, spec in BENCHMARKS.items():
        started = time.time()
        problems = load_benchmark(name, data_dir / name)
        empty = [p.index for p in problems if not p.question.strip() or not p.answer.strip()]
        self_scores = [score_answer(f"\\boxed{{{p.answer}}}", p.answer) for p in problems]
        self_ok = sum(self_scores)
        parsed = sum(bool(parse(f"\\boxed{{{p.answer.strip('$')}}}", [LatexExtractionConfig()])) for p in problems)
        ok = len(problems) == spec.expected_size and not empty and self_ok == len(problems)
        all_ok &= ok
        examples = ", ".join(repr(p.answer) for p in problems[:3])
        print(
            f"{name:<14}{len(problems):>9}{spec.expected_size:>9}{f'{self_ok:.0f}/{len(problems)}':>12}"
            f"{f'{parsed}/{len(problems)}':>10}  {examples}"
            f"  [{time.time() - started:.1f}s]{'' if ok else '  <-- FAIL'}"
        )
        if empty:
            print(f"    empty question or answer at indices {empty[:10]}")
        for problem, score in zip(problems, self_scores):
            if score < 1.0:
                print(f"    gold answer does not verify against itself: index {problem.index}: {problem.answer!r}")
    return all_ok


if __name__ == "__main__":
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR
    if not directory.is_dir():
        print(f"No benchmark data at {directory}; nothing to check.")
        sys.exit(0)
    sys.exit(0 if check(directory) else 1)
