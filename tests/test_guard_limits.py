r"""The grader's cost guards approached from both sides: for every limit, an answer exactly at it passes the guards and
is scored (1 against the same value written another way), and one step past it is refused by that limit, before
any parsing. A limit set off by a factor, either way, fails one of the two.

The limits are the documented ones (docs/grading.md, "Bounds"), not the module's constants, so that a constant
changed by mistake moves the behaviour away from the cases instead of the cases with it. Each answer and its gold
are built from those values; the expected scores come from the values (the same number written as another power,
product or sum).
"""

import math
import re
from pathlib import Path

import pytest

from dhpo_trl.scoring import _math_verify_core as core
from dhpo_trl.scoring import rewards

GRADING = (Path(__file__).resolve().parents[1] / "docs" / "grading.md").read_text()


def _documented() -> dict[str, int]:
    """Each limit's value as docs/grading.md states it: the table of "Bounds", and the answer length."""
    limits = {name: int(value.replace(",", "")) for name, value in
              re.findall(r"^\s*\| `(MAX_[A-Z_]+)` \| (?:n ≤ )?([\d,]+)", GRADING, re.MULTILINE)}  # fmt: skip
    limits["MAX_ANSWER_CHARS"] = int(re.search(r"`MAX_ANSWER_CHARS` \(([\d,]+)\)", GRADING)[1].replace(",", ""))
    return limits


LIMITS = _documented()


def test_the_documented_limits_are_the_modules():
    assert len(LIMITS) == 9
    for name, value in LIMITS.items():
        assert getattr(rewards if name == "MAX_ANSWER_CHARS" else core, name) == value, name


def _matrix(rows: int, columns: int, environment: str) -> str:
    body = r" \\ ".join(" & ".join(str(1 + r * columns + c) for c in range(columns)) for r in range(rows))
    return rf"\begin{{{environment}}} {body} \end{{{environment}}}"


def _separators_at(limit: int) -> tuple[int, int]:
    """A matrix shape (rows, columns) with exactly `limit` separators: rows * (columns - 1) `&` and rows - 1 `\\`,
    rows * columns - 1 in all."""
    rows = next(r for r in range(2, limit + 1) if (limit + 1) % r == 0 and (limit + 1) // r >= 2)
    return rows, (limit + 1) // rows


def _at_limit():
    """(limit name, an answer exactly at the limit, its gold written differently, the answer one step past it)."""
    digits = LIMITS["MAX_INTEGER_DIGITS"]
    yield ("MAX_INTEGER_DIGITS", "1" + "0" * (digits - 1), f"10^{{{digits - 1}}}", "1" + "0" * digits)
    exponent = LIMITS["MAX_EXPONENT"]  # 2^{E}: E of exponent, E power digits (1 digit of base)
    assert exponent <= LIMITS["MAX_POWER_DIGITS"]  # the power-digits limit would refuse first otherwise
    assert exponent % 2 == 0
    yield ("MAX_EXPONENT", f"2^{{{exponent}}}", f"4^{{{exponent // 2}}}", f"2^{{{exponent + 1}}}")
    # a power counts (digits of its base) x (its exponent): 11^{P/2} counts P exactly (P even)
    power = LIMITS["MAX_POWER_DIGITS"]
    assert power % 4 == 0 and power // 2 <= LIMITS["MAX_EXPONENT"]
    yield ("MAX_POWER_DIGITS", f"11^{{{power // 2}}}", f"121^{{{power // 4}}}", f"11^{{{power // 2}}} \\cdot 2^{{1}}")
    n = LIMITS["MAX_FACTORIAL"]
    yield ("MAX_FACTORIAL", f"{n}!", f"{n} \\cdot {n - 1}!", f"{n + 1}!")
    n = LIMITS["MAX_BINOMIAL"]
    yield ("MAX_BINOMIAL", rf"\binom{{{n}}}{{2}}", str(math.comb(n, 2)), rf"\binom{{{n + 1}}}{{2}}")
    n = LIMITS["MAX_SUM_TERMS"]
    yield ("MAX_SUM_TERMS", rf"\sum_{{k=1}}^{{{n}}} k", str(n * (n + 1) // 2), rf"\sum_{{k=1}}^{{{n + 1}}} k")
    depth = LIMITS["MAX_NESTING"]
    # braces: the costliest bracket to parse (its time grows about 1.5-fold a level)
    yield ("MAX_NESTING", "{" * depth + "7" + "}" * depth, "7", "{" * (depth + 1) + "7" + "}" * (depth + 1))
    rows, columns = _separators_at(LIMITS["MAX_MATRIX_SEPARATORS"])
    past = _matrix(rows, columns, "pmatrix") + r" \\"  # one separator more
    yield ("MAX_MATRIX_SEPARATORS", _matrix(rows, columns, "pmatrix"), _matrix(rows, columns, "bmatrix"), past)


CASES = {case[0]: case[1:] for case in _at_limit()}


@pytest.mark.parametrize("limit", list(CASES))
def test_an_answer_at_the_limit_passes_the_guards_and_scores(limit):
    at, gold, _ = CASES[limit]
    assert core.refusal(core.clean(at)) is None
    assert rewards.score_answer(rf"\boxed{{{at}}}", gold, timeout_s=20.0) == 1.0


@pytest.mark.parametrize("limit", list(CASES))
def test_one_step_past_the_limit_is_refused_by_that_limit(limit):
    _, gold, past = CASES[limit]
    assert core.refusal(core.clean(past)) == limit
    assert rewards.score_answer(rf"\boxed{{{past}}}", gold) == 0.0


def test_the_matrix_at_the_limit_has_exactly_that_many_separators():
    rows, columns = _separators_at(LIMITS["MAX_MATRIX_SEPARATORS"])
    text = _matrix(rows, columns, "pmatrix")
    assert text.count("&") + text.count("\\\\") == LIMITS["MAX_MATRIX_SEPARATORS"]


def test_the_answer_length_limit_from_both_sides():
    """`MAX_ANSWER_CHARS`: a boxed answer of exactly that many characters is read and scored; one more is not."""
    n = LIMITS["MAX_ANSWER_CHARS"]
    answer = "x + " * ((n - 1) // 4) + "1" * (n - 4 * ((n - 1) // 4))  # exactly n characters
    assert len(answer) == n
    gold = "1" * (n - 4 * ((n - 1) // 4))
    gold = f"{(n - 1) // 4} x + {gold}"
    assert rewards.extract_answer(rf"\boxed{{{answer}}}") == answer
    assert rewards.score_answer(rf"\boxed{{{answer}}}", gold, timeout_s=20.0) == 1.0
    assert rewards.extract_answer(rf"\boxed{{{answer}1}}") is None
    assert rewards.score_answer(rf"\boxed{{{answer}1}}", gold) == 0.0
