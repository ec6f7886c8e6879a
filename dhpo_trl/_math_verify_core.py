r"""The answer grader: is one extracted answer equivalent to one gold answer? math-verify is the engine.

Self-contained on purpose (imports nothing from `dhpo_trl`): `dhpo_trl.rewards` imports it in-process, and runs
this same file by path as a worker process (`python _math_verify_core.py`) when it is called outside the main
thread, where no signal-based timeout exists. Worker protocol: one JSON request per stdin line
(`{"answer": str, "gold": str, "timeout_s": float}`), one line `1` or `0` back.

The gold is expected already normalised (`dhpo_trl.golds.normalise_gold`). Its form decides how it is compared:

- `\text{(C)}` is a multiple-choice letter: the answer must name that letter (`C`, `(C)`, `\textbf{(C)} Plane`).
- `52_{8}` is a number in base 8: the answer must have the same digits, in base 8 or without a base.
- `\text{east}` is a word: compared as lower-case letters.
- anything else is mathematics: both sides are parsed by math-verify's LaTeX parser (latex2sympy2_extended) and
  compared by `math_verify.verify`, except that two plain numbers are compared here: exactly, or within a relative
  1e-4 when one is written with a decimal point (math-verify rounds to 6 decimals, so it equates 2.88e-19 with
  2.89e-19). A percentage gold also accepts its value divided by 100 (`62.5\%` accepts `62.5` and `0.625`).

No answer passes because its text equals the gold's text: a gold that cannot be parsed only matches an identical
answer, with a warning naming it (`dhpo_trl.golds` reports such golds at load time).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import signal
import sys
import threading
import time

import sympy
from latex2sympy2_extended import NormalizationConfig, latex2sympy, normalize_latex
from math_verify import verify
from math_verify.grader import should_treat_as_complex
from sympy.core.function import AppliedUndef

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()
NUMBER_REL_TOL = 1e-4  # Qwen2.5-Math's `math_equal` (SimpleRL-Zoo's grader) uses the same relative tolerance


class _DeadlineExceeded(BaseException):
    """BaseException so that math-verify's and sympy's `except Exception` blocks cannot swallow it."""


class _DropTimeoutDisabledWarning(logging.Filter):
    # We disable math-verify's own alarm (it cancels any outer one and refuses to run off the main thread) and
    # bound the whole comparison ourselves, so its "you must provide the logic for timeout" warning is noise.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


# ------------------------------------------------------------------ text clean-up, for golds and answers alike
_E_NOTATION = re.compile(r"(?<![\w.\\])(\d+\.?\d*|\.\d+)[eE]([+-]?)0*(\d+)(?![\w.])")
_GREEK = {
    *("alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta", "iota"),
    *("kappa", "lambda", "mu", "nu", "xi", "pi", "varpi", "rho", "varrho", "sigma", "varsigma", "tau", "upsilon"),
    *("phi", "varphi", "chi", "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Pi", "Sigma", "Upsilon"),
    *("Phi", "Psi", "Omega"),
}
_SUBSCRIPT = re.compile(r"_\{((?:[^{}]|\{[^{}]*\})*)\}")
_WRAPPER = re.compile(r"\\(?:text|mathrm|textrm|mathit|operatorname|rm)\s*\{([^{}]*)\}")


def e_notation_to_latex(text: str) -> str:
    r"""`4.5e33` -> `4.5 \times 10^{33}`: math-verify reads the `e` as Euler's number (4.5 * e * 33)."""
    return _E_NOTATION.sub(lambda m: f"{m[1]} \\times 10^{{{m[2].replace('+', '')}{m[3]}}}", text)


def _plain_subscript(match: re.Match) -> str:
    # `L_{\odot}`, `m_{\max }`, `\lambda_{\text {red}}`: the parser rejects commands and text inside subscripts
    # (or keeps the raw text, so `red` and `\text{red}` differ); a plain name reads the same on both sides.
    inner = _WRAPPER.sub(r"\1", match[1])
    inner = re.sub(r"\\([A-Za-z]+)", lambda m: m[0] if m[1] in _GREEK else m[1], inner)
    return "_{" + re.sub(r"[\s~]+", "", inner) + "}"


_LEIBNIZ = re.compile(
    r"\\frac\s*\{\s*(?:\\mathrm\{d\}|\\operatorname\{d\}|d)\s*(?:\^\s*\{?\s*(\d)\s*\}?)?\s*"
    r"((?:[^{}]|\{[^{}]*\})+?)\s*\}\s*\{\s*(?:\\mathrm\{d\}|\\operatorname\{d\}|d)\s*([A-Za-z])\s*(?:\^\s*\{?\s*(\d)\s*\}?)?\s*\}"
)


