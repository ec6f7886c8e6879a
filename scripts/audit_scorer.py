"""Audit the scorer on the seven real test sets (not part of CI: the data is not in the repository).

    python scripts/audit_scorer.py [DATA_DIR] [--rotations 3]   # default: the nearest shared/benchmarks above

For every gold (see dhpo_trl/evaluation/audit.py): a correct answer in another form must score 1; the last number
+ 1, the sign flipped, a wrong base, the next choice letter and the golds of other problems must score 0. Prints a
table per benchmark (golds read as mathematics, words, string-only golds, rewrite acceptance, false positives,
mean/max scoring time) and every finding; exits 1 if a benchmark has the wrong size, a gold cannot be read, or a
finding is not one of the documented exceptions below (docs/grading.md explains each one).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dhpo_trl.evaluation.audit import audit_benchmark, format_table
from dhpo_trl.evaluation.benchmarks import BENCHMARKS, load_benchmark

# the nearest shared/benchmarks above the repository (a checkout or a worktree of it)
DEFAULT_DIR = next(
    (p / "shared" / "benchmarks" for p in Path(__file__).resolve().parents if (p / "shared" / "benchmarks").is_dir()),
    Path("shared/benchmarks"),
)

# (benchmark, index, check) -> why the finding is right. Every entry is explained in docs/grading.md.
KNOWN = {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--rotations", type=int, default=3, help="other problems' golds tried per problem")
    parser.add_argument("--benchmarks", default=",".join(BENCHMARKS))
    args = parser.parse_args(argv)
    if not args.data_dir.is_dir():
        print(f"No benchmark data at {args.data_dir}; nothing to audit.")
        return 0
    logging.basicConfig(level=logging.ERROR)
    reports, failed = [], False
    for name in args.benchmarks.split(","):
        problems = load_benchmark(name, args.data_dir / name)
        if len(problems) != BENCHMARKS[name].expected_size:
            print(f"{name}: {len(problems)} problems, expected {BENCHMARKS[name].expected_size}")
            failed = True
        report = audit_benchmark(name, [p.answer for p in problems], rotations=args.rotations)
        reports.append(report)
        print(f"[{name}] done", file=sys.stderr)
    print(format_table(reports))
    for report in reports:
        for index, gold in report.unreadable:
            print(f"UNREADABLE {report.name}[{index}]: {gold!r}")
            failed = True
        for index, gold in report.words:
            print(f"word answer {report.name}[{index}]: {gold!r}")
        for finding in report.rejected_rewrites + report.false_positives + report.deadline_hits:
            known = KNOWN.get((report.name, finding.index, finding.check))
            print(
                f"{'known' if known else 'FAIL '} {report.name}[{finding.index}] {finding.check}: gold {finding.gold!r}"
                f" answer {finding.answer!r} scored {finding.score}" + (f"  ({known})" if known else "")
            )
            failed |= known is None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
