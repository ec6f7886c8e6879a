"""A synthetic, verifiable math task for the embedded CPU default: multi-digit addition answered in `\\boxed{}`.

Problems are drawn deterministically from a seed; train and held-out splits never share a problem. Each problem
has a target completion (the boxed sum) that the warm start teaches, and a ground truth that `dhpo_trl.scoring.rewards.math_verify_reward` checks, exactly as for the real recipes' datasets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from datasets import Dataset

# The question and the answer cue only. A real model needs the instruction to box its answer; the tiny character
# model learns the format from the warm start and reads every character as a token, so the instruction would only
# triple the tokens of every training sequence (and the time of every step) without telling it anything.
PROMPT_TEMPLATE = "Q: {question}\nA:"


@dataclass(frozen=True)
class Problem:
    left: int
    right: int

    @property
    def question(self) -> str:
        return f"{self.left}+{self.right}"

    @property
    def answer(self) -> str:
        return str(self.left + self.right)

    @property
    def prompt(self) -> str:
        return PROMPT_TEMPLATE.format(question=self.question)

    def target_completion(self) -> str:
        """The answer the warm start teaches: just the boxed sum, so that sampling errors sit in the digits."""
        return f" \\boxed{{{self.answer}}}"

    def sample_completion(self, rng: random.Random) -> str:
        """What the warm start teaches on one draw: always the target (this task has no free choices)."""
        return self.target_completion()

    def accepts(self, text: str) -> bool:
        """Whether `text` is the taught completion."""
        return text == self.target_completion()


def generate_problems(count: int, *, digits: tuple[int, int], seed: int, exclude: set | None = None) -> list[Problem]:
    """`count` distinct addition problems whose operands have between `digits[0]` and `digits[1]` digits."""
    low_digits, high_digits = digits
    if not 1 <= low_digits <= high_digits:
        raise ValueError(f"digits={digits} must satisfy 1 <= min <= max, e.g. (2, 3).")
    space = sum(9 * 10 ** (d - 1) for d in range(low_digits, high_digits + 1)) ** 2
    exclude = exclude or set()
    if count > space - len(exclude):
        raise ValueError(f"count={count} exceeds the {space - len(exclude)} distinct problems with digits={digits}.")
    rng = random.Random(seed)
    problems: list[Problem] = []
    seen = set(exclude)

    def operand() -> int:
        width = rng.randint(low_digits, high_digits)
        return rng.randint(10 ** (width - 1), 10**width - 1)

    while len(problems) < count:
        problem = Problem(operand(), operand())
        if problem not in seen:
            seen.add(problem)
            problems.append(problem)
    return problems


def make_splits(
    num_train: int, num_heldout: int, *, digits: tuple[int, int], seed: int
) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train and held-out problem lists, deterministic in `seed`."""
    heldout = generate_problems(num_heldout, digits=digits, seed=seed + 1)
    train = generate_problems(num_train, digits=digits, seed=seed, exclude=set(heldout))
    return train, heldout


def to_dataset(problems: list[Problem]) -> Dataset:
    """The `prompt` / `answer` columns that `DHPOTrainer` and `math_verify_reward` consume."""
    return Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
