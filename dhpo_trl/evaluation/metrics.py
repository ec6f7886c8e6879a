"""Scores from per-sample correctness, and the paper's Table-1 layout.

Avg@k is the Pass@1 estimate from k samples: the mean correctness over a problem's samples, averaged over problems.
With k = 1 it is plain Pass@1. Scores are percentages; the AVG column is the unweighted mean over the benchmarks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .benchmarks import BENCHMARKS


def problem_score(correct: Sequence[float]) -> float:
    """Fraction of one problem's samples that are correct."""
    if not correct:
        raise ValueError("A problem needs at least one scored sample.")
    return sum(correct) / len(correct)


def benchmark_score(per_problem_correct: Sequence[Sequence[float]]) -> float:
    """Avg@k (Pass@1 when k = 1) in percent: mean over problems of the per-problem mean correctness."""
    if not per_problem_correct:
        raise ValueError("A benchmark needs at least one problem to score.")
    return 100.0 * sum(problem_score(c) for c in per_problem_correct) / len(per_problem_correct)


def average_score(scores: Mapping[str, float]) -> float:
    """The AVG column: unweighted mean of the benchmark scores (each benchmark counts once, whatever its size)."""
    if not scores:
        raise ValueError("No benchmark scores to average.")
    return sum(scores.values()) / len(scores)


def format_table(rows: Mapping[str, Mapping[str, float]], samples: Mapping[str, int]) -> str:
    """Markdown table laid out like Table 1: one row per model, benchmarks in the paper's order, then AVG.

    `rows` maps a row label (model) to {benchmark name: score}; `samples` gives each benchmark's samples per problem,
    which sets its header ("AIME24 (Avg@32)", or plain "GSM8K" for one sample). A row without a score for one of
    the table's benchmarks shows "-" there and in AVG: an average over fewer benchmarks is not comparable.
    """
    names = [name for name in BENCHMARKS if any(name in scores for scores in rows.values())]
    headers = ["Model"] + [BENCHMARKS[name].header(samples.get(name)) for name in names] + ["AVG"]
    body = []
    for label, scores in rows.items():
        cells = [f"{scores[name]:.1f}" if name in scores else "-" for name in names]
        complete = all(name in scores for name in names)
        body.append([label] + cells + [f"{average_score({n: scores[n] for n in names}):.1f}" if complete else "-"])
    widths = [max(len(row[i]) for row in [headers] + body) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + " |"

    separator = "|" + "|".join("-" * (width + 2) for width in widths) + "|"
    return "\n".join([line(headers), separator] + [line(row) for row in body])