def _derivative_symbol(match: re.Match) -> str:
    # dx/dt would be read as the derivative of a constant symbol, i.e. 0, so that dx/dt = kx - a and
    # dx/dt = a - kx become the same equation: one opaque symbol per derivative keeps them apart.
    name = re.sub(r"[^A-Za-z0-9]", "", match[2])  # letters and digits: \theta, y_{1} and y_1 read theta, y1, y1
    return f"\\mathcal{{D}}_{{{match[1] or ''}{name}{match[3]}{match[4] or ''}}}"


_E_SUBSCRIPT = re.compile(r"(?<!\\mathcal\{)(?<![\\A-Za-z])(\d[0-9A-Z]*)?([Ee])(?=\s*_\s*(\{[^{}]*\}|\w)?)")


def _e_symbol(match: re.Match) -> str:
    # E_1 is not e ** 1 (nor unparsable), but 1E_{16} is a number in base 16
    if match[1] and match[3] and _base_number(f"{match[1]}{match[2]}_{match[3]}"):
        return match[0]
    return f"{match[1] or ''}\\mathcal{{{match[2]}}}"


def clean(text: str) -> str:
    r"""Rewrites that let the parser read what a person reads, applied to golds and answers alike (idempotent)."""
    text = text.replace("\u2212", "-").replace("\u00b0", "^{\\circ}").replace("\u03c0", "\\pi")
    text = re.sub(r"\\\$|\\\(|\\\)|(?<!\\)\\\[|\\\]|\$", " ", text)  # $ (also currency), \( \), \[ \]
    text = re.sub(r"\\displaystyle|\\!\s*", "", text)
    text = re.sub(r"(?<!\\)\\[,;: ]|\\q?quad\b|~|\s+", " ", text).strip()
    text = re.sub(r"(?<!\\)[.,;:]+$", "", text).strip()  # trailing full stop of a sentence
    text = e_notation_to_latex(text)
    text = _LEIBNIZ.sub(_derivative_symbol, text)
    text = _SUBSCRIPT.sub(_plain_subscript, text)
    text = re.sub(r"(?<=\d)i\b", " i", text)  # 5i: the parser only takes i for the imaginary unit when it stands alone
    text = _E_SUBSCRIPT.sub(_e_symbol, text)
    text = re.sub(r"(?<!\\mathcal\{)\\[gG]amma(?![A-Za-z])(?!\s*\()", r"\\mathcal{\\gamma}", text)  # not Euler's
    text = text.replace("''", "^{\\prime\\prime}")
    return re.sub(r"(?<=[A-Za-z0-9})])'", r"^{\\prime}", text)  # the parser deletes quotes: y' would read as y


# ------------------------------------------------------------------ parsing
_PERCENT = re.compile(r"\s*(?:\\%|%|\\text\{\s*\\?%\s*\}|\\text\{\s*percent\s*\}|\bpercent)\s*$")
_CHOICE_GOLD = re.compile(r"\\text\{\(([A-Z])\)\}")
_CHOICE_ANSWER = re.compile(r"\(?([A-Za-z])\)?(?:[\s.:)].*)?")
_BASE = re.compile(r"\(?([0-9A-Za-z]+)\)?_\{?\(?(\d{1,2})\)?\}?")
_TEXT_GOLD = re.compile(r"\\text\{\s*([A-Za-z][A-Za-z .'-]*?)\s*\}")
_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mathit|emph)\s*\{([^{}]*)\}")


def _normalised(latex: str, units: bool) -> str:
    config = NormalizationConfig(
        basic_latex=True, units=units, malformed_operators=True, nits=True, boxed="none", equations=False
    )
    return normalize_latex(latex, config=config)


def to_sympy(latex: str, *, units: bool, complex_numbers: bool = False):
    """The sympy object math-verify's parser makes of `latex` (None if it cannot), after `clean`.

    `units=False` keeps trailing letters such as the `m` of `6m`, which math-verify's unit filter would drop.
    `complex_numbers=True` reads `i` as the imaginary unit even where math-verify's own test would not.
    Unlike `math_verify.parse`, nothing else in the text is tried when the whole answer does not parse: a
    fraction inside an unreadable answer is not taken for the answer.
    """
    text = _normalised(clean(latex), units)
    if not text:
        return None
    for candidate in (text, _last_of_chain(text)):
        try:
            return latex2sympy(
                candidate, is_real=not (complex_numbers or should_treat_as_complex(candidate)), convert_degrees=False,
                normalization_config=None,
            )  # fmt: skip
        except Exception:  # noqa: BLE001, S112 - an unparsable text is an answer that cannot match
            continue
    return None


