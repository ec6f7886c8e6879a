"""The README's configuration table is `DHPOConfig`: every field DHPO adds to TRL's `GRPOConfig` has a row, and every
row's default is the dataclass default; the tables of the paper's seven rows name and set each row as its preset
does. The docs state what is, not how it came to be: no issue or round numbers. Every relative link, `#anchor` and
named repository path and test resolves; objectives.md names exactly the loss metrics the objectives log; testing.md's
planted-bug table names bugs the script plants."""

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


# ------------------------------------------------------------------ links, anchors and paths
LINKED = [*PAGES, *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*/*.md")),
          *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("examples/**/README.md")), "CHANGELOG.md"]  # fmt: skip
# A path a page names that is not this repository's: TRL's own test file, of which tests/test_trl_grpo_trainer.py
# is the adaptation.
OTHER_REPOSITORIES = {"tests/test_grpo_trainer.py"}


def prose(text):
    """The text outside fenced code blocks (a `#` there is a shell comment, `[a](b)` is code)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def slug(heading):
    """GitHub's anchor of a heading: lower case, markup and punctuation other than `-` and `_` dropped, each space
    a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.replace("`", "").strip().lower()).replace(" ", "-")


def anchors(text):
    """Every anchor of a page: each heading's slug, a repeated one suffixed -1, -2, ... as GitHub does."""
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", prose(text), flags=re.MULTILINE):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page, text):
    """The relative links of `text` (as the page `page`) whose file or `#anchor` does not exist."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(text)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (ROOT / page).parent / path if path else ROOT / page
        if not linked.exists():
            broken.append(f"{target} (no file)")
        elif anchor and linked.suffix == ".md":
            own = text if not path else linked.read_text(encoding="utf-8")
            if anchor not in anchors(own):
                broken.append(f"{target} (no heading)")
    return broken


def missing_paths(text):
    """The repository paths named in code spans (`dhpo_trl/...`, `tests/...`, ...) that do not exist; a span with a
    placeholder (`DATE-DEVICE/runN.json`, `<module>`) is a pattern, not a path."""
    missing = []
    roots = "dhpo_trl|tests|scripts|benchmarks|examples|docs|accelerate_configs"
    for span in re.findall(rf"`((?:{roots})/[^`\s]*)`", prose(text)):
        path = span.split("::")[0].split("#")[0].rstrip(".,;:")
        placeholder = re.search(r"[<>*{}$]|[A-Z]{3,}", re.sub(r"\b(?:README|CHANGELOG)\.md$", "", path))
        if placeholder or path in OTHER_REPOSITORIES:
            continue
        if not (ROOT / path).exists():
            missing.append(path)
    return missing


def missing_tests(text):
    """The tests named in code spans (`tests/test_x.py::test_y`, `test_x.py::test_y[param]`) that their file does not
    define."""
    missing = []
    for file, name in re.findall(r"`(?:tests/)?(test_\w+\.py)::(\w+)", prose(text)):
        source = ROOT / "tests" / file
        if not source.exists() or not re.search(rf"^\s*(?:async )?(?:def|class) {name}\b", source.read_text(), re.M):
            missing.append(f"{file}::{name}")
    return missing


@pytest.mark.parametrize("page", LINKED)
def test_every_relative_link_and_anchor_resolves(page):
    broken = broken_links(page, (ROOT / page).read_text(encoding="utf-8"))
    assert not broken, f"{page}: broken links {broken}"


@pytest.mark.parametrize("page", [p for p in LINKED if p != "CHANGELOG.md"])  # the changelog names past files
def test_every_named_repository_path_exists(page):
    text = (ROOT / page).read_text(encoding="utf-8")
    missing = missing_paths(text)
    assert not missing, f"{page}: names files that do not exist: {missing}"
    missing = missing_tests(text)
    assert not missing, f"{page}: names tests that do not exist: {missing}"


def test_the_link_checker_sees_a_missing_file_a_missing_heading_and_a_missing_path():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert not broken_links("README.md", readme)
    planted = readme.replace("(docs/objectives.md#trl-fields-per-row)", "(docs/objectives.md#trl-field-per-row)")
    assert broken_links("README.md", planted) == ["docs/objectives.md#trl-field-per-row (no heading)"]
    planted = readme.replace("(docs/resume.md)", "(docs/resuming.md)", 1)
    assert broken_links("README.md", planted) == ["docs/resuming.md (no file)"]
    planted = readme.replace("(#the-papers-seven-rows)", "(#the-paper-seven-rows)")
    assert broken_links("README.md", planted) == ["#the-paper-seven-rows (no heading)"]
    assert missing_paths(readme.replace("`tests/test_trainer.py`", "`tests/test_trainers.py`", 1)) == [
        "tests/test_trainers.py"]
    testing = (ROOT / "docs/testing.md").read_text(encoding="utf-8")
    assert not missing_tests(testing)
    renamed = testing.replace("::test_an_older_deepspeed_checkpoint_is_resumable", "::test_an_old_checkpoint", 1)
    assert missing_tests(renamed) == ["test_resume.py::test_an_old_checkpoint"]
    # a README is a file name, not a placeholder such as DATE-DEVICE
    assert missing_paths("`examples/recipe/README.md`, `docs/gpu_runs/DATE-DEVICE/runN.json`") == [
        "examples/recipe/README.md"]
    # GitHub's slugs: punctuation dropped, code marks dropped, a repeated heading numbered
    assert anchors("## TRL's own objectives\n## `torch.compile`\n## Memory: 8 × 80 GB\n## Memory: 8 × 80 GB\n") == {
        "trls-own-objectives", "torchcompile", "memory-8--80-gb", "memory-8--80-gb-1"}


# ------------------------------------------------------------------ testing.md's planted bugs
def planted_bug_ids(testing):
    """The bug ids of testing.md's table of planted bugs (`| class | bug (file) | caught by |`), its first column's
    code spans."""
    table = testing.split("| class | bug (file) | caught by |\n", 1)[1].split("\n\n", 1)[0]
    cells = [line.strip("|").split("|") for line in table.splitlines()[1:]]
    return {name for row in cells for name in re.findall(r"`([a-z0-9]+(?:-[a-z0-9]+)+)`", row[1])}


def planted_bugs_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("planted_bugs_under_test", ROOT / "scripts/planted_bugs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_bugs():
    return planted_bugs_script().BUGS


def test_every_planted_bug_finds_the_code_it_changes():
    """Each bug's anchor is found exactly once where the script plants it (`locate`): a refactor that rewrites the
    anchored code leaves a bug the script cannot plant, and `--only ID` would report it, not run it."""
    script = planted_bugs_script()
    lost = [bug for bug, (path, anchor, *_) in script.BUGS.items() if script.locate(ROOT, path, anchor) is None]
    assert not lost, f"scripts/planted_bugs.py: anchors not found once in their files: {lost}"


def test_every_bug_of_the_testing_table_is_one_the_script_plants():
    """`python scripts/planted_bugs.py --only ID` runs each bug the table names, every bug of the script is in the
    table (the R3 bugs: counted after it), and the count it states is the script's."""
    testing = (ROOT / "docs/testing.md").read_text(encoding="utf-8")
    named, bugs = planted_bug_ids(testing), script_bugs()
    assert len(named) > 100
    assert named <= set(bugs), f"named in docs/testing.md's table, not in scripts/planted_bugs.py: {named - set(bugs)}"
    # the R3 bugs are described after the table, by their count
    rollout = {bug for bug in bugs if bug.startswith("rollout-")} - named
    unnamed = sorted(set(bugs) - named - rollout)
    assert not unnamed, f"in scripts/planted_bugs.py, not in docs/testing.md's table: {unnamed}"
    r3 = re.search(r"The R3 bugs \(`rollout-\*`[^)]*\), (\d+)/(\d+) caught", testing)
    assert r3 and int(r3.group(1)) == int(r3.group(2)) == len(rollout), "docs/testing.md's count of the R3 bugs"
    stated = re.search(r"The script holds (\d+) bugs \(`len\(BUGS\)`\)", testing)
    assert stated and int(stated.group(1)) == len(bugs), "docs/testing.md's count of the script's bugs"


