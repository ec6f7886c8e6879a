"""Pieces of the grader tested by their contract, below the scores: how a gold's form is read (`gold_form`), how two
plain numbers compare (`_numbers_equal`), and the fast "no" (`_differ_at_a_point`), on sympy objects, which may only
reject formulas that differ.

Scores cannot show this check: what it lets through, math-verify still rejects, only more slowly. So its contract is
tested here directly: different formulas (and equations that are not multiples of each other) are told apart at the
fixed points, and equal ones, or ones that cannot be evaluated there, are passed on.
"""

import contextlib
import signal
import time

import pytest
import sympy

from dhpo_trl.scoring._math_verify_core import (
    _POINTS,
    _differ_at_a_point,
    _equivalent,
    _last_of_chain,
    _numbers_equal,
    answers_match,
    answers_match_with_deadline,
    gold_form,
)

x, y = sympy.symbols("x y")
f = sympy.Function("f")
many = sympy.symbols(f"a0:{len(_POINTS[0]) + 1}")  # one more symbol than a point has coordinates
tiny = sympy.Rational(1, 10**12)
x_at = [point[0] for point in _POINTS]  # the values x takes when it is the only symbol


@pytest.mark.parametrize(
    ("gold", "form"),
    [
        ("52_8", ("base", "52", 8)),
        ("52 _8", ("base", "52", 8)),  # spaces do not count
        ("(52)_{8}", ("base", "52", 8)),
        ("10_2", ("base", "10", 2)),  # the smallest base
        ("Z_{36}", ("base", "Z", 36)),  # the largest: digits 0-9 and A-Z
        ("XY_{36}", ("base", "XY", 36)),
        ("1A_{16}", ("base", "1A", 16)),
        ("1E_{16}", ("base", "1E", 16)),  # an E before a subscript is a digit here, not the symbol E_16
        ("10E_{15}", ("base", "10E", 15)),
        ("2E_1", ("math", "2*math{e}_1")),  # no base 1: the symbol E_1
        ("E_{16}", ("math", "math{e}_{16}")),  # no digit before it
        (r"E_\alpha", ("math", r"math{e}_{\alpha}")),  # a subscript that is a command
        ("1GE_{16}", ("math", "1*g*math{e}_{16}")),  # G is no digit in base 16: 1 times G times the symbol E_16
        ("052_8", ("base", "52", 8)),  # leading zeros dropped, trailing ones kept
        ("520_8", ("base", "520", 8)),
        ("00_8", ("base", "0", 8)),
        ("17_8", ("base", "17", 8)),
        ("18_8", ("math", "18")),  # a digit equal to the base: not a number in that base
        ("19_8", ("math", "19")),
        ("1_1", ("math", "1")),  # no base 1
        ("10_{37}", ("math", "10")),  # no base above 36
        ("1a_{16}", ("math", "1*a_{16}")),  # lower-case letters are variables, not digits
        ("2a_{12}", ("math", "2*a_{12}")),
    ],
)
def test_numbers_in_a_base_and_subscripts_that_are_not_bases(gold, form):
    read = gold_form(gold)
    assert (read if read[0] == "base" else (read[0], str(read[1]))) == form


@pytest.mark.parametrize(
    ("gold", "answer", "equal"),
    [
        pytest.param(sympy.sqrt(2) / 2, 1 / sympy.sqrt(2), True, id="exact-forms-of-one-number"),
        pytest.param(sympy.pi, sympy.Rational(355, 113), False, id="exact-forms-8e-8-apart"),  # no tolerance
        pytest.param(sympy.Rational(1, 3), sympy.Float("0.33333"), True, id="a-decimal-within-1e-4"),
        pytest.param(sympy.Rational(1, 3), sympy.Float("0.3333"), False, id="a-decimal-off-by-1e-4"),
        pytest.param(sympy.Integer(0), sympy.Float(0.0), True, id="zero-and-a-decimal-zero"),  # a tolerance of 0
        pytest.param(sympy.zoo, sympy.Integer(1), False, id="infinity-and-a-number"),
        pytest.param(sympy.Integer(1), sympy.zoo, False, id="a-number-and-infinity"),
        pytest.param(sympy.nan, sympy.Integer(1), False, id="nan"),
        pytest.param(sympy.nan, sympy.nan, False, id="nan-and-nan"),
        pytest.param(sympy.sqrt(2), sympy.nan, False, id="an-irrational-and-nan"),
        pytest.param(sympy.Float(1.5), sympy.nan, False, id="a-decimal-and-nan"),
        pytest.param(sympy.zoo, sympy.zoo, False, id="complex-infinity-is-no-value"),  # 1/0
        pytest.param(sympy.oo, sympy.oo, True, id="infinity-and-infinity"),
        pytest.param(-sympy.oo, -sympy.oo, True, id="minus-infinity-and-minus-infinity"),
        pytest.param(sympy.oo, -sympy.oo, False, id="infinity-and-minus-infinity"),
        pytest.param(sympy.Integer(10) ** 100, sympy.oo, False, id="a-large-number-and-infinity"),
    ],
)
def test_plain_numbers(gold, answer, equal):
    assert _numbers_equal(gold, answer) is equal


