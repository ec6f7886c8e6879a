"""How much of a final accuracy's seed-to-seed spread a larger evaluation set would remove.

Each seed's policy is scored 0/1 on the same N problems. The seed variance of its accuracy (the mean of its N
scores) is exactly the mean of the N x N sample covariance matrix of the scores between seeds (`seed_noise`):

    s^2 = (1 / N^2) sum_j sum_l cov_seeds(c_j, c_l)
        = d^2 (the diagonal: each problem's own disagreement between seeds, sum_j var_seeds(c_j) / N^2)
        + the rest (problems moving together: the seeds' policies being better or worse overall).

Drawn afresh, the diagonal shrinks as 1/N and the rest does not, so d is the evaluation noise between seeds and
sqrt(s^2 - d^2) the training noise that no evaluation set removes. The binomial sqrt(p (1 - p) / N) is what d would
be if every problem were equally hard for every seed; problems that every seed solves (or none does) disagree
less, so it bounds d from above.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def seed_noise(correct: Sequence[str]) -> dict:
    """The decomposition for one row: `correct` holds, per seed, its 0/1 score on each of the same N problems as a
    string of "0" and "1" (at least two seeds). Returns the mean accuracy, the seed std `s` (sample std), the
    binomial evaluation std at N, the measured evaluation std `d` and the training std sqrt(max(0, s^2 - d^2)),
    all as fractions."""
    if len(correct) < 2:
        raise ValueError(f"seed_noise: {len(correct)} seed(s); a seed std needs at least two.")
    n = len(correct[0])
    if n < 1 or any(len(c) != n for c in correct) or any(set(c) - {"0", "1"} for c in correct):
        raise ValueError("seed_noise: every seed needs a 0/1 string over the same, non-empty set of problems.")
    accuracies = [c.count("1") / n for c in correct]
    mean = statistics.fmean(accuracies)
    seed_std = statistics.stdev(accuracies)
    per_problem = sum(statistics.variance([int(c[j]) for c in correct]) for j in range(n))
    evaluation = math.sqrt(per_problem) / n
    return {
        "mean": mean,
        "seed_std": seed_std,
        "binomial_std": math.sqrt(mean * (1 - mean) / n),
        "evaluation_std": evaluation,
        "training_std": math.sqrt(max(0.0, seed_std**2 - evaluation**2)),
        "problems": n,
        "seeds": len(correct),
    }
