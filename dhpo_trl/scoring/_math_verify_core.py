r"""The answer grader: is one extracted answer equivalent to one gold answer? math-verify is the engine.

Self-contained on purpose (imports nothing from `dhpo_trl`): `dhpo_trl.scoring.rewards` runs this same file by path as a
long-lived worker process (`python _math_verify_core.py`, protocol in `_serve`) that does every comparison, with a
memory limit and a CPU limit, and that the caller kills at the deadline; in-process it is used for cheap checks
(`refusal`, `clean`) and by the audits.

The gold is expected already normalised (`dhpo_trl.scoring.golds.normalise_gold`). Its form decides how it is compared:

- `\text{(C)}` is a multiple-choice letter: the answer must name that letter (`C`, `(C)`, `\textbf{(C)} Plane`).
- `52_{8}` is a number in base 8: the answer must have the same digits, in base 8 or without a base.
- `\text{east}` is a word: compared as lower-case letters.
- anything else is mathematics: both sides are parsed by math-verify's LaTeX parser (latex2sympy2_extended) and
  compared by `math_verify.verify`, except that two numbers, alone or inside a tuple, set, interval or matrix, are
  compared here (`_numbers_equal`, rules in docs/grading.md): decimals are read as the exact values they write; an
  integer-valued gold (`12345.0`, `1.5 \times 10^{6}`) needs an equal value; an integer never matches a non-integer
  gold; a decimal gold allows a relative 1e-4 and never more than half a unit of its last written digit; a decimal
  answer to an exact gold (`\frac{1}{3}`) a relative 1e-4 (math-verify rounds to 6 decimals, so it equates 2.88e-19
  with 2.89e-19). A percentage gold also accepts its value divided by 100 (`62.5\%` accepts `62.5` and `0.625`).

No answer passes because its text equals the gold's text: a gold that cannot be parsed only matches an identical
answer, with a warning naming it (`dhpo_trl.scoring.golds` reports such golds at load time).
"""

from __future__ import annotations

import bisect
import contextvars
import ctypes
import functools
import json
import os
import logging
import math
import re
import signal
import sys
import threading
import time

import sympy
from latex2sympy2_extended import NormalizationConfig, latex2sympy, normalize_latex
from math_verify import grader as _grader
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
# Possessive quantifiers (`++`, `*+`): the mantissa and the exponent are each read in one way only, so the time is
# linear in the text (the backtracking version took 2 s on 1,000 digits with an `e` in the middle).
_E_NOTATION = re.compile(r"(?<![\w.\\])(\d++(?:\.\d*+)?|\.\d++)[eE]([+-]?+)(\d++)(?![\w.])")
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
    return _E_NOTATION.sub(lambda m: f"{m[1]} \\times 10^{{{m[2].replace('+', '')}{m[3].lstrip('0') or '0'}}}", text)


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


# The number group starts only where a run of digits and capitals starts: from inside a run, each position would
# rescan the rest of it (quadratic time on a long run of digits before an `e`).
_E_SUBSCRIPT = re.compile(r"(?<!\\mathcal\{)(?<![\\A-Za-z])((?<![0-9A-Z])\d[0-9A-Z]*)?([Ee])(?=\s*_\s*(\{[^{}]*\}|\w)?)")


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


