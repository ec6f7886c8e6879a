"""The scorer audit (dhpo_trl.evaluation.audit) on invented golds that cover every normalisation rule: every
generated correct rewrite scores 1, every near miss and rotated gold scores 0 -- and the audit fails a grader that
is broken in the ways the real audit found (text comparison, a lost base, a scorer that accepts anything)."""

import json
import re
from pathlib import Path

import pytest

from dhpo_trl.evaluation import audit
from dhpo_trl.scoring import _math_verify_core, rewards
from dhpo_trl.scoring.golds import normalise_gold

FIXTURE = Path(__file__).parent / "fixtures" / "grader_golds.jsonl"
ROWS = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
GOLDS = [normalise_gold(r["gold"], question=r["question"], unit=r["unit"]) for r in ROWS]
RULES = {
    "e-notation", "python-syntax", "trailing-punctuation", "value-of-assignment", "equation-kept", "base-subscript",
    "multi-component", "unit-text", "unit-letter", "percent", "degrees", "multiple-choice", "word", "thousands",
    "gsm8k-hashes", "greek-variable", "derivative", "prime", "complex", "interval-union", "plus-minus", "matrix",
    "inequality", "mixed-number", "symbol", "subscript-command", "subscript-text", "number", "expression",
}  # fmt: skip


def squash(text):
    return re.sub(r"\s+", "", str(text))


def test_fixtures_cover_every_rule():
    assert {row["rule"] for row in ROWS} == RULES


@pytest.fixture(scope="module")
def report():
    return audit.audit_benchmark("fixtures", GOLDS, rotations=1)


def test_every_gold_is_read_and_every_rewrite_scores_one(report):
    assert report.golds == len(ROWS) == report.rewrites
    assert report.unreadable == []
    assert report.kinds == {"math": 46, "base": 2, "choice": 3, "text": 1}
    assert [(f.gold, f.answer) for f in report.rejected_rewrites] == []
    assert report.rewrites_accepted == len(ROWS)


def test_no_near_miss_or_rotated_gold_scores_one(report):
    assert [(f.check, f.gold, f.answer) for f in report.false_positives] == []
    assert report.near_misses["last+1"] >= 45 and report.near_misses["sign"] >= 40
    assert report.near_misses["base"] == 4 and report.near_misses["letter"] == 3
    assert report.rotated == len(ROWS)
    assert report.deadline_hits == []


def test_rewrites_and_near_misses_never_repeat_the_gold_text():
    for row, gold in zip(ROWS, GOLDS):
        answers = [audit.rewrite(gold)] + [wrong for _, wrong in audit.near_misses(gold)]
        for answer in answers:
            assert squash(answer) not in (squash(gold), squash(row["gold"])), (gold, answer)


@pytest.mark.parametrize(
    ("gold", "rewrite", "misses"),
    [
        (
            r"4.5 \times 10^{33}",
            r"45 \times 10^{32}",
            [("last+1", r"4.5 \times 10^{34}"), ("sign", r"-4.5 \times 10^{33}")],
        ),
        ("52_{8}", "(52)_{8}", [("base", "52_{9}"), ("base", "42"), ("last+1", "53_{8}")]),
        (r"\text{(C)}", r"\textbf{(C)}", [("letter", "D")]),
        ("0", "0.00", [("last+1", "1")]),  # -0 is 0: no sign near miss
        ("1, -2", "-2.00, 1.00", [("last+1", "1, -3"), ("sign", "1, 2")]),
        (r"\frac{3}{2}", "1.5", [("last+1", r"\frac{3}{3}"), ("sign", r"-\frac{3}{2}")]),
        ("y = 2x + 3", "2x + 3 = y", [("last+1", "y = 2x + 4"), ("sign", r"y = -\left(2x + 3\right)")]),
    ],
)
def test_rewrites_and_near_misses_are_what_the_docs_say(gold, rewrite, misses):
    assert audit.rewrite(gold) == rewrite
    assert audit.near_misses(gold) == misses


