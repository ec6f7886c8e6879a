"""A synthetic task with long, variable-length completions: a running total worked through in a written scratchpad,
one line per step, the final total boxed.

    Q: start 17, add 8, steps a to c
    A: a: 017+8=025
    b: 025+8=033
    c: 033+8=041
    \\boxed{41}

Every line has the same width (totals written with three digits), so the previous total and the step sit at fixed
distances from the digits being written: a two-layer model learns the scratchpad from a few hundred supervised
steps, and its errors are the sums' digits and where to stop. The number of steps is drawn long-tailed
(log-normal), so completions run from about 40 to 360 tokens of the character tokenizer with a median above 100:
the regime where one sequence ratio averages many token ratios. Problems are drawn deterministically from a seed;
train and held-out splits never share a problem; the reward is the same math-verify check of the boxed answer as for
the two-digit task.
"""

from __future__ import annotations

import math
import random
import string
from dataclasses import dataclass

LABELS = string.ascii_lowercase  # one label per step: at most 26 steps
PROMPT_TEMPLATE = "Q: {question}\nA:"


@dataclass(frozen=True)
class ChainProblem:
    """Start from `start` (0-99) and add `step` (1-9) `count` times."""

    start: int
    step: int
    count: int

    @property
    def question(self) -> str:
        return f"start {self.start}, add {self.step}, steps a to {LABELS[self.count - 1]}"

    @property
    def answer(self) -> str:
        return str(self.start + self.count * self.step)

    @property
    def prompt(self) -> str:
        return PROMPT_TEMPLATE.format(question=self.question)

    def target_completion(self) -> str:
        """The scratchpad the warm start teaches: one `label: total+step=new total` line per step, then the box."""
        lines, total = [], self.start
        for label in LABELS[: self.count]:
            lines.append(f"{label}: {total:03d}+{self.step}={total + self.step:03d}")
            total += self.step
        return " " + "\n".join(lines) + f"\n\\boxed{{{total}}}"


@dataclass(frozen=True)
class LengthSettings:
    """Steps per problem: round(exp(N(log(median_steps), sigma))), clipped to [min_steps, max_steps]."""

    median_steps: float = 8.5
    sigma: float = 0.55
    min_steps: int = 2
    max_steps: int = len(LABELS)

    def __post_init__(self):
        if not 1 <= self.min_steps <= self.max_steps <= len(LABELS):
            raise ValueError(
                f"LengthSettings: min_steps={self.min_steps}, max_steps={self.max_steps} must satisfy "
                f"1 <= min_steps <= max_steps <= {len(LABELS)} (one letter label per step)."
            )
        if self.median_steps <= 0 or self.sigma < 0:
            raise ValueError(
                f"LengthSettings: median_steps={self.median_steps} must be > 0 and sigma={self.sigma} >= 0."
            )

    def draw(self, rng: random.Random) -> int:
        steps = round(math.exp(rng.gauss(math.log(self.median_steps), self.sigma)))
        return min(self.max_steps, max(self.min_steps, steps))


def _draw_problem(rng: random.Random, lengths: LengthSettings) -> ChainProblem:
    return ChainProblem(start=rng.randint(0, 99), step=rng.randint(1, 9), count=lengths.draw(rng))


def generate_chains(count: int, *, seed: int, lengths: LengthSettings = LengthSettings(),
                    exclude: set | None = None) -> list[ChainProblem]:  # fmt: skip
    """`count` distinct problems, deterministic in `seed`, none of them in `exclude`."""
    if count < 0:
        raise ValueError(f"count={count} must be >= 0.")
    rng = random.Random(seed)
    seen = set(exclude or ())
    problems: list[ChainProblem] = []
    attempts = 0
    while len(problems) < count:
        attempts += 1
        if attempts > 100 * (count + 10):  # bounded: narrow settings (e.g. max_steps=1) have few distinct problems
            raise ValueError(f"count={count}: too few distinct problems with {lengths}; widen the step range.")
        problem = _draw_problem(rng, lengths)
        if problem not in seen:
            seen.add(problem)
            problems.append(problem)
    return problems


Splits = tuple[list[ChainProblem], list[ChainProblem]]


def make_chain_splits(num_train: int, num_heldout: int, *, seed: int,
                      lengths: LengthSettings = LengthSettings()) -> Splits:  # fmt: skip
    """Disjoint train and held-out problem lists, deterministic in `seed`."""
    heldout = generate_chains(num_heldout, seed=seed + 1, lengths=lengths)
    train = generate_chains(num_train, seed=seed, lengths=lengths, exclude=set(heldout))
    return train, heldout