# ------------------------------------------------------------------ cost guards, before any parsing
# sympy evaluates integer arithmetic while it parses (`2^{10^{7}}` is computed, not kept symbolic), and some of it
# runs in C code that no signal interrupts; latex2sympy builds matrices whose size comes from the text. These limits
# refuse (score 0) such answers with a linear scan of the text, before the parser sees it. No answer of the seven
# benchmarks comes near them (largest integer: 11 digits, exponent: 1009, factorial: 100!, nesting: 4, matrix
# separators: 3); docs/grading.md lists them. The worker process's deadline and memory limit bound what they miss.
MAX_INTEGER_DIGITS = 100  # digits in one integer literal
MAX_EXPONENT = 10_000  # an exponent's value, times the exponents inside its base: `(x^{100})^{100}` counts 10^4
MAX_POWER_DIGITS = 20_000  # digits of all the powers of integers together (2^{1009} counts 1009)
MAX_FACTORIAL = 1_000  # n in n!; a factorial of a power or factorial of numbers (`(10^{5})!`) is refused
MAX_BINOMIAL = 10_000  # n in \binom{n}{k}
MAX_SUM_TERMS = 1_000  # the bounds of \sum and \prod
MAX_NESTING = 10  # brackets inside brackets: braces 10 deep parse in 0.9 s of CPU, 12 in 2.5 s, 16 in 13 s
MAX_MATRIX_SEPARATORS = 64  # `&` and `\\` in the text: a 9x8 matrix at most
# latex2sympy's `\operatorname{eye}(n)`, `zeros(n, m)`, ... build or decompose matrices of a size the text chooses
MATRIX_OPERATORS = frozenset(
    "eye zeros ones diag hstack vstack rank rref nullspace norm cols rows eig eigen diagonalize eigenvals "
    "eigenvalues eigenvects eigenvectors svd SVD orth ortho orthogonal orthogonalize trace tr".split()
)
_OPENERS, _CLOSERS = "([{", ")]}"
_DIGIT_RUN = re.compile(r"\d++")
_LETTER = re.compile(r"(?<!\\)[A-Za-z]")  # a letter that is not part of a command: a variable
_COMMAND_WORDS = re.compile(r"\\[A-Za-z]++")
_OPERATOR_NAME = re.compile(r"\\operatorname\s*+\{\s*+([^{}]*+)\}")
_NESTED = re.compile(r"\^|!|binom|choose")


def refusal(text: str) -> str | None:
    """Why `text` is refused before parsing (the name of the limit it breaks), or None. Linear time in `text`."""
    if "__" in text:
        return "dunder"  # `__import__`, `__class__`: no mathematics has them
    if any(len(run) > MAX_INTEGER_DIGITS for run in _DIGIT_RUN.findall(text)):
        return "MAX_INTEGER_DIGITS"
    if text.count("&") + text.count("\\\\") > MAX_MATRIX_SEPARATORS:
        return "MAX_MATRIX_SEPARATORS"
    if any(name.strip() in MATRIX_OPERATORS for name in _OPERATOR_NAME.findall(text)):
        return "MATRIX_OPERATORS"
    opener, depth = {}, 0
    stack = []
    for index, char in enumerate(text):
        if char in _OPENERS:
            stack.append(index)
            depth = max(depth, len(stack))
        elif char in _CLOSERS and stack:
            opener[index] = stack.pop()  # any closer ends the innermost bracket: `[0, 1)` is one group
    if depth > MAX_NESTING:
        return "MAX_NESTING"
    known: dict[int, int] = {}
    return _power_refusal(text, opener, known) or _factorial_refusal(text, opener, known) or _bounds_refusal(text)


def _numbers_only(text: str) -> bool:
    return not _LETTER.search(_COMMAND_WORDS.sub(" ", text))


def _literal_bound(text: str) -> int:
    """An upper bound on any integer that + - * / of the integer literals of `text` make (letters ignored)."""
    bound = 1
    for run in _DIGIT_RUN.findall(text):
        bound *= max(int(run), 2)
        if bound > 10**9:
            return bound
    return bound