def test_exact_numbers_are_read_without_the_grader():
    from fractions import Fraction

    assert audit.exact_number(r"1\frac{4}{5}") == Fraction(9, 5)
    assert audit.exact_number(r"-\frac43") == Fraction(-4, 3)
    assert audit.exact_number(r"2.5 \times 10^{-3}") == Fraction(1, 400)
    assert audit.exact_number(".125") == Fraction(1, 8)
    assert audit.exact_number("x + 1") is None


def _audit_with(monkeypatch, scorer):
    monkeypatch.setattr(audit, "score_answer", scorer)
    return audit.audit_benchmark("broken", GOLDS, rotations=1)


def test_the_audit_fails_a_grader_that_compares_text(monkeypatch):
    def text_equality(completion, gold, **kwargs):
        boxed = re.search(r"\\boxed\{(.*)\}\$\.$", completion)[1]
        return float(squash(boxed) == squash(gold))

    broken = _audit_with(monkeypatch, text_equality)
    assert broken.rewrites_accepted == 0 and len(broken.rejected_rewrites) == len(ROWS)


def test_the_audit_fails_a_grader_that_accepts_anything(monkeypatch):
    broken = _audit_with(monkeypatch, lambda completion, gold, **kwargs: 1.0)
    assert len(broken.false_positives) == broken.near_miss_tries + broken.rotated > len(ROWS)


def test_the_audit_fails_a_grader_that_reads_a_base_subscript_as_a_number(monkeypatch):
    """The bug the real audit found: 52_8 read as 52, so 52_9 scored 1. Grading runs in a worker process, out of
    this test's reach, so the planted grader runs in-process behind a stand-in pool."""

    class InProcessPool:
        def grade(self, pairs, timeout_s, budget_s, workers):
            return {(answer, gold): _math_verify_core.answers_match(answer, gold) for answer, gold in pairs}

    monkeypatch.setattr(rewards, "_POOL", InProcessPool())
    monkeypatch.setattr(_math_verify_core, "_base_number", lambda text: None)
    _math_verify_core.gold_form.cache_clear()
    try:
        broken = audit.audit_benchmark(
            "broken", [g for g, r in zip(GOLDS, ROWS) if r["rule"] == "base-subscript"], rotations=0
        )
    finally:
        _math_verify_core.gold_form.cache_clear()
    accepted = [f.answer for f in broken.false_positives]  # the last number of 61_{7} is its base: 61_{8}
    assert "61_{8}" in accepted and "1011_{3}" in accepted


def test_table_reports_counts_rates_and_timings(report):
    table = audit.format_table([report]).splitlines()
    cells = [cell.strip() for cell in table[2].strip("|").split("|")]
    assert cells[:7] == ["fixtures", str(len(ROWS)), "46/46", "1", "3", "2", "0"]
    assert cells[7] == f"{len(ROWS)}/{len(ROWS)} (100.0%)"
    assert cells[8] == f"0/{report.near_miss_tries}" and cells[9] == f"0/{report.rotated}"
    assert float(cells[10]) > 0 and int(cells[11]) < 1000 * audit.DEFAULT_TIMEOUT_S and cells[12] == "0"