def test_the_bug_table_reader_sees_an_unknown_bug():
    testing = (ROOT / "docs/testing.md").read_text(encoding="utf-8")
    planted = testing.replace("`tool-mask-dropped` (batching)", "`tool-mask-forgotten` (batching)")
    assert "tool-mask-forgotten" in planted_bug_ids(planted) - set(script_bugs())


# ------------------------------------------------------------------ objectives.md's logged metrics
# logged from the trainer's own sums or by TRL, not by an objective's loss metrics: each must be a key the package
# writes (a string literal of dhpo_trl)
OTHER_LOGGERS = ("batching/", "reward/", "entropy_coef")


def documented_metrics(objectives):
    """Regexes of the metric names under objectives.md's `## Logged metrics` (`a/{b,c}` and `a/*` expanded)."""
    section = objectives.split("\n## Logged metrics\n", 1)[1].split("\n## ", 1)[0]
    names = [span for span in re.findall(r"`([^`]+)`", section)
             if re.fullmatch(r"[a-z_]+(?:/[a-z_{},*]+)+|entropy|kl|cispo_clip_ratio|policy_loss|aux_loss|entropy_coef",
                             span)]  # fmt: skip
    patterns = {}
    for name in names:
        pattern = re.sub(r"\{([^}]*)\}", lambda m: "(?:" + "|".join(m.group(1).split(",")) + ")", name)
        patterns[name] = re.compile(pattern.replace("*", "[a-z_]+"))
    return patterns