def _group_after(text: str, index: int) -> tuple[str, int]:
    """The operand that starts at `index` (spaces skipped): a `{...}` group, a digit run, a command or one character."""
    while index < len(text) and text[index] == " ":
        index += 1
    if index >= len(text):
        return "", index
    if text[index] == "{":
        depth = 0
        for end in range(index, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                return text[index + 1 : end], end + 1
        return text[index + 1 :], len(text)
    match = _DIGIT_RUN.match(text, index) or _COMMAND_WORDS.match(text, index)
    end = match.end() if match else index + 1
    return text[index:end], end


def _start_of_operand(text: str, end: int, opener: dict[int, int], known: dict[int, int] | None = None) -> int:
    """Where the operand that ends just before `end` starts: `\\frac{a}{b}`, `(x+1)`, `12`, `x_{1}`, `\\pi`.

    `known` maps the position of each `^` already seen to the start of its operand: a chain `x^{1}^{1}...` is then
    crossed in one step per power instead of once per power and per earlier power (quadratic in the chain).
    """
    index = end
    while index > 0 and text[index - 1] == " ":
        index -= 1
    start = index
    while start > 0 and text[start - 1] in _CLOSERS and start - 1 in opener:
        start = opener[start - 1]  # `\frac{a}{b}`: both groups, then the command
        while start > 0 and text[start - 1] in "_^ ":
            start -= 1  # `x_{1}`, `x^{2}`: the subscript's or power's own base comes next
            if known is not None and text[start] == "^" and start in known:
                start = known[start]  # that power's base is the start of an operand already found
                break
    if start == index or text[start - 1 : start].isalpha() or text[start - 1 : start].isdigit():
        while start > 0 and (text[start - 1].isalnum() or text[start - 1] == "."):
            start -= 1
        if start > 0 and text[start - 1] == "\\":
            start -= 1
    return start


def _power_refusal(text: str, opener: dict[int, int], known: dict[int, int]) -> str | None:
    # Linear: `peaks` holds (position, effective bound) of the powers seen, bounds strictly decreasing, so the largest
    # bound of the powers inside a base (the powers from the base's start on) is that of the first peak from there;
    # `digits_before` counts the digits before each position, so a base's digits cost one subtraction.
    positions: list[int] = []
    peaks: list[tuple[int, int]] = []
    digits_before = [0]
    for char in text:
        digits_before.append(digits_before[-1] + char.isdigit())
    digits = 0
    for position in (i for i, char in enumerate(text) if char == "^"):
        exponent, _ = _group_after(text, position + 1)
        if _NESTED.search(exponent) and _numbers_only(exponent):
            return "MAX_EXPONENT"  # a tower of numbers (`9^{9^{9}}`): letters keep `2^{2^{n}}` symbolic
        start = _start_of_operand(text, position, opener, known)
        known[position] = start
        first = bisect.bisect_left(positions, start)
        inner = peaks[first][1] if first < len(peaks) else 1
        effective = _literal_bound(exponent) * inner
        if effective > MAX_EXPONENT:
            return "MAX_EXPONENT"
        while peaks and peaks[-1][1] <= effective:
            peaks.pop()
            positions.pop()
        peaks.append((position, effective))
        positions.append(position)
        digits += max(1, digits_before[position] - digits_before[start]) * effective
        if digits > MAX_POWER_DIGITS:
            return "MAX_POWER_DIGITS"
    return None


def _factorial_refusal(text: str, opener: dict[int, int], known: dict[int, int]) -> str | None:
    for position in (i for i, char in enumerate(text) if char == "!" and text[i + 1 : i + 2] != "="):
        operand = text[_start_of_operand(text, position, opener, known) : position]
        if _NESTED.search(operand) and _numbers_only(operand):
            return "MAX_FACTORIAL"  # `(10^{5})!`, `(5!)!`, `\frac{10^{9}}{2}!`
        if _DIGIT_RUN.search(operand) and _literal_bound(operand) > MAX_FACTORIAL:
            return "MAX_FACTORIAL"
    return None


_BINOMIAL = re.compile(r"\\[dt]?binom\s*+")
_BIG_OPERATOR = re.compile(r"\\(?:sum|prod)(?![A-Za-z])\s*+(?:\\limits\s*+)?")


def _bounds_refusal(text: str) -> str | None:
    for match in _BINOMIAL.finditer(text):
        top, _ = _group_after(text, match.end())
        if (_NESTED.search(top) and _numbers_only(top)) or _literal_bound(top) > MAX_BINOMIAL:
            return "MAX_BINOMIAL"
    for match in _BIG_OPERATOR.finditer(text):
        index = match.end()
        for _ in range(2):  # _{i=1}^{n}, in either order
            if text[index : index + 1] not in ("_", "^"):
                break
            bound, index = _group_after(text, index + 1)
            if (_NESTED.search(bound) and _numbers_only(bound)) or _literal_bound(bound) > MAX_SUM_TERMS:
                return "MAX_SUM_TERMS"
            while index < len(text) and text[index] == " ":
                index += 1
    return None


# ------------------------------------------------------------------ parsing
# No leading `\s*`: searched from every position of a long run of spaces, it would rescan the run (quadratic time);
# `split_percent` strips the spaces before the sign instead.
_PERCENT = re.compile(r"(?:\\%|%|\\text\{\s*\\?%\s*\}|\\text\{\s*percent\s*\}|\bpercent)\s*$")
_CHOICE_GOLD = re.compile(r"\\text\{\(([A-Z])\)\}")
_CHOICE_ANSWER = re.compile(r"\(?([A-Za-z])\)?(?:[\s.:)].*)?")
_BASE = re.compile(r"\(?(?<![0-9A-Za-z])([0-9A-Za-z]+)\)?_\{?\(?(\d{1,2})\)?\}?")  # a run's start only: linear
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
    if stripped != text:
        stripped = stripped.rstrip()
    return stripped, stripped != text


@functools.lru_cache(maxsize=16384)  # a training set's golds (SimpleRL-Zoo level 3-5: 8.5k) stay parsed
def gold_form(gold: str) -> tuple:
    """How a (normalised) gold is compared: ("choice", letter), ("base", digits, base), ("text", words),
    ("math", sympy object, is_percent, answer_units, complex_numbers) or ("unreadable", text)."""
    text = clean(gold)
    if refusal(text):
        return ("unreadable", re.sub(r"\s+", "", text))
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
    units = written_units(value, percent)
    return ("math", expr, percent, answer_units, should_treat_as_complex(_normalised(value, False)), units)


# A decimal as written, with an optional power of ten: `-2.88 \times 10^{-19}`, `18.50`, `.5`
_DECIMAL = re.compile(r"(?<![\w.])(\d*+\.\d++)(?:\s*+\\(?:times|cdot)\s*+10\s*+\^\s*+\{?\s*+([+-]?\d{1,4})\s*+\}?)?")


def written_units(text: str, percent: bool = False) -> tuple[tuple[sympy.Rational, sympy.Rational], ...]:
    """(value, unit of its last written digit) for each decimal written in `text`: `18.50` -> (37/2, 1/100),
    `2.88 \\times 10^{-19}` -> (288/10^21, 1/10^21). A percentage's hundredths are listed too (`62.5\\%` also gives
    (0.625, 0.001)), as the percentage gold is also compared divided by 100. Linear in `text`."""
    units = []
    for match in _DECIMAL.finditer(text):
        digits, power = match[1], int(match[2] or 0)
        scale = sympy.Integer(10) ** power
        value = sympy.Rational(digits) * scale
        unit = sympy.Rational(1, 10 ** (len(digits) - digits.index(".") - 1)) * scale
        units.append((value, unit))
        if percent:
            units.append((value / 100, unit / 100))
    return tuple(units)


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
    if not answer or refusal(answer):
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
    value, percent = split_percent(answer)
    sides = _chain_sides(value)
    if len(sides) > 1 and not isinstance(form[1], sympy.core.relational.Relational):
        # `x = 2 + 3 = 5` against 5: every side but a name (`x`, `f(x)`, `a_{n}`) must equal the gold, so that
        # `100 = 3`, `\pi = 3` or `1 = 2 = 3` cannot pass against 3 (math-verify would compare only the last side).
        values = [side for side in sides if not is_name(side)]
        return bool(values) and all(_math_matches(form, side, percent) for side in values)
    if "=" in value and not isinstance(form[1], sympy.core.relational.Relational) and not _relations_hold(value):
        return False  # `100 = 3 \text{ or } 100 = 3`, `x = 3, 1 = 2`: a list with a false relation in it
    return _math_matches(form, value, percent)


def _relations_hold(text: str) -> bool:
    """True if, in each item of a list (split at `,` `;` `or` `and` outside brackets), the sides of `a = b = ...` that
    are not names are equal to each other."""
    items = re.split(r"[,;]", _CONNECTIVE.sub(",", text)) if _top_level_only(text) else [text]
    for item in items:
        sides = [side for side in _chain_sides(item) if not is_name(side)]
        for left, right in zip(sides, sides[1:]):
            a, b = to_sympy(left, units=False), to_sympy(right, units=False)
            if a is None or b is None or not _equivalent(a, b):
                return False
    return True


def _top_level_only(text: str) -> bool:
    # items are split only when no bracket holds a separator: `(1, 2) = (1, 2)` is one relation between pairs
    depth = 0
    for char in text:
        if char in _OPENERS:
            depth += 1
        elif char in _CLOSERS:
            depth = max(depth - 1, 0)
        elif char in ",;" and depth:
            return False
    return True


_LABEL = re.compile(r"(?:\\angle\s*+)?(?:\\[A-Za-z]++|[A-Za-z]++)(?:_\{[^{}]*+\}|_[A-Za-z0-9])?(?:\([^()=]*+\))?")


def is_name(side: str) -> bool:
    """True if `side` names a quantity rather than giving a value: a variable (`x`, `a_{n}`, `\\theta`, `AB`,
    `\\angle ABC`) or an unknown function of variables (`f(x)`). Constants (`\\pi`, `e`, `\\infty`), known functions
    (`\\sin(100)`) and functions of numbers (`f(2)`) give values: a chain's side that holds one must equal the gold."""
    if not _LABEL.fullmatch(side.replace(" ", "")):
        return False
    expr = to_sympy(side, units=False)
    if isinstance(expr, AppliedUndef):
        return all(isinstance(argument, sympy.Symbol) for argument in expr.args)
    factors = expr.args if isinstance(expr, sympy.Mul) else (expr,)
    return all(isinstance(factor, sympy.Symbol) for factor in factors)


_CONNECTIVE = re.compile(r"\\(?:text|mbox|mathrm|textrm)\s*+\{\s*+(?:or|and)\s*+\}|\\l(?:or|and)\b|\b(?:or|and)\b")


def _chain_sides(text: str) -> list[str]:
    """The sides of `a = b = c` split at each `=` outside brackets (not `<=`, `>=`, `!=`, `==`); one side if no `=`,
    or when the text is a list (`x = 1, y = 2` is read by math-verify as a whole)."""
    if _CONNECTIVE.search(text):
        return [text]  # `x=1 \text{or} x=2`: a list of solutions, read by math-verify as a whole
    sides, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in _OPENERS:
            depth += 1
        elif char in _CLOSERS:
            depth = max(depth - 1, 0)
        elif depth == 0 and char in ",;":
            return [text]
        elif char == "=" and depth == 0 and text[index - 1 : index] not in ("<", ">", "!", "\\", "="):
            if text[index + 1 : index + 2] == "=":
                return [text]
            sides.append(text[start:index].strip())
            start = index + 1
    return [*sides, text[start:].strip()] if sides else [text]


def _math_matches(form: tuple, value: str, percent: bool) -> bool:
    _, gold_expr, gold_percent, answer_units, complex_numbers, units = form
    if not value:
        return False
    answer_expr = _parse_answer(value, gold_expr, answer_units, complex_numbers)
    if answer_expr is None:
        return False
    pairs = [(gold_expr, answer_expr)]
    if gold_percent and not percent:
        pairs.append((gold_expr / 100, answer_expr))  # 62.5% = 0.625
    if percent and not gold_percent:
        pairs.append((gold_expr, answer_expr / 100))
    token = _GOLD_UNITS.set(units)
    try:
        return any(_equivalent(g, a) for g, a in pairs)
    finally:
        _GOLD_UNITS.reset(token)


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


# The decimals written in the gold being compared, as `written_units` lists them: set by `_math_matches` around
# one comparison, read by `_numbers_equal` wherever math-verify calls it from (an element of a tuple or a matrix).
_GOLD_UNITS: contextvars.ContextVar[tuple] = contextvars.ContextVar("gold_units", default=())


def exact(expr):
    """`expr` with every decimal read as the exact value it writes (`1.5` -> 3/2, so `1.5 \\times 10^{6}` is the
    integer 1500000), evaluated. A decimal keeps all its written digits (sympy gives a long literal the precision
    it needs), so `12345.0000000000000000001` stays apart from 12345."""
    floats = expr.atoms(sympy.Float)
    if floats:
        expr = expr.xreplace({f: sympy.Rational(str(f)) for f in floats if f.is_finite})
    return expr.doit()


def _numbers_equal(gold, answer) -> bool:
    """Two numbers (sympy objects) compared by the rules of docs/grading.md ("Numbers"); `gold` is the gold's."""
    decimal_gold, decimal_answer = gold.has(sympy.Float), answer.has(sympy.Float)
    gold, answer = exact(gold), exact(answer)
    if gold.is_infinite or answer.is_infinite:  # the test below reads oo = -oo (oo <= 1e-30 * oo) and oo != oo (nan)
        return gold == answer and not gold.has(sympy.zoo)  # zoo, as in 1/0, is no value
    if gold.is_Rational and answer.is_Rational:
        if gold.is_Integer or answer.is_Integer or not (decimal_gold or decimal_answer):
            return gold == answer  # an integer on either side, or two exact fractions: no tolerance at all
    elif gold.is_Integer or answer.is_Integer:
        return _close(gold, answer, 1e-30)  # an integer and an exact form of it (`\sqrt{144}`), nothing near
    if decimal_gold:
        # a decimal gold: a relative 1e-4, and never wider than half a unit of its last written digit
        unit = min((u for value, u in _GOLD_UNITS.get() if value == abs(gold)), default=None)
        if unit is not None and gold.is_Rational:
            return _close(gold, answer, NUMBER_REL_TOL) and bool(abs(sympy.N(answer - gold, 50)) < unit / 2)
        return _close(gold, answer, NUMBER_REL_TOL)
    # a decimal answer to an exact gold (0.33333 for 1/3): a relative 1e-4; exact forms (sqrt(2)/2 vs 1/sqrt(2))
    # compared at 50 digits
    return _close(gold, answer, NUMBER_REL_TOL if decimal_answer else 1e-30)


def _close(gold, answer, tolerance: float) -> bool:
    try:
        a, b = sympy.N(gold, 50), sympy.N(answer, 50)
        difference = abs(a - b)
        bound = sympy.Rational(str(tolerance)) * max(abs(a), abs(b))  # 1e-4 exactly, not its binary neighbour
        return bool(difference == 0 or difference < bound)  # a tie is outside
    except (TypeError, ValueError, ArithmeticError):  # NaN (0/0, a divergent integral): sympy refuses to compare it
        return False


# math-verify compares the elements of tuples, sets, intervals and matrices with its own number rule (rounding to 6
# decimals): its two comparison functions are wrapped so that two numbers anywhere go through `_numbers_equal`.
_EXPR_EQ, _NUMERIC_EQ = _grader.sympy_expr_eq, _grader.sympy_numeric_eq


def _expr_eq(gold, pred, *args, **kwargs) -> bool:
    if _is_number(gold) and _is_number(pred):
        return _numbers_equal(gold, pred)
    return _EXPR_EQ(gold, pred, *args, **kwargs)


def _numeric_eq(gold, pred, *args, **kwargs) -> bool:
    if _is_number(gold) and _is_number(pred):
        return _numbers_equal(gold, pred)
    if isinstance(gold, sympy.Expr) and isinstance(pred, sympy.Expr) and (gold.has(sympy.Float) or pred.has(sympy.Float)):
        # math-verify evaluates the difference with `chop`, which drops any coefficient under 1e-15 or so
        # (`x = 2.89 \times 10^{-19}` against `x = 2.88 \times 10^{-19}`): decimals are compared as written instead
        return sympy.expand(exact(gold) - exact(pred)) == 0
    return _NUMERIC_EQ(gold, pred, *args, **kwargs)


_grader.sympy_expr_eq, _grader.sympy_numeric_eq = _expr_eq, _numeric_eq


# ------------------------------------------------------------------ time bound
def answers_match_with_deadline(answer: str, gold: str, timeout_s: float) -> bool:
    """`answers_match`, interrupted after `timeout_s` seconds (counts as no match). Main thread only."""
    return _compare(answer, gold, timeout_s) == "1"


def _compare(answer: str, gold: str, timeout_s: float) -> str:
    """`answers_match` under a deadline: "1" (a match), "0" (no match) or "t" (interrupted at `timeout_s`)."""
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
            return "1" if answers_match(answer, gold) else "0"
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _DeadlineExceeded:
        return "t"
    finally:
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0:  # someone else's timer was running: give it back (approximately)
            signal.setitimer(signal.ITIMER_REAL, max(previous_delay - (time.monotonic() - started), 1e-3))


# ------------------------------------------------------------------ the worker process
# The parent (`dhpo_trl.scoring.rewards`) kills the worker at the deadline plus a margin; inside the worker, SIGALRM ends
# Python-level overruns at the deadline, and two kernel limits hold even where C code never returns to Python:
WORKER_MEMORY_HEADROOM_BYTES = 768 * 2**20  # RLIMIT_AS: the address space after start-up plus this much
WORKER_CPU_MARGIN_S = 2  # RLIMIT_CPU per comparison: its deadline plus this, also if the parent is gone


def _limit_memory() -> None:
    import resource

    with open("/proc/self/statm") as statm:  # first field: the address space, in pages
        size = int(statm.read().split()[0]) * resource.getpagesize()
    limit = size + WORKER_MEMORY_HEADROOM_BYTES
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def _limit_cpu(timeout_s: float) -> None:
    # SIGXCPU (whose default action ends the process) once this comparison has used its deadline in CPU time and
    # WORKER_CPU_MARGIN_S more: the wall-clock kill by the parent comes first, unless the parent died.
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    seconds = math.ceil(used.ru_utime + used.ru_stime + timeout_s) + WORKER_CPU_MARGIN_S
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (seconds if hard == resource.RLIM_INFINITY else min(seconds, hard), hard))


