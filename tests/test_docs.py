"""The README's configuration table is `DHPOConfig`: every field DHPO adds to TRL's `GRPOConfig` has a row, and every
row's default is the dataclass default; the tables of the paper's seven rows name and set each row as its preset
does. The docs state what is, not how it came to be: no issue or round numbers."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from trl import GRPOConfig

from dhpo_trl import DHPOConfig

ROOT = Path(__file__).resolve().parents[1]


def config_table(readme):
    """{field: default} of the table under `## Configuration` (a row may name two fields: `a` / `b` | `x` / `y`)."""
    section = readme.split("\n## Configuration\n", 1)[1]
    table = section.split("| field | default | meaning |\n", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`(\w+)`", cells[0])
        defaults = [ast.literal_eval(value) for value in re.findall(r"`([^`]+)`", cells[1])]
        assert len(names) == len(defaults), line
        rows.update(zip(names, defaults, strict=True))
    return rows


def dhpo_defaults():
    return {field.name: field.default for field in dataclasses.fields(DHPOConfig)}


def test_the_readme_config_table_is_dhpoconfig():
    table = config_table((ROOT / "README.md").read_text(encoding="utf-8"))
    defaults = dhpo_defaults()
    added = set(defaults) - {field.name for field in dataclasses.fields(GRPOConfig)}
    assert added <= set(table), f"DHPOConfig fields missing from the README's table: {sorted(added - set(table))}"
    for name, documented in table.items():
        assert name in defaults, f"the README documents {name}, which DHPOConfig does not have"
        assert documented == defaults[name] and type(documented) is type(defaults[name]), name


def test_the_table_reader_sees_a_missing_row_and_a_wrong_default():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| `share_prompts` |"))
    assert "share_prompts" not in config_table(readme.replace(row + "\n", ""))
    edited = readme.replace("| `token_weight` | `0.5` |", "| `token_weight` | `0.25` |")
    assert config_table(edited)["token_weight"] == 0.25


HISTORY = re.compile(r"\b(?:issue|round) #?\d+\b", re.IGNORECASE)
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md"))]


@pytest.mark.parametrize("page", PAGES)
def test_the_docs_carry_no_issue_or_round_numbers(page):
    found = [line for line in (ROOT / page).read_text(encoding="utf-8").splitlines() if HISTORY.search(line)]
    assert not found, f"{page}: history belongs in git and CHANGELOG.md: {found[:3]}"


def seven_rows(page):
    """{row name: {setting: value}} of a page's table of the paper's seven rows (header `| row | config | ...`): the
    `DHPOConfig` settings `name=value` in its config and clip columns (`a=b=0.4` names two; VERL's names are not
    fields)."""
    section = page.split("| row | config |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in section.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        settings = {}
        for code in re.findall(r"`([^`]+)`", " ".join(cells[1:3])):
            for assignment in code.split(", "):
                *names, value = assignment.split("=")
                if names and all(name in dhpo_defaults() for name in names):
                    settings.update(dict.fromkeys(names, ast.literal_eval(value)))
        rows[cells[0]] = settings
    return rows


@pytest.mark.parametrize("page", ["README.md", "docs/objectives.md"])
def test_the_seven_rows_tables_are_the_presets(page):
    """Each row is named as `PAPER_ALGORITHMS` (and `--algorithm`) names it; every setting it shows is the preset's."""
    from dhpo_trl.core.presets import PAPER_ALGORITHMS

    rows = seven_rows((ROOT / page).read_text(encoding="utf-8"))
    assert [name.split(" (")[0] for name in rows] == list(PAPER_ALGORITHMS)
    for name, settings in rows.items():
        preset = PAPER_ALGORITHMS[name.split(" (")[0]]
        assert settings and {key: preset.get(key, dhpo_defaults()[key]) for key in settings} == settings, name


def test_the_seven_rows_reader_sees_a_wrong_setting():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    edited = readme.replace("`epsilon=3e-4, epsilon_high=4e-4`", "`epsilon=3e-4, epsilon_high=5e-4`")
    assert seven_rows(edited)["GSPO"] == {"algorithm": "gspo", "epsilon": 3e-4, "epsilon_high": 5e-4}