def test_table_row_from_a_report_built_by_hand():
    """Every cell against a hand computation, on a report with no audit run behind it (so it takes no time)."""

    def finding(check):
        return audit.Finding(0, "1", check, "2", 1.0)

    report = audit.BenchmarkAudit(
        name="hand", golds=9, kinds={"math": 5, "unreadable": 1, "text": 2, "choice": 1, "base": 3},
        unreadable=[(4, "??")], rewrites=8, rewrites_accepted=6, near_misses={"digit": 4, "sign": 3}, rotated=5,
        false_positives=[finding("digit"), finding("sign"), finding("letter"), finding("rotated"), finding("rewrite")],
        seconds=[0.1, 0.2, 0.0125], deadline_hits=[finding("digit"), finding("sign")],
    )  # fmt: skip
    header, rule, row = audit.format_table([report]).split("\n")
    assert header == (
        "| benchmark | golds | read as math | words | choice | base | string-only | rewrites scored 1 | "
        "near-miss FP | rotated FP | mean ms | max ms | over deadline |"
    )
    assert rule == "|" + "---|" * 13
    # math 5 of 5 + 1 unreadable; 6/8 = 75.0%; near misses: the three not "rewrite"/"rotated" of 4 + 3 tries;
    # mean (100 + 200 + 12.5) / 3 = 104.1666 ms; max 200 ms
    assert row == "| hand | 9 | 5/6 | 2 | 1 | 3 | 1 | 6/8 (75.0%) | 3/7 | 1/5 | 104.2 | 200 | 2 |"
    single = audit.format_table([audit.BenchmarkAudit(name="one", seconds=[0.004])]).split("\n")[2]
    assert single.endswith("| 4.0 | 4 | 0 |")  # the mean of one timing is that timing
    slow = audit.format_table([audit.BenchmarkAudit(name="one", rewrites=1, rewrites_accepted=1, seconds=[2.0])])
    assert "| 1/1 (100.0%) |" in slow and slow.endswith("| 2000.0 | 2000 | 0 |")  # one rewrite; seconds to ms
    empty = audit.format_table([audit.BenchmarkAudit(name="none")]).split("\n")[2]
    assert empty == "| none | 0 | 0/0 | 0 | 0 | 0 | 0 | 0/0 (0.0%) | 0/0 | 0/0 | 0.0 | 0 | 0 |"  # no division by zero
    assert audit.format_table([]) == header + "\n" + rule