def equation(lhs, rhs):
    return sympy.Eq(lhs, rhs, evaluate=False)


@pytest.mark.parametrize(
    ("gold", "answer", "differ"),
    [
        pytest.param(x**2 - 1, (x - 1) * (x + 1), False, id="one-formula-two-forms"),
        pytest.param(x**2, 2 * x, True, id="two-formulas"),
        pytest.param(2 * x, x, True, id="a-multiple-is-another-formula"),
        pytest.param(x, x + y, True, id="a-symbol-only-in-the-answer"),
        pytest.param(x + y, y, True, id="a-symbol-only-in-the-gold"),
        pytest.param(f(x) + 1, f(x) + 2, True, id="unknown-functions-are-variables"),
        pytest.param(2 * f(x), f(x) + f(x), False, id="unknown-functions-one-formula"),
        pytest.param(f(x) + x, x + 1, True, id="an-unknown-function-only-in-the-gold"),
        pytest.param(x + 1, f(x) + x, True, id="an-unknown-function-only-in-the-answer"),
        pytest.param(sympy.I * x, x, True, id="complex-values"),
        pytest.param(x, x * (1 + sympy.Rational(1, 500_000)), True, id="relative-difference-2e-6"),
        pytest.param(x, x * (1 + sympy.Rational(1, 2_000_000)), False, id="relative-difference-5e-7"),
        pytest.param(sympy.Integer(10**6), sympy.Integer(999_999), False, id="relative-difference-exactly-1e-6"),
        pytest.param(sympy.Integer(10**6), sympy.Rational(9_999_989, 10), True, id="relative-difference-1.1e-6"),
        pytest.param(1 / (x - sympy.Rational(11, 10)), 1 + 1 / (x - sympy.Rational(11, 10)), False, id="a-pole"),
        pytest.param(sum(many[:-1]), sum(many[:-1]) + 1, True, id="as-many-symbols-as-coordinates"),
        pytest.param(sum(many), sum(many) + 1, False, id="more-symbols-than-coordinates"),
        pytest.param(equation(2 * x, 4), equation(x, 2), False, id="equations-up-to-a-factor"),
        pytest.param(equation(x, 2), equation(2, x), False, id="equations-sides-swapped"),
        pytest.param(equation(x, 2), equation(x, 3), True, id="two-equations"),
        pytest.param(equation(x, 2), equation(x, sympy.Rational(21, 10)), True, id="two-close-equations"),
        pytest.param(equation(x * y, 1), equation(x, y), True, id="equations-not-proportional"),
        pytest.param(equation(x, x), equation(x, 2), True, id="one-side-vanishes-everywhere"),
        pytest.param(equation(x, 2), equation(x, x), True, id="the-other-side-vanishes-everywhere"),
        pytest.param(equation(x, x), equation(y, y), False, id="both-vanish-everywhere"),
        # an equation's side "vanishes" below 1e-12; exactly 1e-12 does not
        pytest.param(equation(y, y + tiny), equation(y, y), True, id="a-side-of-exactly-1e-12-and-a-vanishing-one"),
        pytest.param(equation(y, y), equation(y, y + tiny), True, id="a-vanishing-side-and-one-of-exactly-1e-12"),
        pytest.param(equation(y, y + 2 * tiny), equation(y, y + tiny), False, id="sides-of-2e-12-and-1e-12"),
        pytest.param(equation(y, y + tiny), equation(y, y + 2 * tiny), False, id="sides-of-1e-12-and-2e-12"),
        pytest.param(
            equation((x - x_at[0]) * (x - x_at[1]), 0), equation(2 * (x - x_at[0]) * (x - x_at[1]), 0), False,
            id="equations-proportional-where-only-one-point-does-not-vanish",
        ),
        pytest.param(  # the ratio at the second point is 10**6 + 1, at the others 10**6: exactly 1e-6 apart
            equation(10**6 + sympy.Rational(100, 49) * (x - x_at[0]) * (x_at[2] - x), 0), equation(x, x - 1), False,
            id="equation-ratios-exactly-1e-6-apart",
        ),
        pytest.param(equation(x, 2), x - 2, False, id="equation-and-formula"),
        pytest.param(x - 2, equation(x, 2), False, id="formula-and-equation"),
        pytest.param(sympy.FiniteSet(1, 2), sympy.FiniteSet(1, 3), False, id="not-formulas"),
        # a bound variable set to a number (Sum(11/10, (11/10, 1, n))) raises: passed on, not rejected
        pytest.param(sympy.Sum(x, (x, 1, y)), y * (y + 1) / 2, False, id="cannot-be-evaluated-at-the-point"),
    ],
)
def test_only_formulas_that_differ_are_rejected(gold, answer, differ):
    assert _differ_at_a_point(gold, answer) is differ


def test_points_are_three_distinct_rows_of_values_away_from_zero():
    assert len(_POINTS) == 3 and len({tuple(point) for point in _POINTS}) == 3
    assert all(1 <= value <= 3 for point in _POINTS for value in point)