def _last_of_chain(text: str) -> str:
    # "x = 2 + 3 = 5" -> "5", as math-verify does; not "a=1, b=2".
    parts = re.split(r"(?<![\\<>!])=", text)
    return parts[-1] if len(parts) > 2 and "," not in text and ";" not in text else text


def split_percent(text: str) -> tuple[str, bool]:
    stripped = _PERCENT.sub("", text)
    return stripped, stripped != text


@functools.lru_cache(maxsize=16384)  # a training set's golds (SimpleRL-Zoo level 3-5: 8.5k) stay parsed
def gold_form(gold: str) -> tuple:
    """How a (normalised) gold is compared: ("choice", letter), ("base", digits, base), ("text", words),
    ("math", sympy object, is_percent, answer_units, complex_numbers) or ("unreadable", text)."""
    text = clean(gold)
    if match := _CHOICE_GOLD.fullmatch(text) or re.fullmatch(r"\(([A-E])\)", text):
        return ("choice", match[1])
    if base := _base_number(text):
        return ("base", *base)
    if match := _TEXT_GOLD.fullmatch(text):
        return ("text", _words(match[1]))
    value, percent = split_percent(text)
    expr = to_sympy(value, units=False)
    if expr is None:
        return ("unreadable", re.sub(r"\s+", "", text))
    # A gold that ends in a letter the unit filter would drop (`6m`, `\frac{1}{m} t`) keeps it in answers too.
    answer_units = _normalised(value, True) == _normalised(value, False)
    return ("math", expr, percent, answer_units, should_treat_as_complex(_normalised(value, False)))


def _base_number(text: str) -> tuple[str, int] | None:
    match = _BASE.fullmatch(text.replace(" ", ""))
    if not match or not 2 <= int(match[2]) <= 36 or match[1] != match[1].upper():
        return None
    digits, base = match[1].lstrip("0") or "0", int(match[2])
    return (digits, base) if all(int(d, 36) < base for d in digits) else None