def test_audit_accounting_with_a_scripted_grader_and_clock(monkeypatch):
    """audit_benchmark's bookkeeping on its own: a scripted grader, gold reader, rewrites, near misses and clock.

    Golds: "1" (math), "words" (text), "??" (unreadable), " 1" (math, the same gold as "1" up to spaces).
    Each scoring call takes 0.1 s, except: "R1" takes 2.0 s (exactly the 2.0 s deadline) then 0.5 s on the
    retry; "-words" and the first "??" (gold 0's rotation) take 3.0 s and "R??" exactly 2.0 s both times, so all
    three are deadline hits.
    """
    kinds = {"1": "math", "words": "text", "??": "unreadable", " 1": "math", "2": "math", "3": "math"}
    monkeypatch.setattr(audit, "gold_form", lambda gold: (kinds[gold], None))
    monkeypatch.setattr(audit, "rewrite", lambda gold: "R" + gold.strip())
    monkeypatch.setattr(audit, "near_misses", lambda gold: [("sign", "-" + gold.strip())])
    clock, calls = [0.0], []
    durations = {"R1": [2.0, 0.5], "-words": [3.0, 3.0], "R??": [2.0, 2.0], "??": [3.0, 3.0]}
    accepted = {("R1", "1"), ("R1", " 1"), ("Rwords", "words"), ("-words", "words"), ("1", "words")}

    def grader(completion, gold, timeout_s):
        answer = re.fullmatch(r"The answer is \$\\boxed\{(.*)\}\$\.", completion)[1]
        calls.append((answer, gold, timeout_s))
        clock[0] += durations[answer].pop(0) if durations.get(answer) else 0.1
        return 1.0 if (answer, gold) in accepted else 0.0

    monkeypatch.setattr(audit, "score_answer", grader)
    monkeypatch.setattr(audit.time, "perf_counter", lambda: clock[0])
    golds = ["1", "words", "??", " 1"]
    report = audit.audit_benchmark("scripted", golds, timeout_s=2.0)

    assert (report.name, report.golds) == ("scripted", 4)
    assert report.kinds == {"math": 2, "text": 1, "unreadable": 1}
    assert report.unreadable == [(2, "??")] and report.words == [(1, "words")]
    assert (report.rewrites, report.rewrites_accepted) == (4, 3)
    assert report.rejected_rewrites == [audit.Finding(2, "??", "rewrite", "R??", 0.0)]
    assert report.near_misses == {"sign": 4}
    # default rotations=3: each gold meets the other three, except that "1" and " 1" are the same gold
    assert report.rotated == 3 * 4 - 2
    assert report.false_positives == [
        audit.Finding(1, "words", "sign", "-words", 1.0),
        audit.Finding(1, "words", "rotated", "1", 1.0),  # words meets ??, " 1" and "1" (offsets 1, 2, 3)
    ]
    assert report.deadline_hits == [
        audit.Finding(0, "1", "rotated", "??", 0.0),
        audit.Finding(1, "words", "sign", "-words", 1.0),
        audit.Finding(2, "??", "rewrite", "R??", 0.0),
    ]
    assert all(timeout == 2.0 for _, _, timeout in calls)
    # one timing per scored answer, the retry's only: R1 twice (golds 0 and 3: 0.5 after a 2.0, then 0.1), -words 3.0
    assert len(report.seconds) == 4 + 4 + 10
    assert report.seconds[:3] == pytest.approx([0.5, 0.1, 0.1])  # R1, then gold 0's near miss and first rotation
    assert sorted(report.seconds)[-3:] == pytest.approx([2.0, 3.0, 3.0]) and report.seconds.count(pytest.approx(3.0)) == 2
    assert [a for a, _, _ in calls].count("R1") == 3  # retried once on gold 0 (2.0 >= 2.0), not on gold 3 (0.1)
    assert [a for a, _, _ in calls].count("-words") == [a for a, _, _ in calls].count("R??") == 2
    # with five different golds, each meets the next three only (rotations=3 by default)
    five = audit.audit_benchmark("five", ["1", "words", "??", "2", "3"], timeout_s=2.0)
    assert five.rotated == 5 * 3
    # forward: "words" meets "??", "2", "3" and never "1", the one rotated answer the grader accepts for it
    assert [f for f in five.false_positives if f.check == "rotated"] == []
    # more rotations than other golds: each gold meets every other gold once, never itself or one twice
    assert audit.audit_benchmark("three", ["1", "2", "3"], rotations=5, timeout_s=2.0).rotated == 3 * 2


