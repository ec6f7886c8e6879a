"""Every figure on the two study pages is the saved JSON's: each page equals the page its script writes from its JSON.

A number edited by hand on a page (or a JSON regenerated without its page) fails here. The scripts write each page
from the JSON they have just saved (`page_from_json`), so a rerun of the study keeps this test green.
"""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
STUDY = ROOT / "docs" / "study"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PAGES = [("staleness", "staleness.json", "staleness.md"), ("study", "results.json", "README.md")]
# The long-completion study's page, once written (`python benchmarks/staleness.py --task long ... [--report-only]`).
if (STUDY / "long_completions.json").exists():
    PAGES.append(("staleness", "long_completions.json", "long_completions.md"))


@pytest.mark.parametrize(("script", "data", "page"), PAGES)
def test_the_page_is_the_one_its_json_writes(script, data, page):
    written = _load(script).page_from_json(json.loads((STUDY / data).read_text()))
    assert (STUDY / page).read_text() == written


@pytest.mark.parametrize(("script", "data", "page"), PAGES)
def test_a_number_edited_on_the_page_or_in_the_json_is_caught(script, data, page):
    results = json.loads((STUDY / data).read_text())
    text = (STUDY / page).read_text()
    # one cell of the first table: its mean moved by a tenth of a point
    edited_page = text.replace("%", "1%", 1)
    assert edited_page != text and edited_page != _load(script).page_from_json(results)
    first = next(iter(results["aggregate"].values()))
    row = first if "final_accuracy" in first else next(iter(first.values()))
    row["final_accuracy"][0] += 0.001
    assert _load(script).page_from_json(results) != text


def test_the_pages_state_the_commit_and_machine_their_json_records():
    staleness = json.loads((STUDY / "staleness.json").read_text())
    study = json.loads((STUDY / "results.json").read_text())
    pages = [(staleness["meta"]["commits"], "staleness.md"), (study["commits"], "README.md")]
    if (STUDY / "long_completions.json").exists():
        long_meta = json.loads((STUDY / "long_completions.json").read_text())["meta"]
        pages.append((long_meta["commits"], "long_completions.md"))
    for commits, page in pages:
        assert commits and all(commit not in ("None", "") for commit in commits)
        assert f"at commit {', '.join(commits)}" in (STUDY / page).read_text()
