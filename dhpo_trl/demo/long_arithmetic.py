"""A synthetic task with long, variable-length completions: a running total worked through in a written scratchpad,
one line per step, the final total boxed.

    Q: start 17, add 8, steps a to c
    A: a: 017+8=025
    b) 8+025=033
    c. 033+8=041
    \\boxed{41}

Every line carries two free choices that the reward never checks: how the label is marked (`:`, `)` or `.`) and
which summand is written first. The warm start teaches every choice uniformly (each teaching draw picks them
afresh), so the policy starts with about log 3 + log 2 nats of entropy per line at two tokens whose choice is its
own, as a language model's reasoning has many tokens (phrasing, order) where several continuations are equally
right. Those forking tokens are where RL moves a long completion's token probabilities apart from one another:
nothing pins them, and the tokens after them (the summands, the sum's digits) are conditioned on what was chosen.
The rest of the line is determined by what came before it. Both orders and all marks have the same width, so every
line starts a fixed distance after the previous one and a two-layer model learns the scratchpad in under a
thousand supervised steps; its errors are the sums' digits and where to stop.

The number of steps is drawn long-tailed (log-normal), so completions run from about 40 to 360 tokens of the
character tokenizer with a median above 100: the regime where one sequence ratio averages many token ratios.
Problems are drawn deterministically from a seed; train and held-out splits never share a problem; the reward is the
same math-verify check of the boxed answer as for the two-digit task.
"""

from __future__ import annotations

import math
import random
import string
from dataclasses import dataclass

LABELS = string.ascii_lowercase  # one label per step: at most 26 steps
# Free choices of every line, unchecked by the reward: how the label is marked, and which summand comes first.
MARKS = (":", ")", ".")
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
        """One scratchpad of the many the warm start teaches: every free choice at its first option."""
        return self.write(choices=[(MARKS[0], False)] * self.count)

    def sample_completion(self, rng: random.Random) -> str:
        """A taught scratchpad with each line's free choices (label mark, operand order) drawn uniformly."""
        return self.write(choices=[(rng.choice(MARKS), rng.random() < 0.5) for _ in range(self.count)])

    def write(self, choices: list[tuple[str, bool]]) -> str:
        """The scratchpad with line i's label mark `choices[i][0]` and, if `choices[i][1]`, the step written first."""
        lines, total = [], self.start
        for label, (mark, step_first) in zip(LABELS[: self.count], choices, strict=True):
            summands = f"{self.step}+{total:03d}" if step_first else f"{total:03d}+{self.step}"
            lines.append(f"{label}{mark} {summands}={total + self.step:03d}")
            total += self.step
        return " " + "\n".join(lines) + f"\n\\boxed{{{total}}}"

    def accepts(self, text: str) -> bool:
        """Whether `text` is a taught scratchpad of this problem (any free choices): every line's labels, summands
        and totals right, then the right total boxed. Bounded: a text longer than the longest taught one is refused
        before any parsing."""
        if len(text) > len(self.target_completion()) or text[:1] != " ":
            return False
        lines = text[1:].split("\n")
        if len(lines) != self.count + 1 or lines[-1] != f"\\boxed{{{self.answer}}}":
            return False
        total = self.start
        for label, line in zip(LABELS, lines[:-1]):
            new = f"{total + self.step:03d}"
            if line not in {f"{label}{mark} {summands}={new}" for mark in MARKS
                            for summands in (f"{total:03d}+{self.step}", f"{self.step}+{total:03d}")}:  # fmt: skip
                return False
            total += self.step
        return True


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