@pytest.mark.parametrize(
    ("gold", "rewrite"),
    [
        (r"12.5\%", "0.125"),  # a percentage as its fraction
        (r"\frac{1}{3}\%", r"\frac{1}{300}"),  # ... with no finite decimal
        (r"45^\circ", "45.00\u00b0"),
        (r"\frac{1}{2}^{\circ}", "0.5\u00b0"),
        (r"30^\circ, 12345^\circ", "12345.00\u00b0, 30.00\u00b0"),  # no thousands commas inside a list
        ("12345", "12,345"),  # thousands commas from 10,000
        ("10000", "10,000"),  # the first with commas
        ("-10000", "-10,000"),
        (r"2.5 \cdot 10^{3}", r"25 \times 10^{2}"),
        ("9999", "9999.00"),
        ("1, 12345", "12345.00, 1.00"),  # no commas inside a list, and the list reversed
        (r"\frac{3}{8}", "0.375"),
        (r"\frac{1}{5}", "0.2"),
        (r"\frac{1}{3}", "1/3"),
        (r"\frac{1}{931322574615478515625}", "0." + "0" * 20 + "1073741824"),  # 1/5**30: exact, no float
        (rf"\frac{{1}}{{{2**100}}}", "0." + str(5**100).rjust(100, "0")),  # 1/2**100 = 5**100/10**100: every digit
        ("0.75", r"\frac{3}{4}"),
        (r"\{1, 2\}", r"\{2.00, 1.00\}"),  # a set reversed
        ("[1, 2)", r"\left[ 1.00, 2.00 \right)"),  # an interval kept in order
        ("(1, 12345)", r"\left( 1.00, 12345.00 \right)"),  # no thousands commas inside a tuple
        (r"\left( 1, 2 \right]", r"\left( 1.00, 2.00 \right]"),  # \left and \right are not part of the brackets
        (r"(\frac{1}{2}, 3)", r"\left( 0.5, 3.00 \right)"),  # braces inside are balanced
        ("([1, 2], 3)", r"\left( \left[ 1.00, 2.00 \right], 3.00 \right)"),  # ... and brackets
        ("((1, 2), 3)", r"\left( \left( 1.00, 2.00 \right), 3.00 \right)"),  # ... and parentheses
        ("(1, 2) + (3, 4)", "(3, 4) + (1, 2)"),  # two bracketed groups, not one
        ("(1, 2)(3, 4)", r"\left((1, 2)(3, 4)\right)"),
        ("(1, 2x", r"\left((1, 2x\right)"),  # no closing bracket
        ("(x + 1)", "x + 1"),  # brackets without a comma hold no tuple
        (r"\frac{1}{0}", r"\left(\frac{1}{0}\right)"),  # no number
        (r"(1, 2) \cup (3, 4)", r"\left( 3.00, 4.00 \right) \cup \left( 1.00, 2.00 \right)"),
        (r"1 \pm \sqrt{2}", r"1 - \sqrt{2}, 1 + \sqrt{2}"),
        (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{bmatrix} 1 \\ 2 \end{bmatrix}"),
        (r"\begin{bmatrix} 1 \\ 2 \end{bmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
        (r"\begin{Bmatrix} 1 \\ 2 \end{Bmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
        (r"\begin{matrix} 1 \\ 2 \end{matrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
        (r"\begin{vmatrix} 1 & 2 \\ 3 & 4 \end{vmatrix}", r"\left(\begin{vmatrix} 1 & 2 \\ 3 & 4 \end{vmatrix}\right)"),
        (r"x \leq 3", r"3 \geq x"),
        (r"x \geqslant 3", r"3 \leq x"),
        ("x < 3", "3 > x"),
        ("x > 3", "3 < x"),
        (r"x \ge 3", r"3 \le x"),
        (r"x \le 3", r"3 \ge x"),
        (r"x \leqslant 3", r"3 \geq x"),
        ("a = 5", "5 = a"),
        ("f(x) = x^2", "x^2 = f(x)"),
        ("a != b", r"\left(a != b\right)"),  # not an equation: "b = a !" would be wrong
        ("a = b = c", r"\left(a = b = c\right)"),  # a chain is not swapped
        ("-x + 2", "2 - x"),
        ("2x^{-1} - 3", "- 3 + 2x^{-1}"),  # an exponent's sign is no term
        ("2^ -1 + x", "x + 2^ -1"),  # ... even after a space
        ("X + 1", "1 + X"),  # the first term moved to the end
        ("X+1", "1 + X"),
        ("2X + 1", "1 + 2X"),  # a capital X inside a term is no sign
        ("x+1", "1 + x"),
        (r"a+\sqrt{b}", r"\sqrt{b} + a"),
        ("x^2+1", "1 + x^2"),
        ("x^2 + 2x + 1", "2x + 1 + x^2"),  # three terms
        (r"-\frac{1}{2} + x", r"x - \frac{1}{2}"),
        (r"\sin x", r"\sin{\left(x \right)}"),  # one term: sympy's LaTeX
        (r"\arcsin x", r"\arcsin{\left(x \right)}"),  # printed as the parser reads it (not \operatorname{asin})
        (r"I\sqrt{2}", r"\left(I\sqrt{2}\right)"),  # sympy's imaginary unit, printed i, would read back as a variable
        ("2E_1", r"\left(2E_1\right)"),  # the symbols clean makes (\mathcal{E}) print as nothing the parser reads
        (r"3\gamma", r"\left(3\gamma\right)"),
        ("x^2", "x^{2}"),
        ("mg", "g m"),  # read back without the unit filter, which would take the m for metres
        (r"\log_{2}(x)", r"\frac{\ln{\left(x \right)}}{\ln{\left(2 \right)}}"),
        (r"\binom{n}{2}", r"\left(\binom{n}{2}\right)"),  # its print reads back as a set: not taken
        (r"\overline{x}", r"\left(\overline{x}\right)"),
        ("e^{x}", r"\left(e^{x}\right)"),  # sympy prints it as written: parentheses
        (r"\text{north}", r"\textbf{NORTH}"),
        (r"\text{ north east }.", r"\textbf{NORTH EAST}"),  # the words alone, not the gold's full stop or dollars
        (r"$\text{east}$", r"\textbf{EAST}"),
        ("101_{2}", "(101)_{2}"),
    ],
)
def test_every_kind_of_gold_has_its_rewrite(gold, rewrite):
    assert audit.rewrite(gold) == rewrite


@pytest.mark.parametrize(
    ("gold", "misses"),
    [
        (r"12.5\%", [("last+1", r"13.5\%"), ("sign", r"-12.5\%")]),
        ("12345", [("last+1", "12346"), ("sign", "-12345")]),
        (r"\{1, 2\}", [("last+1", r"\{1, 3\}"), ("sign", r"\{1, -2\}")]),
        (r"(1, 2) \cup (3, 4)", [("last+1", r"(1, 2) \cup (3, 5)"), ("sign", r"-\left((1, 2) \cup (3, 4)\right)")]),
        (r"x \leq 3", [("last+1", r"x \leq 4"), ("sign", r"x \leq -3")]),
        ("-x + 2", [("last+1", "-x + 3"), ("sign", r"-\left(-x + 2\right)")]),
        (r"\sin x", [("sign", r"-\left(\sin x\right)")]),  # no number to change
        (r"\text{north}", []),
        ("101_{2}", [("base", "101_{3}"), ("base", "5"), ("last+1", "110_{2}")]),
        ("1E_{16}", [("base", "1E_{17}"), ("base", "30"), ("last+1", "1F_{16}")]),  # digits above 9 in capitals
        ("-5", [("last+1", "-6"), ("sign", "5")]),
        ("0", [("last+1", "1")]),  # -0 is 0: no sign near miss
        ("x = -3", [("last+1", "x = -4"), ("sign", "x = 3")]),
        ("-x", [("sign", "x")]),
        ("y = 2x", [("last+1", "y = 3x"), ("sign", r"y = -\left(2x\right)")]),
        ("(1, -2]", [("last+1", "(1, -3]"), ("sign", "(1, 2]")]),
        (".5", [("last+1", "1.5"), ("sign", "-.5")]),
        (r"-12\%", [("last+1", r"-13\%"), ("sign", r"12\%")]),
        (r"x \le 0", [("last+1", r"x \le 1")]),
        (r"\text{(E)}", [("letter", "A")]),  # the letters wrap around after E
        ("1, 2, 3", [("last+1", "1, 2, 4"), ("sign", "1, 2, -3")]),  # the last component of three
        ("(1, 2, 3)", [("last+1", "(1, 2, 4)"), ("sign", "(1, 2, -3)")]),
        ("1, 0", [("last+1", "1, 1")]),  # a last component of 0 has no sign to flip
        ("(1, 0)", [("last+1", "(1, 1)")]),
        ("x = 0", [("last+1", "x = 1")]),
        ("a = b = 3", [("last+1", "a = b = 4"), ("sign", r"-\left(a = b = 3\right)")]),  # a chain: all of it
        ("f(x) =", []),  # unreadable: no near miss can be told wrong
    ],
)
def test_near_misses_of_every_kind_of_gold(gold, misses):
    assert audit.near_misses(gold) == misses