_PR_SET_PDEATHSIG = 1


def _follow_parent(parent_pid: int, death_signal: bool) -> None:
    """End this process when its parent dies, also in the middle of a comparison: the kernel's parent-death signal
    (Linux; SIGKILL, which C code cannot delay), and a watchdog thread on the parent's id for the cases it does not
    cover (another system, or a parent thread that ends while the process lives on)."""
    if death_signal and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


# Compared once before the worker says it is ready: the first parse loads math-verify's grammar and sympy's printers
# (about 0.15 s), a cost that would otherwise fall on the first answer of a call and, under a short first-pass
# deadline, score a quick answer 0.
_WARM_UP = ((r"\frac{24}{2}", "12"), ("0.5", r"\frac{1}{2}"), ("(1, 2)", r"\left(1, 2\right)"), ("x = 3", "3"))


def _warm_up() -> None:
    for answer, gold in _WARM_UP:
        try:
            _compare(answer, gold, 10.0)
        except Exception:  # noqa: BLE001 - a warm-up that fails leaves the first answer to pay the cost
            pass


def _serve() -> None:
    """Worker loop. Request, one JSON line on stdin:
    `{"id": int, "timeout_s": float, "pairs": [[answer, gold], ...], "budget_s": float (optional)}`.
    Reply, one line per pair as soon as it is compared: `<id> <index> <code>`, code "1" (a match), "0" (no match),
    "t" (interrupted at `timeout_s`) or "b" (interrupted or not started because `budget_s` seconds have passed since
    the request arrived). The id lets the parent skip replies to a request it gave up on. Ends when stdin closes.
    Arguments: the parent's process id and "1" to arm the parent-death signal (`_follow_parent`)."""
    if len(sys.argv) >= 3:
        _follow_parent(int(sys.argv[1]), sys.argv[2] == "1")
    _limit_memory()
    _warm_up()
    print("ready", flush=True)
    for line in sys.stdin:
        arrived = time.monotonic()
        try:
            request = json.loads(line)
            request_id, timeout_s, pairs = int(request["id"]), float(request["timeout_s"]), list(request["pairs"])
            end = arrived + float(request.get("budget_s", math.inf))
        except Exception:  # noqa: BLE001 - not a request: nothing to answer
            continue
        for index, pair in enumerate(pairs):
            left = end - time.monotonic()
            deadline = min(timeout_s, left)
            try:
                if left <= 0:
                    code = "b"
                else:
                    _limit_cpu(deadline)
                    answer, gold = pair
                    code = _compare(str(answer), str(gold), deadline)
                    if code == "t" and deadline < timeout_s:
                        code = "b"
            except Exception:  # noqa: BLE001 - a bad pair (or MemoryError) scores 0, the worker keeps serving
                code = "0"
            print(f"{request_id} {index} {code}", flush=True)


if __name__ == "__main__":
    _serve()