def _words(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", _TEXT_WRAPPERS.sub(r"\1", text).lower())


# ------------------------------------------------------------------ comparison
def answers_match(answer: str, gold: str) -> bool:
    """True if `answer` is equivalent to `gold` (see the module docstring). No time bound."""
    form = gold_form(gold)
    answer = clean(answer)
    if not answer:
        return False
    kind = form[0]
    if kind == "choice":
        letters = _TEXT_WRAPPERS.sub(r"\1", _TEXT_WRAPPERS.sub(r"\1", answer)).strip()  # spaces: `clean` made them one
        match = _CHOICE_ANSWER.fullmatch(letters)
        return bool(match) and match[1].upper() == form[1]
    if kind == "base":
        if re.fullmatch(r"[0-9A-Z]+", answer):  # digits without a base: the question fixed the base
            return (answer.lstrip("0") or "0") == form[1]
        return _base_number(_TEXT_WRAPPERS.sub(r"\1", answer)) == form[1:]
    if kind == "text":
        return _words(answer) == form[1]
    if kind == "unreadable":
        if gold not in _WARNED:
            _WARNED.add(gold)
            logger.warning("Gold answer %r cannot be read as mathematics: only an identical answer matches.", gold)
        return re.sub(r"\s+", "", answer) == form[1]
    _, gold_expr, gold_percent, answer_units, complex_numbers = form
    value, percent = split_percent(answer)
    answer_expr = _parse_answer(value, gold_expr, answer_units, complex_numbers)
    if answer_expr is None:
        return False
    pairs = [(gold_expr, answer_expr)]
    if gold_percent and not percent:
        pairs.append((gold_expr / 100, answer_expr))  # 62.5% = 0.625
    if percent and not gold_percent:
        pairs.append((gold_expr, answer_expr / 100))
    return any(_equivalent(g, a) for g, a in pairs)


def _parse_answer(value: str, gold_expr, units: bool, complex_numbers: bool):
    """The answer's sympy object. A trailing unit is dropped (`5 \\text{ cm}`), unless the letter it would drop is
    one of the gold's variables: `x' + \\frac{r}{V} x - r c` keeps its `c`."""
    with_units = to_sympy(value, units=units, complex_numbers=complex_numbers)
    if not units or _normalised(clean(value), True) == _normalised(clean(value), False):
        return with_units
    without = to_sympy(value, units=False, complex_numbers=complex_numbers)
    lost = _symbols(without) - _symbols(with_units)
    return without if lost & _symbols(gold_expr) or with_units is None else with_units


def _symbols(expr) -> set:
    try:
        return {str(symbol) for symbol in expr.free_symbols}
    except AttributeError:
        return set()


def _is_number(expr) -> bool:
    return isinstance(expr, sympy.Expr) and bool(expr.is_number)


def _equivalent(gold, answer) -> bool:
    if _is_number(gold) and _is_number(answer):
        return _numbers_equal(gold, answer)
    if _differ_at_a_point(gold, answer):
        return False  # a fast "no" that spares sympy's simplify/solve on formulas that cannot be equal
    return verify(gold, answer, float_rounding=6, numeric_precision=15, strict=True, timeout_seconds=None)


_POINTS = [[sympy.Rational(11 + (7 * i + 3 * j) % 17, 10) for j in range(64)] for i in range(3)]


def _differ_at_a_point(gold, answer) -> bool:
    """True if two formulas (or two equations, up to a constant factor) take different values at a point.

    Only ever rejects: formulas that agree at every tried point (or cannot be evaluated) go on to math-verify.
    """
    if isinstance(gold, sympy.Equality) and isinstance(answer, sympy.Equality):
        f, g = gold.lhs - gold.rhs, answer.lhs - answer.rhs
        ratio = True
    elif isinstance(gold, sympy.Expr) and isinstance(answer, sympy.Expr) and not isinstance(gold, sympy.Equality):
        f, g, ratio = gold, answer, False
    else:
        return False
    atoms = sorted(f.atoms(sympy.Symbol, AppliedUndef) | g.atoms(sympy.Symbol, AppliedUndef), key=str)
    if len(atoms) > len(_POINTS[0]):
        return False
    ratios = []
    for point in _POINTS:
        values = dict(zip(atoms, point))
        try:
            a, b = complex(f.xreplace(values).evalf(30)), complex(g.xreplace(values).evalf(30))
        except (TypeError, ValueError, ArithmeticError, AttributeError):
            return False
        if not all(map(math.isfinite, (a.real, a.imag, b.real, b.imag))):
            return False
        if not ratio:
            if abs(a - b) > 1e-6 * max(abs(a), abs(b)):
                return True
        elif abs(b) < 1e-12 or abs(a) < 1e-12:
            if abs(a) >= 1e-12 or abs(b) >= 1e-12:
                return True  # one side vanishes, the other not: not proportional
        else:
            ratios.append(a / b)
    return any(abs(r - ratios[0]) > 1e-6 * abs(ratios[0]) for r in ratios)


def _numbers_equal(gold, answer) -> bool:
    gold, answer = gold.doit(), answer.doit()
    if gold.is_infinite or answer.is_infinite:  # the test below reads oo = -oo (oo <= 1e-30 * oo) and oo != oo (nan)
        return gold == answer and not gold.has(sympy.zoo)  # zoo, as in 1/0, is no value
    if gold.is_Rational and answer.is_Rational:
        return gold == answer
    decimal = gold.has(sympy.Float) or answer.has(sympy.Float)
    tolerance = NUMBER_REL_TOL if decimal else 1e-30  # exact forms (sqrt(2)/2 vs 1/sqrt(2)) compared at 50 digits
    try:
        a, b = sympy.N(gold, 50), sympy.N(answer, 50)
        return bool(abs(a - b) <= tolerance * max(abs(a), abs(b)))
    except (TypeError, ValueError, ArithmeticError):  # NaN (0/0, a divergent integral): sympy refuses to compare it
        return False


# ------------------------------------------------------------------ time bound
def answers_match_with_deadline(answer: str, gold: str, timeout_s: float) -> bool:
    """`answers_match`, interrupted after `timeout_s` seconds (counts as no match). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("answers_match_with_deadline needs the main thread (it uses SIGALRM).")

    # The alarm repeats every 50 ms after the deadline: an exception raised where Python swallows it (a weakref
    # callback or __del__ running at that moment prints "Exception ignored") is raised again at the next tick.
    armed = [True]

    def on_alarm(signum, frame):
        if armed[0]:
            raise _DeadlineExceeded

    started = time.monotonic()
    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_delay, _ = signal.setitimer(signal.ITIMER_REAL, timeout_s, 0.05)
    try:
        try:
            return answers_match(answer, gold)
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _DeadlineExceeded:
        return False
    finally:
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0:  # someone else's timer was running: give it back (approximately)
            signal.setitimer(signal.ITIMER_REAL, max(previous_delay - (time.monotonic() - started), 1e-3))


def _serve() -> None:
    """Worker loop: answer requests from stdin until it closes."""
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            matched = answers_match_with_deadline(request["answer"], request["gold"], request["timeout_s"])
        except Exception:  # noqa: BLE001 - a bad request scores 0, the worker keeps serving
            matched = False
        print("1" if matched else "0", flush=True)


if __name__ == "__main__":
    _serve()
