"""A synthetic task with long, variable-length completions: chained additions and subtractions worked through in a
written scratchpad, one line per step with the running total, the final total boxed.

    Q: a+3 b-1 c+7
    A: a+3: 0+3=3
    b-1: 3-1=2
    c+7: 2+7=9
    \\boxed{9}

Every operand carries a letter label, so that the step the model works on names the operand it copies from the
prompt (a lookup a two-layer model learns, where counting positions is not). The number of steps is drawn
long-tailed (log-normal), so completions run from about 30 to 400 tokens of the character tokenizer with a median
above 100: the regime where one sequence ratio averages many token ratios. Problems are drawn deterministically
from a seed; train and held-out splits never share a problem; the reward is the same math-verify check of the
boxed answer as for the two-digit task.
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
    """Start from 0 and apply `steps` in order: each is (+1 or -1, a digit 1-9)."""

    steps: tuple[tuple[int, int], ...]

    @property
    def question(self) -> str:
        return " ".join(f"{label}{'+' if sign > 0 else '-'}{digit}" for label, (sign, digit) in zip(LABELS, self.steps))

    @property
    def answer(self) -> str:
        return str(sum(sign * digit for sign, digit in self.steps))

    @property
    def prompt(self) -> str:
        return PROMPT_TEMPLATE.format(question=self.question)

    def target_completion(self) -> str:
        """The scratchpad the warm start teaches: one `label±d: total±d=new total` line per step, then the box."""
        lines, total = [], 0
        for label, (sign, digit) in zip(LABELS, self.steps):
            op = "+" if sign > 0 else "-"
            lines.append(f"{label}{op}{digit}: {total}{op}{digit}={total + sign * digit}")
            total += sign * digit
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
            raise ValueError(f"LengthSettings: median_steps={self.median_steps} must be > 0 and sigma={self.sigma} >= 0.")

    def draw(self, rng: random.Random) -> int:
        steps = round(math.exp(rng.gauss(math.log(self.median_steps), self.sigma)))
        return min(self.max_steps, max(self.min_steps, steps))


def _draw_problem(rng: random.Random, lengths: LengthSettings) -> ChainProblem:
    """Signs drawn so that the running total never goes below 0 (a minus is drawn only where the total allows)."""
    steps, total = [], 0
    for _ in range(lengths.draw(rng)):
        digit = rng.randint(1, 9)
        sign = -1 if total >= digit and rng.random() < 0.5 else 1
        steps.append((sign, digit))
        total += sign * digit
    return ChainProblem(tuple(steps))


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


def make_chain_splits(num_train: int, num_heldout: int, *, seed: int,
                      lengths: LengthSettings = LengthSettings()) -> tuple[list[ChainProblem], list[ChainProblem]]:  # fmt: skip
    """Disjoint train and held-out problem lists, deterministic in `seed`."""
    heldout = generate_chains(num_heldout, seed=seed + 1, lengths=lengths)
    train = generate_chains(num_train, seed=seed, lengths=lengths, exclude=set(heldout))
    return train, heldout
