r"""A scorer audit that cannot pass by construction: for every gold, answers that must score 1 and answers that must
score 0, none of them the gold's own text.

- rewrite: a correct answer generated in another form (`\frac{3}{2}` -> `1.5`, `4.5 \times 10^{33}` ->
  `45 \times 10^{32}`, a set in reverse order, an equation with its sides swapped, sympy's own LaTeX of a formula).
  It must score 1, and it never equals the gold's text, so no text comparison can make it pass.
- near misses: the last number + 1, the sign flipped (of the last component of a list), a wrong base, the next
  letter of a multiple-choice answer. Each must score 0.
- rotated: the gold of another problem of the same benchmark. Must score 0 unless the two golds are the same text.

`scripts/audit_scorer.py` runs it on the real test sets; tests/test_grading_audit.py on invented golds that cover
every normalisation rule.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from decimal import Decimal, localcontext
from fractions import Fraction

import sympy

from ..scoring._math_verify_core import _TEXT_GOLD, clean, gold_form, to_sympy
from ..scoring.golds import split_top_level
from ..scoring.rewards import DEFAULT_TIMEOUT_S, forget_slow_answers, score_answer


@dataclass
class Finding:
    index: int
    gold: str
    check: str  # "rewrite", "last+1", "sign", "base", "letter", "rotated"
    answer: str
    score: float


@dataclass
class BenchmarkAudit:
    name: str
    golds: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # math / text / choice / base / unreadable
    unreadable: list[tuple[int, str]] = field(default_factory=list)
    words: list[tuple[int, str]] = field(default_factory=list)
    rewrites: int = 0
    rewrites_accepted: int = 0
    near_misses: dict[str, int] = field(default_factory=dict)  # tries per kind
    rotated: int = 0
    rejected_rewrites: list[Finding] = field(default_factory=list)
    false_positives: list[Finding] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    deadline_hits: list[Finding] = field(default_factory=list)

    @property
    def near_miss_tries(self) -> int:
        return sum(self.near_misses.values())


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


# ------------------------------------------------------------------ numbers, read without the grader
_FRAC = r"\\[dt]?frac\s*(?:\{(-?\d+)\}|(\d))\s*(?:\{(-?\d+)\}|(\d))"


def exact_number(text: str) -> Fraction | None:
    r"""The value of a plain number in LaTeX (`-12`, `0.15`, `\frac{3}{2}`, `1\frac{4}{5}`, `4.5 \times 10^{33}`)."""
    text = text.strip()
    if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)", text):
        return Fraction(Decimal(text))
    if match := re.fullmatch(r"([+-]?(?:\d+\.?\d*|\.\d+))\s*\\(?:times|cdot)\s*10\^\{?([+-]?\d+)\}?", text):
        return Fraction(Decimal(match[1])) * Fraction(10) ** int(match[2])
    if match := re.fullmatch(rf"(-?)\s*(\d+)?\s*{_FRAC}", text):
        sign, whole = (-1 if match[1] else 1), int(match[2] or 0)
        numerator, denominator = int(match[3] or match[4]), int(match[5] or match[6])
        return sign * (whole + Fraction(numerator, denominator)) if denominator else None
    return None


def _decimal(value: Fraction) -> str | None:
    """A finite decimal for `value`, or None if it has none (1/3)."""
    denominator = value.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    if denominator != 1:
        return None
    # enough digits for the exact quotient (at most the numerator's plus log2 of the denominator): no rounding,
    # and an exact quotient carries no trailing zeros
    with localcontext(prec=len(str(abs(value.numerator))) + 4 * len(str(value.denominator))):
        return f"{Decimal(value.numerator) / Decimal(value.denominator):f}"


def _number_rewrite(text: str, value: Fraction, in_list: bool) -> str:
    if "\\times" in text or "\\cdot" in text:  # a x 10^b -> (10a) x 10^(b-1)
        mantissa, exponent = re.split(r"\\times|\\cdot", text)
        power = int(re.sub(r"[^\d+-]", "", exponent.split("^", 1)[1]))
        return f"{_decimal(Fraction(Decimal(mantissa.strip())) * 10)} \\times 10^{{{power - 1}}}"
    if value.denominator == 1:  # thousands commas, except inside a list where they would split the number
        return f"{value.numerator:,}" if abs(value) >= 10_000 and not in_list else f"{value.numerator}.00"
    if "frac" in text:
        return _decimal(value) or f"{value.numerator}/{value.denominator}"
    return f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


# ------------------------------------------------------------------ structure
def _bracketed(text: str) -> tuple[str, str, str] | None:
    r"""(open, inside, close) for `(a, b)`, `[a, b)`, `\left( a \right]` or `\{a, b\}` whose brackets match."""
    text = re.sub(r"\\left\s*|\\right\s*", "", text).strip()
    opener = "\\{" if text.startswith("\\{") else text[:1]
    closer = "\\}" if text.endswith("\\}") else text[-1:]
    if opener not in ("(", "[", "\\{") or closer not in (")", "]", "\\}"):
        return None
    inside = text[len(opener) : len(text) - len(closer)]
    depth = 0
    for char in inside:  # "(a)(b)" is not one bracketed group
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(char, 0)
        if depth < 0:
            return None
    return (opener, inside, closer) if depth == 0 and "," in inside else None


def _top_level_equals(text: str) -> list[str]:
    parts = split_top_level(text, "=")
    return parts if len(parts) == 2 and all(parts) and not re.search(r"[<>!\\]$", parts[0]) else [text]


# ------------------------------------------------------------------ rewrites
def rewrite(gold: str) -> str:
    """A correct answer to `gold`, written in another form (never the gold's own text)."""
    candidate = _rewrite(gold)
    if _squash(candidate) == _squash(gold):
        candidate = f"\\left({gold}\\right)"
    return candidate


def _rewrite(gold: str, in_list: bool = False) -> str:
    form = gold_form(gold)
    if form[0] == "choice":
        return f"\\textbf{{({form[1]})}}"
    if form[0] == "base":
        return f"({form[1]})_{{{form[2]}}}"
    if form[0] == "text":  # the words as gold_form found them, after clean (`\text{east}.`, `$\text{east}$`)
        return f"\\textbf{{{_TEXT_GOLD.fullmatch(clean(gold))[1].upper()}}}"
    text = gold.strip()
    if text.endswith("\\%") and (value := exact_number(text[:-2])) is not None:
        return _decimal(value / 100) or f"\\frac{{{value.numerator}}}{{{value.denominator * 100}}}"
    degrees = re.fullmatch(r"(.+?)\s*\^\s*\{?\\circ\}?", text)
    if degrees and (value := exact_number(degrees[1])) is not None:
        return f"{_number_rewrite(degrees[1], value, in_list)}\u00b0"
    if (value := exact_number(text)) is not None:
        return _number_rewrite(text, value, in_list)
    parts = split_top_level(text)
    if len(parts) > 1:  # a collection: order does not matter
        return ", ".join(_rewrite(part, in_list=True) for part in reversed(parts))
    if bracketed := _bracketed(text):
        opener, inside, closer = bracketed
        parts = [_rewrite(part, in_list=True) for part in split_top_level(inside)]
        if opener == "\\{":
            return "\\{" + ", ".join(reversed(parts)) + "\\}"
        return f"\\left{opener} {', '.join(parts)} \\right{closer}"
    if len(pieces := re.split(r"\\cup", text)) > 1:
        return " \\cup ".join(_rewrite(piece.strip()) for piece in reversed(pieces))
    if match := re.fullmatch(r"(.+?)\\pm(.+)", text):
        return f"{match[1].strip()} - {match[2].strip()}, {match[1].strip()} + {match[2].strip()}"
    if "matrix}" in text:  # a pmatrix as a bmatrix, other matrices as a pmatrix (a vmatrix is a determinant)
        return re.sub(r"\{[pbB]?matrix\}", "{bmatrix}" if "pmatrix" in text else "{pmatrix}", text)
    if match := re.fullmatch(r"(.+?)\s*(\\[gl]eq?slant|\\[gl]eq?(?![A-Za-z])|<|>)\s*(.+)", text):
        flipped = {"<": ">", ">": "<", "\\ge": "\\le", "\\le": "\\ge", "\\geq": "\\leq", "\\leq": "\\geq"}
        relation = re.sub(r"slant$", "", match[2])
        return f"{match[3]} {flipped[relation]} {match[1]}"
    sides = _top_level_equals(text)
    if len(sides) == 2:
        return f"{sides[1]} = {sides[0]}"
    if len(terms := _terms(text)) > 1:  # a sum: the first term moved to the end
        first_sign, first = terms[0]
        rest = "".join(f" {sign} {term}" for sign, term in terms[1:]).strip()
        return (rest.removeprefix("+ ")) + f" {first_sign} {first}"
    expr = to_sympy(text, units=False)
    if isinstance(expr, sympy.Expr):  # one term: sympy's own LaTeX, if it reads back
        for candidate in (expr, sympy.expand(expr)):
            printed = sympy.latex(candidate, inv_trig_style="full", ln_notation=True, imaginary_unit="i")
            if _squash(printed) != _squash(text) and _reads_back(printed, expr):
                return printed
    return f"\\left({text}\\right)"


def _reads_back(printed: str, expr) -> bool:
    # sympy prints some objects lossily (a two-argument log loses its base): keep a print only if it parses back
    # to the same expression
    reparsed = to_sympy(printed, units=False)
    try:
        return reparsed is not None and sympy.expand(reparsed - expr) == 0
    except Exception:  # noqa: BLE001
        return False


def _terms(text: str) -> list[tuple[str, str]]:
    """[(sign, term), ...] of a sum at the top level (outside braces and brackets)."""
    terms, depth, start, sign = [], 0, 0, "+"
    for index, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif (
            char in "+-"
            and depth == 0
            and index > 0
            and text[index - 1] not in "^_{(\\"
            and text[:index].strip()
            and not re.search(r"[\^_]\s*$", text[:index])
        ):
            terms.append((sign, text[start:index].strip()))
            sign, start = char, index + 1
    terms.append((sign, text[start:].strip()))
    if terms[0][1].startswith("-"):
        terms[0] = ("-", terms[0][1][1:].strip())
    return [(s, t) for s, t in terms if t]


# ------------------------------------------------------------------ near misses
_LAST_NUMBER = re.compile(r"(?:\d+(?:\.\d+)?|\.\d+)(?!.*\d)", re.DOTALL)


def near_misses(gold: str) -> list[tuple[str, str]]:
    """(kind, answer) pairs that are wrong for `gold` and must score 0."""
    form = gold_form(gold)
    if form[0] == "choice":
        return [("letter", chr(ord("A") + (ord(form[1]) - ord("A") + 1) % 5))]
    if form[0] == "base":
        digits, base = form[1], form[2]
        misses = [("base", f"{digits}_{{{base + 1}}}"), ("base", str(int(digits, base)))]
        return [*misses, ("last+1", f"{_to_base(int(digits, base) + 1, base)}_{{{base}}}")]
    if form[0] in ("text", "unreadable"):
        return []
    text = gold.strip()
    misses = []
    if match := _LAST_NUMBER.search(text):
        number = match[0]
        bumped = str(Decimal(number) + 1)
        misses.append(("last+1", text[: match.start()] + bumped + text[match.end() :]))
    if (flipped := _flip_sign(text)) is not None:
        misses.append(("sign", flipped))
    return misses


def _to_base(value: int, base: int) -> str:
    digits = ""
    while True:
        value, digit = divmod(value, base)
        digits = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"[digit] + digits
        if not value:
            return digits


def _flip_sign(text: str) -> str | None:
    """The gold with its last component's sign flipped; None where that changes nothing (zero)."""
    parts = split_top_level(text)
    if len(parts) > 1:
        last = _flip_sign(parts[-1])
        return None if last is None else ", ".join([*parts[:-1], last])
    if bracketed := _bracketed(text):
        opener, inside, closer = bracketed
        parts = split_top_level(inside)
        last = _flip_sign(parts[-1])
        return None if last is None else f"{opener}{', '.join([*parts[:-1], last])}{closer}"
    relation = re.fullmatch(r"(.+?)\s*(=|\\[gl]eq?slant|\\[gl]eq?(?![A-Za-z])|<|>)\s*(.+)", text)
    if relation and "=" not in relation[3]:
        right = _flip_sign(relation[3])
        return None if right is None else f"{relation[1]} {relation[2]} {right}"
    value = exact_number(text.removesuffix("\\%"))
    if value == 0:
        return None
    if text.startswith("-") and (value is not None or not re.search(r"[+-]", text[1:])):
        return text[1:].strip()
    return f"-{text}" if value is not None else f"-\\left({text}\\right)"


# ------------------------------------------------------------------ the audit
def audit_benchmark(
    name: str, golds: list[str], *, rotations: int = 3, timeout_s: float = DEFAULT_TIMEOUT_S
) -> BenchmarkAudit:
    """Score every gold's rewrite, near misses and rotated neighbours; collect what goes wrong and the timings."""
    report = BenchmarkAudit(name=name, golds=len(golds))

    def score(index: int, check: str, answer: str, retry: bool = True) -> float:
        started = time.perf_counter()
        value = score_answer(f"The answer is $\\boxed{{{answer}}}$.", golds[index], timeout_s=timeout_s)
        elapsed = time.perf_counter() - started
        if elapsed >= timeout_s and retry:  # once more, so that a busy machine is not taken for a slow grader
            forget_slow_answers()  # else the reward's cache would answer 0 at once
            return score(index, check, answer, retry=False)
        report.seconds.append(elapsed)
        if elapsed >= timeout_s:
            report.deadline_hits.append(Finding(index, golds[index], check, answer, value))
        return value

    for index, gold in enumerate(golds):
        kind = gold_form(gold)[0]
        report.kinds[kind] = report.kinds.get(kind, 0) + 1
        if kind == "unreadable":
            report.unreadable.append((index, gold))
        if kind == "text":
            report.words.append((index, gold))
        correct = rewrite(gold)
        report.rewrites += 1
        if score(index, "rewrite", correct) == 1.0:
            report.rewrites_accepted += 1
        else:
            report.rejected_rewrites.append(Finding(index, gold, "rewrite", correct, 0.0))
        for check, wrong in near_misses(gold):
            report.near_misses[check] = report.near_misses.get(check, 0) + 1
            if score(index, check, wrong) != 0.0:
                report.false_positives.append(Finding(index, gold, check, wrong, 1.0))
        for offset in range(1, min(rotations, len(golds) - 1) + 1):
            other = golds[(index + offset) % len(golds)]
            if _squash(other) == _squash(gold):
                continue  # the same gold: a correct answer, not a rotated wrong one
            report.rotated += 1
            if score(index, "rotated", other) != 0.0:
                report.false_positives.append(Finding(index, gold, "rotated", other, 1.0))
    return report


def format_table(reports: list[BenchmarkAudit]) -> str:
    """One Markdown row per benchmark with the audit's counts, rates and timings."""
    header = (
        "| benchmark | golds | read as math | words | choice | base | string-only | rewrites scored 1 | "
        "near-miss FP | rotated FP | mean ms | max ms | over deadline |"
    )
    lines = [header, "|" + "---|" * 13]
    for r in reports:
        math_golds = r.kinds.get("math", 0) + r.kinds.get("unreadable", 0)
        near_fp = sum(f.check not in ("rewrite", "rotated") for f in r.false_positives)
        rotated_fp = sum(f.check == "rotated" for f in r.false_positives)
        mean_ms = 1000 * sum(r.seconds) / max(len(r.seconds), 1)
        lines.append(
            f"| {r.name} | {r.golds} | {r.kinds.get('math', 0)}/{math_golds} | {r.kinds.get('text', 0)} | "
            f"{r.kinds.get('choice', 0)} | {r.kinds.get('base', 0)} | {len(r.unreadable)} | "
            f"{r.rewrites_accepted}/{r.rewrites} ({100 * r.rewrites_accepted / max(r.rewrites, 1):.1f}%) | "
            f"{near_fp}/{r.near_miss_tries} | {rotated_fp}/{r.rotated} | {mean_ms:.1f} | "
            f"{1000 * max(r.seconds, default=0):.0f} | {len(r.deadline_hits)} |"
        )
    return "\n".join(lines)