@contextlib.contextmanager
def caller_timer(seconds, handler=lambda signum, frame: None):
    """A caller's own SIGALRM handler and timer (as a training loop may have), both removed afterwards."""
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield previous
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_math_verify_leaves_the_deadline_timer_alone():
    """math-verify's own time limit (`timeout_seconds`) arms SIGALRM with `signal.alarm` and cancels it after, which
    would cancel the timer of `answers_match_with_deadline`: it is turned off."""
    with caller_timer(60.0) as previous:
        assert _equivalent(x**2 - 1, (x - 1) * (x + 1))  # equal at every point: decided by math-verify's verify
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 50.0
        assert signal.getsignal(signal.SIGALRM) is not previous


def test_an_unreadable_gold_matches_only_its_own_text_and_is_reported_once(monkeypatch, caplog):
    from dhpo_trl.scoring import _math_verify_core

    monkeypatch.setattr(_math_verify_core, "_WARNED", set())  # warned golds are remembered for the process
    with caplog.at_level("WARNING", logger=_math_verify_core.logger.name):
        assert answers_match("f (x)=", "f(x) =")  # the same text, spaces aside
        assert not answers_match("f(y) =", "f(x) =")
        assert answers_match("x=", "x =")
    assert [record.getMessage() for record in caplog.records] == [
        "Gold answer 'f(x) =' cannot be read as mathematics: only an identical answer matches.",
        "Gold answer 'x =' cannot be read as mathematics: only an identical answer matches.",
    ]


def test_an_answer_that_cleans_to_nothing_matches_nothing():
    assert not answers_match("$ $", "0") and not answers_match(r"\quad", r"\text{(A)}")


@pytest.mark.parametrize(
    ("answer", "gold", "match"),
    [
        ("1A", "1A_{16}", True),  # digits alone: the question fixed the base
        ("052", "52_8", True),  # leading zeros do not count ...
        ("520", "520_8", True),  # ... trailing ones do
        ("00", "0_{8}", True),
        ("XY", "XY_{36}", True),
        (r"\text{52}_{8}", "52_8", True),
        ("53", "52_8", False),
        (r"(B) because it is the largest", r"\text{(B)}", True),  # a choice: its letter, then anything
        ("B because it is the largest", r"\text{(B)}", True),
        (r"\textbf{\text{B}}", r"\text{(B)}", True),
        ("B.\n\nIt is the largest", r"\text{(B)}", True),
        ("(C) because", r"\text{(B)}", False),
        ("$B$", r"\text{(B)}", True),  # dollars, \displaystyle and LaTeX spacing are not part of the letter
        (r"\displaystyle B", r"\text{(B)}", True),
        (r"B\qquad\text{the largest}", r"\text{(B)}", True),
        (r"$52_8$", "52_8", True),
    ],
)
def test_answers_to_base_and_choice_golds(answer, gold, match):
    assert answers_match(answer, gold) is match


def test_the_deadline_needs_the_main_thread():
    import threading

    errors = []

    def run():
        try:
            answers_match_with_deadline("1", "1", timeout_s=1.0)
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors == ["answers_match_with_deadline needs the main thread (it uses SIGALRM)."]


def test_a_caller_timer_under_a_second_is_given_back():
    with caller_timer(0.8):
        assert answers_match_with_deadline("2", "2", timeout_s=5.0)
        assert 0.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.8


def test_a_caller_timer_that_expired_during_the_comparison_fires_at_once():
    fired = []
    # the caller's timer ends while the comparison runs into its own deadline
    with caller_timer(0.05, lambda signum, frame: fired.append(time.monotonic())):
        assert not answers_match_with_deadline(r"9^{9^{9^{9}}}", "2", timeout_s=0.2)
        returned = time.monotonic()
        time.sleep(0.3)
        assert len(fired) == 1 and fired[0] - returned < 0.2  # given back as 1 ms, not lost nor late


@pytest.mark.parametrize(
    ("text", "last"),
    [
        ("x = 2 + 3 = 5", " 5"),
        ("a = b = c = d", " d"),
        ("x = 5", "x = 5"),  # one equation is not a chain
        ("x <= 3 = 3", "x <= 3 = 3"),  # only equalities chain
        ("x >= 3 = 3", "x >= 3 = 3"),
        ("x != 3 = 3", "x != 3 = 3"),
        (r"\=a = b", r"\=a = b"),  # an escaped sign (LaTeX's macron accent) is no equality
        ("a = 1, b = 2 = 2", "a = 1, b = 2 = 2"),  # several answers, not one chain
        ("a = 1; b = 2 = 2", "a = 1; b = 2 = 2"),
    ],
)
def test_the_last_part_of_a_chain_of_equalities(text, last):
    # tried when the whole answer does not parse, e.g. because a link evaluates to True: C(6, 2) = 15 = 15
    assert _last_of_chain(text) == last


def test_an_answer_that_cannot_be_parsed_matches_no_formula():
    assert not answers_match(r"\frac{1}{", "2") and not answers_match("x =", "x")