def as_floats(sums, maxima):
    """One process's reduction: the sums and maxima as they are."""
    return {k: float(v) for k, v in sums.items()}, {k: float(v) for k, v in maxima.items()}


def logged_loss_metric_names():
    """Every name `metrics.logged_loss_metrics` logs for some objective, from each objective's own loss on a batch
    with off-policy ratios, both advantage signs and a KL term (DHPO with `delta`, so its dual clip logs too), with
    the sums the trainer adds: the policy loss, an MoE aux loss and routing replay's counts."""
    import torch

    from dhpo_trl.core import metrics
    from dhpo_trl.core.losses import masked_log_ratio
    from dhpo_trl.core.objectives import OBJECTIVES

    torch.manual_seed(0)
    logps = -torch.rand(4, 6) * 3
    old, mask, entropies = logps + 0.3 * torch.randn(4, 6), torch.ones(4, 6), torch.rand(4, 6)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    trainer_sums = {**metrics.nan_mean_sums("policy_loss", torch.tensor(0.5)),
                    **metrics.nan_mean_sums("aux_loss", torch.tensor(0.1)),
                    "moe_decisions": torch.tensor(8.0), "moe_flipped": torch.tensor(2.0),
                    "moe_replayed": torch.tensor(8.0)}  # fmt: skip
    names = set()
    for algorithm, objective in OBJECTIVES.items():
        extra = {"delta": 3.0} if algorithm == "dhpo" else {}
        args = DHPOConfig(output_dir="unused", algorithm=algorithm, use_cpu=True, bf16=False, report_to="none",
                          **extra)  # fmt: skip
        _, _, info = objective.compute(logps, old, advantages, mask, entropies, args, None)
        log_ratio = masked_log_ratio(logps, old, mask)  # as the trainer adds it for every row
        info = {**info, "abs_log_ratio": log_ratio.abs(), "log_ratio": log_ratio}
        logged = metrics.logged_loss_metrics(objective, info, entropies, mask, torch.zeros(4, 6), trainer_sums, {},
                                                 as_floats)  # fmt: skip
        names |= set(logged)
    return names


def test_objectives_md_names_every_loss_metric_and_no_other():
    documented = documented_metrics((ROOT / "docs/objectives.md").read_text(encoding="utf-8"))
    logged = logged_loss_metric_names()
    undocumented = sorted(n for n in logged if not any(p.fullmatch(n) for p in documented.values()))
    assert not undocumented, f"logged but not in docs/objectives.md's Logged metrics: {undocumented}"
    unlogged = sorted(d for d, p in documented.items()
                      if not d.startswith(OTHER_LOGGERS) and not any(p.fullmatch(n) for n in logged))  # fmt: skip
    assert not unlogged, f"in docs/objectives.md's Logged metrics, logged by no objective: {unlogged}"
    source = "".join(path.read_text(encoding="utf-8") for path in (ROOT / "dhpo_trl").rglob("*.py"))
    unknown = sorted(d for d in documented if d.startswith(OTHER_LOGGERS) and f'"{d}"' not in source)
    assert not unknown, f"in docs/objectives.md's Logged metrics, a key dhpo_trl never logs: {unknown}"


def test_the_metric_reader_sees_a_renamed_metric():
    objectives = (ROOT / "docs/objectives.md").read_text(encoding="utf-8")
    documented = documented_metrics(objectives.replace("`dhpo/clipped_term_fraction`", "`dhpo/clipped_fraction`"))
    assert not any(p.fullmatch("dhpo/clipped_term_fraction") for p in documented.values())
    assert documented["dhpo/mixing_weight/{mean,std}"].fullmatch("dhpo/mixing_weight/std")


# ------------------------------------------------------------------ testing.md's commands run what they say
def stand_in_environment(tmp_path):
    """Variables under which `bash scripts/test.sh` finds an installed environment whose `python` prints its
    arguments, one a line (`DHPO_VENV`: the script's setup installs nothing)."""
    import os

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text('PATH="$VIRTUAL_ENV_BIN:$PATH"\n')
    python = venv / "bin" / "python"
    python.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    python.chmod(0o755)
    (venv / ".dhpo-installed").touch()
    os.utime(venv / ".dhpo-installed", (2**31, 2**31))  # newer than pyproject.toml
    return {**os.environ, "DHPO_VENV": str(venv), "VIRTUAL_ENV_BIN": str(venv / "bin")}


