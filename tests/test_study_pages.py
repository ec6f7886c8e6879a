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
# The powered study's page (`bash benchmarks/power_study.sh OUT_DIR --report`), once written.
POWER = STUDY / "long_completions_power.json"
if POWER.exists():
    PAGES.append(("staleness", "long_completions_power.json", "long_completions_power.md"))


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
    if POWER.exists():
        pages.append((json.loads(POWER.read_text())["meta"]["commits"], "long_completions_power.md"))
    for commits, page in pages:
        assert commits and all(commit not in ("None", "") for commit in commits)
        assert f"at commit {', '.join(commits)}" in (STUDY / page).read_text()


def _study_warm_start_key():
    """The cache key of the long task's warm start as `LongSettings().load_task` builds it (nothing is trained)."""
    import dhpo_trl.demo.long_task as long_task

    keys = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(long_task, "load_or_warm_start", lambda warm, **kwargs: keys.append(warm.cache_key()) or (0, 0, 0))
        long_task.LongSettings().load_task()
    return keys[0]


@pytest.mark.skipif(not POWER.exists(), reason="the powered study's page is not written")
def test_the_powered_page_numbers_are_its_cells_and_its_warm_start_is_the_study_one():
    import numpy as np

    results = json.loads(POWER.read_text())
    meta, page = results["meta"], (STUDY / "long_completions_power.md").read_text()
    n = meta["final_heldout"]
    assert meta["warm_start_keys"] == [_study_warm_start_key()]  # no new warm start: the one the long study keys
    rows = {}
    for cell in results["cells"]:
        assert cell["final_heldout_problems"] == n == len(cell["final_heldout_correct"])
        assert cell["final_heldout_accuracy"] == cell["final_heldout_correct"].count("1") / n
        rows.setdefault((cell["objective"], cell["k"]), []).append(cell)
    for (objective, k), cells in rows.items():
        scores = np.array([[int(c) for c in cell["final_heldout_correct"]] for cell in cells])
        accuracy = scores.mean(axis=1)
        row = results["aggregate"][objective][str(k)]
        assert row["seeds"] == len(cells) and f"({len(cells)})" in page
        assert row["final_heldout_accuracy"][0] == pytest.approx(accuracy.mean(), abs=1e-12)
        if len(cells) < 2:
            continue
        std = accuracy.std(ddof=1)
        evaluation = np.sqrt(np.trace(np.cov(scores.T))) / n
        training = np.sqrt(max(0.0, std**2 - evaluation**2))
        assert f"{accuracy.mean():.1%} ± {std:.1%} ({len(cells)})" in page
        assert (f"| {objective} | {k} | {len(cells)} | {100 * std:.1f} | "
                f"{100 * np.sqrt(accuracy.mean() * (1 - accuracy.mean()) / n):.1f} | {100 * evaluation:.1f} | "
                f"{100 * training:.1f} |") in page  # fmt: skip
    for k in meta["ks"]:
        stds = sorted(r[str(k)]["final_heldout_accuracy"][1] for r in results["aggregate"].values()
                      if str(k) in r and r[str(k)]["seeds"] >= 2)  # fmt: skip
        if len(stds) >= 2:
            callable_ = "yes" if 2 * stds[-1] <= 0.03 else "for some pairs" if 2 * stds[1] <= 0.03 else "no"
            assert f"| {k} | {len(stds)} | {200 * stds[1]:.1f} | {200 * stds[-1]:.1f} | {callable_} |" in page
    done = len(results["cells"])
    assert (f"**Partial: {done} of {done + len(meta['missing'])} cells finished**" in page) == bool(meta["missing"])


@pytest.mark.skipif(not POWER.exists(), reason="the powered study's page is not written")
def test_the_powered_pages_difference_of_means_reading_is_its_cells():
    """The seeds a 3-point gap needs and the pairs called at twice the standard error of a difference of means,
    recomputed from each cell's 0/1 scores."""
    import itertools
    import math

    import numpy as np

    results = json.loads(POWER.read_text())
    page = (STUDY / "long_completions_power.md").read_text()
    order = list(results["aggregate"])  # the page's row order
    for k in results["meta"]["ks"]:
        rows = {}
        for objective in order:
            scores = [np.mean([int(c) for c in cell["final_heldout_correct"]]) for cell in results["cells"]
                      if cell["objective"] == objective and cell["k"] == k]  # fmt: skip
            if len(scores) >= 2:
                rows[objective] = (np.mean(scores), np.std(scores, ddof=1), len(scores))
        if len(rows) < 2:
            assert f"| {k} | " in page and f"- k = {k}: none" in page
            continue

        def need(pair):
            return max(2, math.ceil(4 * (rows[pair[0]][1] ** 2 + rows[pair[1]][1] ** 2) / 0.03**2))

        def named(pair):
            return f"{pair[0]}, {pair[1]} ({100 * rows[pair[0]][1]:.1f}, {100 * rows[pair[1]][1]:.1f})"

        pairs = list(itertools.combinations(rows, 2))
        low = min(pairs, key=lambda p: rows[p[0]][1] ** 2 + rows[p[1]][1] ** 2)
        high = max(pairs, key=lambda p: rows[p[0]][1] ** 2 + rows[p[1]][1] ** 2)
        seeds = sorted({n for _, _, n in rows.values()})
        shown = str(seeds[0]) if len(seeds) == 1 else f"{seeds[0]}–{seeds[-1]}"
        assert f"| {k} | {shown} | {named(low)} | {need(low)} | {named(high)} | {need(high)} |" in page
        called = []
        for a, b in itertools.permutations(rows, 2):
            (ma, sa, na), (mb, sb, nb) = rows[a], rows[b]
            if ma - mb > (bar := 2 * np.sqrt(sa**2 / na + sb**2 / nb)):
                called.append(f"{a} > {b} by {ma - mb:.1%} (2 SE = {bar:.1%})")
        assert f"- k = {k}: {'; '.join(called) or 'none'}\n" in page


