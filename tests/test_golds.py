"""Gold normalisation (dhpo_trl.golds): every rule on invented golds, idempotence, lists/tuples/numbers, the
hand-fix table and the report of golds that cannot be read."""

import json
from pathlib import Path

import pytest

from dhpo_trl import golds
from dhpo_trl._math_verify_core import clean, gold_form
from dhpo_trl.golds import HAND_FIXES, fingerprint, normalise_gold, unreadable_golds

FIXTURE = Path(__file__).parent / "fixtures" / "grader_golds.jsonl"
ROWS = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
# Test ids of printable ASCII without backslashes: pytest escapes explicit ids again in each session of one process,
# so mutmut (which collects, then runs, in one process) could not find ids holding `\frac` or a newline.
IDS = [
    "".join(c if " " <= c <= "~" and c != "\\" else " " for c in f"{row['rule']}:{row['gold']}")[:60] for row in ROWS
]


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_each_rule_rewrites_the_gold(row):
    assert normalise_gold(row["gold"], question=row["question"], unit=row["unit"]) == row["normalised"]


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_normalisation_is_idempotent_with_and_without_the_question(row):
    """The reward re-normalises golds without their question: that must not undo a load-time decision."""
    once = row["normalised"]
    assert normalise_gold(once, question=row["question"], unit=row["unit"]) == once
    assert normalise_gold(once) == once
    assert clean(clean(once)) == clean(once)


def test_without_a_question_equations_and_unit_letters_are_kept():
    assert normalise_gold("$K=3n+1$") == "K=3n+1"
    assert normalise_gold("$K=3n+1$", question="Find the largest $K$.") == "3n+1"
    assert normalise_gold("12 m") == "12 m"
    assert normalise_gold("12 m", question=r"A rope is $3 \mathrm{~m}$ long.") == "12"
    assert normalise_gold("12 m", question="In terms of $m$, how long is it?") == "12 m"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (["$1$", "", "  ", "$2$"], "1, 2"),  # one answer with components; blanks dropped
        (("3", 4), "3, 4"),  # a tuple means the same as a list
        (["", None], None),
        ([], None),
        (27.0, "27"),
        (2.5, "2.5"),
        (7, "7"),
        (float("nan"), None),
        (float("inf"), None),
        (True, None),
        (None, None),
        ("   ", None),
        ({"a": 1}, None),
    ],
)
def test_lists_tuples_numbers_and_blanks(raw, expected):
    assert normalise_gold(raw) == expected


def test_hand_fix_table_is_applied_by_fingerprint(monkeypatch):
    invented = "$k(1,2]$"  # a stray name before an interval, as one real gold has
    monkeypatch.setitem(HAND_FIXES, fingerprint(invented), ("(1,2]", "stray name"))
    assert normalise_gold(invented) == "(1,2]"
    assert normalise_gold("$k(1,3]$") == "k(1,3]"  # another text: no fix


def test_every_hand_fix_reads_as_mathematics_and_says_why():
    assert HAND_FIXES, "the documented fixes are gone"
    for key, (replacement, reason) in HAND_FIXES.items():
        assert len(key) == 16 and int(key, 16) >= 0
        assert gold_form(normalise_gold(replacement))[0] == "math", replacement
        assert len(reason) > 20


def test_unreadable_golds_are_reported():
    prose = r"all $x$ such that $x$ is a happy number, and nothing else"
    listed = unreadable_golds([normalise_gold(prose), "3", normalise_gold(r"\frac{1}{2}")])
    assert listed == [normalise_gold(prose)]
    assert golds.unreadable_golds([]) == []