def pytest_arguments(env, *args):
    """The pytest arguments `bash scripts/test.sh ARGS` runs, after its fixed options."""
    import subprocess

    out = subprocess.run(["bash", "scripts/test.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True, timeout=60)  # fmt: skip
    printed = out.stdout.splitlines()
    return printed[printed.index("--no-loadscope-reorder") + 1 :]


def test_test_sh_runs_the_named_file_only_and_the_whole_suite_otherwise(tmp_path):
    """docs/testing.md's `bash scripts/test.sh tests/test_losses.py -k entropy` runs that file's tests, not every
    test of the suite that matches `-k`."""
    env = stand_in_environment(tmp_path)
    one_file = ["tests/test_losses.py", "-k", "entropy"]
    assert pytest_arguments(env, *one_file) == one_file
    one_test = "tests/test_docs.py::test_the_seven_rows_reader_sees_a_wrong_setting"
    assert pytest_arguments(env, one_test) == [one_test]
    assert pytest_arguments(env, "-m", "pure") == ["tests", "-m", "pure"]
    assert pytest_arguments(env) == ["tests"]
    # a path that does not exist is pytest's error ("file or directory not found"), not a silent whole suite
    assert pytest_arguments(env, "tests/test_nonexistent.py") == ["tests", "tests/test_nonexistent.py"]


def test_test_sh_runs_the_whole_suite_when_an_option_value_is_a_path(tmp_path):
    """`-k tests` or `--basetemp DIR` names no test: no path reaches pytest, which then runs its testpaths, the
    suite."""
    import tomllib

    env = stand_in_environment(tmp_path)
    assert pytest_arguments(env, "-k", "tests") == ["-k", "tests"]
    assert pytest_arguments(env, "--basetemp", str(tmp_path), "-x") == ["--basetemp", str(tmp_path), "-x"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["tool"]["pytest"]["ini_options"]["testpaths"] == ["tests"]


# ------------------------------------------------------------------ the README's Python runs
def python_blocks(page):
    return re.findall(r"^```python\n(.*?)^```", page, flags=re.DOTALL | re.MULTILINE)


def test_the_readme_python_api_runs_as_printed(monkeypatch, tmp_path):
    """The config of the README's example is valid and off-policy as its comment says (the trainer, which would
    download the model, is a stand-in that records what it gets); the loss example runs on tensors of its names."""
    import functools

    import torch

    import dhpo_trl

    built = {}

    class Trainer:
        def __init__(self, **kwargs):
            built.update(kwargs)

        def train(self):
            built["trained"] = True

    monkeypatch.setattr(dhpo_trl, "DHPOTrainer", Trainer)
    # the example is written for a GPU (bf16): here the same settings on the CPU
    monkeypatch.setattr(dhpo_trl, "DHPOConfig", functools.partial(DHPOConfig, use_cpu=True, bf16=False))
    monkeypatch.chdir(tmp_path)
    trainer_block, loss_block = python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    exec(trainer_block, {})
    args = built["args"]
    assert built["trained"] and isinstance(args, DHPOConfig)
    assert args.steps_per_generation == 2 * args.gradient_accumulation_steps  # "2 optimizer steps per generation"
    torch.manual_seed(0)
    logps = -torch.rand(3, 5)
    names = {"logps": logps, "old_logps": logps + 0.1 * torch.randn(3, 5), "mask": torch.ones(3, 5),
             "advantages": torch.tensor([1.0, -1.0, 0.5]), "entropies": torch.rand(3, 5)}  # fmt: skip
    exec(loss_block, names)
    assert names["loss"].shape == () and torch.isfinite(names["loss"])


# ------------------------------------------------------------------ architecture.md's layer table
def layer_table_modules(architecture):
    """{package: the module names its row of architecture.md's layer table mentions (`name` or `name.attr`)}."""
    section = architecture.split("| layer | package | what it holds |\n", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in section.splitlines()[1:]:
        _, package, holds = [cell.strip() for cell in line.strip("|").split("|")]
        rows[package.strip("`/")] = {span.split(".")[0] for span in re.findall(r"`([\w.]+)`", holds)}
    return rows


@pytest.mark.parametrize("package", ["core", "scoring", "training"])
def test_the_architecture_layer_table_names_every_module(package):
    rows = layer_table_modules((ROOT / "docs/architecture.md").read_text(encoding="utf-8"))
    modules = {path.stem for path in (ROOT / "dhpo_trl" / package).glob("*.py") if path.stem != "__init__"}
    assert modules <= rows[package], f"docs/architecture.md's {package}/ row misses {sorted(modules - rows[package])}"