def test_a_saved_run_is_reused_only_at_the_budget_asked(tmp_path):
    """`study.py` reuses a finished run's summary; one that ran another number of optimizer steps is refused, naming
    its folder, instead of entering the table beside runs of the asked budget."""
    study = _load("study")
    run_dir = tmp_path / "dhpo-seed3"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"algorithm": "dhpo", "seed": 3, "optimizer_steps": 25}))
    assert study._run_one(("dhpo", 3, tmp_path, None))["optimizer_steps"] == 25
    assert study._run_one(("dhpo", 3, tmp_path, 25))["seed"] == 3
    with pytest.raises(SystemExit, match="dhpo-seed3"):
        study._run_one(("dhpo", 3, tmp_path, 32))


def test_a_saved_run_of_another_budget_is_refused_before_anything_trains(tmp_path, monkeypatch):
    """`study.py` checks every saved run's budget in its own process at start: a worker that raised it in a cell would
    end the study as a dead worker, after the warm start and other cells had run."""
    study = _load("study")
    run_dir = tmp_path / "GRPO-seed3"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"algorithm": "GRPO", "seed": 3, "optimizer_steps": 25}))
    monkeypatch.setattr(study, "run_embedded", lambda *args, **kwargs: pytest.fail("trained despite a stale run"))
    monkeypatch.setattr(study, "cell_pool", lambda workers: pytest.fail("started workers despite a stale run"))
    with pytest.raises(SystemExit, match="GRPO-seed3"):
        study.main(["--algorithms", "GRPO", "--seeds", "3", "--max-steps", "32", "--out-dir", str(tmp_path),
                    "--docs-dir", str(tmp_path / "docs")])  # fmt: skip


def test_the_studys_cells_taken_as_they_finish_are_put_back_in_plan_order():
    """`study.in_plan_order`: the pool yields the cells as they finish (`imap_unordered`); each row of the page is
    the summary of its own job (objective and seed), in the order of the jobs, however they finished."""
    study = _load("study")
    jobs = [(algorithm, seed, Path("out"), 4) for seed in (0, 1) for algorithm in ("GRPO", "DHPO-A")]
    summaries = [{"algorithm": algorithm, "seed": seed, "heldout_accuracy_after": seed + 0.1 * len(algorithm)}
                 for algorithm, seed, _, _ in jobs]  # fmt: skip
    for finished in (summaries[::-1], summaries[1::2] + summaries[::2]):
        ordered = study.in_plan_order(jobs, iter(finished))
        assert [(row["algorithm"], row["seed"]) for row in ordered] == [job[:2] for job in jobs]
        expected = [seed + 0.1 * len(name) for name, seed, *_ in jobs]
        assert [row["heldout_accuracy_after"] for row in ordered] == expected


@pytest.mark.parametrize("argv, flag", [(["--seeds", "0", "1", "0"], "--seeds"),
                                        (["--algorithms", "GRPO", "GSPO", "GRPO"], "--algorithms"),
                                        (["--seeds", "0", "-1"], "argument --seeds")])  # fmt: skip
def test_a_repeated_seed_or_objective_is_refused_before_anything_trains(tmp_path, monkeypatch, capsys, argv, flag):
    """A repeated cell would train twice into one folder and count twice in the averages; a seed numpy cannot take
    would stop the first cell after the warm start."""
    study = _load("study")
    monkeypatch.setattr(study, "run_embedded", lambda *args, **kwargs: pytest.fail("trained despite a repeat"))
    with pytest.raises(SystemExit) as exited:
        study.main([*argv, "--out-dir", str(tmp_path), "--docs-dir", str(tmp_path / "docs")])
    assert exited.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].split(": ")[2] == flag
