"""The staleness study's measures, aggregation, verdict and resume (benchmarks/staleness.py), on hand-made logs."""

import dataclasses
import importlib.util
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from dhpo_trl.demo.embedded import EmbeddedSettings, TrainingStopped, memoized_reward
from dhpo_trl.demo.long_task import LongSettings

SPEC = importlib.util.spec_from_file_location("staleness", Path(__file__).parents[1] / "benchmarks" / "staleness.py")
staleness = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(staleness)


def step(n, entropy, log_ratio, **extra):
    return {"step": n, "loss": 0.1, "entropy": entropy, "off_policy/abs_log_ratio": log_ratio, **extra}


def history(k=2):
    """Four optimizer steps (two generation batches of k = 2) and evaluations at steps 0, 2 and 4."""
    return [
        {"step": 0, "eval/heldout_accuracy": 0.2},
        step(1, 1.0, 0.01, **{"dhpo/clip_fraction/token_low": 0.1, "clip_ratio/low_mean": 0.9,
                              "dhpo/mixing_weight/mean": 0.4, "dhpo/mixing_weight/std": 0.2}),  # fmt: skip
        step(2, 0.8, 0.05, **{"dhpo/clip_fraction/token_low": 0.3, "clip_ratio/low_mean": 0.9,
                              "dhpo/mixing_weight/mean": 0.6, "dhpo/mixing_weight/std": 0.1}),  # fmt: skip
        {"step": 2, "eval/heldout_accuracy": 0.6},
        step(3, 0.4, 0.02, **{"dhpo/clip_fraction/token_low": math.nan}),
        step(4, 0.2, 0.09),
        {"step": 4, "eval/heldout_accuracy": 0.4},
    ]


def test_cell_metrics_follow_their_definitions():
    cell = staleness.cell_metrics(history(), k=2)
    assert cell["final_accuracy"] == 0.4 and cell["peak_accuracy"] == 0.6
    # trapezoids: (0.2 + 0.6) / 2 * 2 + (0.6 + 0.4) / 2 * 2 = 1.8 over 4 steps
    assert cell["auc"] == pytest.approx(0.45)
    assert cell["end_entropy"] == 0.2  # last tenth of 4 steps = the last step
    assert cell["collapsed"] is True  # 0.2 < 25% of the first step's 1.0
    # only the last step of each generation batch (steps 2 and 4), not the fresher steps 1 and 3
    assert cell["last_step_abs_log_ratio"] == pytest.approx((0.05 + 0.09) / 2)
    # DHPO's per-branch metric wins over TRL's clip_ratio; NaN (no valid token) is skipped
    assert cell["clip"]["token low"] == pytest.approx(0.2)
    assert cell["clip"]["sequence high"] is None
    assert cell["mixing_weight_mean"] == pytest.approx(0.5) and cell["mixing_weight_std"] == pytest.approx(0.15)
    assert cell["curve"] == [(0, 0.2), (2, 0.6), (4, 0.4)]


def test_entropy_that_holds_is_not_collapse_and_rows_without_dhpo_metrics_report_none():
    log = [e if "loss" not in e else {**e, "entropy": 1.0} for e in history()]
    log = [{k: v for k, v in e.items() if not k.startswith("dhpo/")} for e in log]
    cell = staleness.cell_metrics(log, k=2)
    assert cell["collapsed"] is False
    assert cell["clip"]["token low"] == pytest.approx(0.9)  # GRPO-style rows: TRL's clip_ratio
    assert cell["mixing_weight_mean"] is None


def cells_for(finals):
    """{(objective, k, seed): cell} with the given final accuracies per (objective, k)."""
    cells = {}
    for (objective, k), values in finals.items():
        for seed, value in enumerate(values):
            cell = staleness.cell_metrics(history(), k=2)
            cells[objective, k, seed] = {**cell, "final_accuracy": value, "collapsed": seed == 0}
    return cells


def test_aggregate_gives_mean_and_sample_std_over_seeds():
    table = staleness.aggregate(cells_for({("GRPO", 2): [0.2, 0.4, 0.6], ("DHPO-A", 2): [0.5, 0.5, 0.5]}))
    assert table["GRPO"][2]["final_accuracy"] == pytest.approx([0.4, 0.2])
    assert table["DHPO-A"][2]["final_accuracy"] == pytest.approx([0.5, 0.0])
    assert table["GRPO"][2]["seeds"] == 3 and table["GRPO"][2]["collapsed"] == 1
    assert table["GRPO"][2]["mixing_weight_mean"] == pytest.approx([0.5, 0.0])


def test_separation_needs_a_gap_above_twice_the_larger_seed_std():
    finals = {("GRPO", 2): [0.30, 0.32, 0.34], ("GSPO", 2): [0.40, 0.42, 0.44],  # gap 0.10 > 2 x 0.02
              ("GRPO", 16): [0.30, 0.40, 0.50], ("GSPO", 16): [0.40, 0.42, 0.44]}  # gap 0.02 < 2 x 0.10  # fmt: skip
    table = staleness.aggregate(cells_for(finals))
    found = staleness.separations(table)
    assert [(a, b) for a, b, _, _ in found[2]] == [("GSPO", "GRPO")]
    assert found[2][0][2] == pytest.approx(0.10) and found[2][0][3] == pytest.approx(0.04)
    assert found[16] == []
    text = staleness.verdict(table)
    assert "GSPO > GRPO by 10.0% (2 std = 4.0%)" in text
    assert "at k = 16 they span 2.0% and no pair differs" in text
    assert text.count("pair by pair") == 2  # final accuracy, then the area under the curve
    assert staleness.first_fall(table) == {"GRPO": 2, "GSPO": None}
    assert staleness.summary(table).startswith(
        "On final accuracy, no objective is behind another by more than twice the seed noise at k = 16; GSPO stays"
    )
    assert "falling behind: GRPO from k = 2." in staleness.summary(table)
    everywhere = staleness.aggregate(cells_for({("GRPO", 2): [0.3, 0.32, 0.34], ("GSPO", 2): [0.4, 0.42, 0.44]}))
    assert staleness.summary(everywhere).startswith(
        "On final accuracy, some objective is behind another by more than twice the seed noise at every k; GSPO stays"
    )
    page = staleness.markdown(table, dict(parameters=1, max_completion_length=12, learning_rate=2e-4,
                                          generation_batches=24, num_heldout=200, eval_every=4, seeds=3,
                                          machine="test", cell_minutes=1.0, command="python x",
                                          commits=["abc1234"]))  # fmt: skip
    assert "| GSPO | 42.0% ± 2.0% | 42.0% ± 2.0% |" in page
    assert "at commit abc1234" in page


def test_the_difference_of_means_reading_uses_each_rows_variance_and_seeds():
    # 2 sqrt(0.03^2 / 3 + 0.04^2 / 12) = 2 sqrt(0.0003 + 0.000133...) = 0.0416333
    assert staleness.mean_gap_threshold(0.03, 3, 0.04, 12) == pytest.approx(0.04163332, abs=1e-8)
    assert staleness.seeds_to_call(0.03, 0.03) == 8  # 8 s^2 / g^2 = 8 exactly: not pushed to 9 by float error
    assert staleness.seeds_to_call(0.04, 0.03) == 12  # 4 (0.0016 + 0.0009) / 0.0009 = 11.1
    assert staleness.seeds_to_call(0.01, 0.02, gap=0.03) == 3  # 4 (0.0001 + 0.0004) / 0.0009 = 2.2
    assert staleness.seeds_to_call(0.0, 0.0) == 2  # no noise still needs two seeds to have a std
    row = lambda mean, std, seeds: {"seeds": seeds, "final_heldout_accuracy": [mean, std]}  # noqa: E731
    # A: 3 seeds, B: 12 seeds, C: 3 seeds; D has one seed, no std, and stays out although its mean is the best
    table = {"A": {4: row(0.40, 0.01, 3), 16: row(0.5, 0.02, 3)}, "B": {4: row(0.34, 0.02, 12)},
             "C": {4: row(0.30, 0.04, 3), 16: row(0.9, 0.0, 1)}, "D": {4: row(0.90, 0.0, 1)}}  # fmt: skip
    need = staleness.seeds_for_gap(table, [4, 16])
    # smallest stds A, B: 4 (0.0001 + 0.0004) / 0.0009 = 2.2 -> 3;
    # largest B, C: 4 (0.0004 + 0.0016) / 0.0009 = 8.9 -> 9
    assert need[0] == {"k": 4, "seeds": [3, 12], "smallest_pair": ("A", "B"), "smallest": 3,
                       "largest_pair": ("B", "C"), "largest": 9}  # fmt: skip
    assert need[1] == {"k": 16, "seeds": [3], "smallest_pair": None, "smallest": None, "largest_pair": None,
                       "largest": None}  # fmt: skip
    found = staleness.mean_separations(table, [4, 16])
    # A - B = 0.06 > 2 sqrt(0.0001/3 + 0.0004/12) = 0.01633; A - C = 0.10 > 2 sqrt(0.0001/3 + 0.0016/3) = 0.04761;
    # B - C = 0.04 < 2 sqrt(0.0004/12 + 0.0016/3) = 0.04761 (with the seeds swapped it would be 0.03266: called)
    assert [(a, b) for a, b, _, _ in found[4]] == [("A", "B"), ("A", "C")] and found[16] == []
    assert [g for _, _, g, _ in found[4]] == pytest.approx([0.06, 0.10])
    assert [t for _, _, _, t in found[4]] == pytest.approx([0.0163299, 0.0476095], abs=1e-7)
    text = "\n".join(staleness.mean_reading(table, [4, 16]))
    assert "| 4 | 3–12 | A, B (1.0, 2.0) | 3 | B, C (2.0, 4.0) | 9 |" in text
    assert "| 16 | 3 | — | — | — | — |" in text
    assert "- k = 4: A > B by 6.0% (2 SE = 1.6%); A > C by 10.0% (2 SE = 4.8%)\n- k = 16: none" in text


def test_variant_verdict_applies_the_twice_the_seed_noise_rule_at_high_k():
    # k = 8: DHPO-E trails GRPO by 0.10 > 2 x 0.02 and the variant by 0.01 (closed); k = 16: both trail by 0.10
    # (not closed); k = 4 is below the range the question is about.
    finals = {("GRPO", 8): [0.48, 0.50, 0.52], ("DHPO-E", 8): [0.38, 0.40, 0.42],
              ("DHPO-E+GSPO-seq-clip", 8): [0.47, 0.49, 0.51], ("GRPO", 16): [0.48, 0.50, 0.52],
              ("DHPO-E", 16): [0.38, 0.40, 0.42], ("DHPO-E+GSPO-seq-clip", 16): [0.38, 0.40, 0.42],
              ("GRPO", 4): [0.5, 0.5, 0.5], ("DHPO-E", 4): [0.1, 0.1, 0.1],
              ("DHPO-E+GSPO-seq-clip", 4): [0.1, 0.1, 0.1]}  # fmt: skip
    text = staleness.variant_verdict(staleness.aggregate(cells_for(finals)))
    at_8, at_16 = text.split("At k = 16")
    assert "k = 4" not in text
    assert "on final accuracy GRPO leads DHPO-E by 10.0% (2 std = 4.0%) and leads DHPO-E+GSPO-seq-clip by 1.0%" in at_8
    assert "the tighter sequence clip closes the gap" in at_8.split("area under")[0]
    assert "the tighter sequence clip does not close the gap" in at_16.split("area under")[0]
    # every cell here has the same curve, so the areas are equal: no gap to close on that measure
    assert at_16.split("area under")[1].count("DHPO-E has no gap to close") == 1
    assert staleness.variant_verdict(staleness.aggregate(cells_for({("GRPO", 8): [0.5, 0.5]}))) == ""
    better = staleness.aggregate(cells_for({("GRPO", 8): [0.4, 0.4], ("DHPO-E", 8): [0.4, 0.4],
                                            ("DHPO-E+GSPO-seq-clip", 8): [0.45, 0.45]}))  # fmt: skip
    assert "GRPO leads DHPO-E by 0.0% (2 std = 0.0%) and trails DHPO-E+GSPO-seq-clip by 5.0%" in (
        staleness.variant_verdict(better)
    )


def test_drift_ranks_the_largest_k_and_reads_dhpo_e_weight():
    cells = cells_for({("GRPO", 16): [0.4, 0.4], ("DHPO-E", 16): [0.4, 0.4], ("GRPO", 2): [0.4, 0.4]})
    for (objective, k, seed), cell in cells.items():
        cell["last_step_abs_log_ratio"] = 0.1 if objective == "DHPO-E" else 0.04
        cell["clip"] = {**cell["clip"], "sequence low": 0.02, "sequence high": 0.005}
    text = staleness.drift(staleness.aggregate(cells))
    assert text.startswith("At k = 16, the mean |log r| on the last step of each generation batch ranks GRPO 0.040, DHPO-E 0.100.")
    assert "mean w = 0.50 on the token ratio, so 50% of its mixed ratio is the sequence ratio" in text
    assert "binds on 2.5% of tokens there; its drift is 2.5x GRPO's" in text


def test_cell_settings_scale_steps_and_evaluations_with_k():
    spec = staleness.cell_settings(8, generation_batches=24, eval_every=4, learning_rate=1e-3)
    assert spec["max_steps"] == 192 and spec["eval_every"] == 32
    assert spec["settings"].steps_per_generation == 8 and spec["settings"].learning_rate == 1e-3
    assert spec["settings"].per_device_train_batch_size() == 32  # 32 prompts x 8 completions / 8 steps
    with pytest.raises(ValueError, match="steps_per_generation x gradient_accumulation_steps = 3"):
        staleness.cell_settings(3, generation_batches=24, eval_every=4, learning_rate=1e-3)


def test_bad_k_is_refused_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setattr(staleness, "load_task", lambda *a, **k: pytest.fail("ran before checking --ks"))
    with pytest.raises(SystemExit):
        staleness.main(["--ks", "2", "5"])
    assert "--ks 5" in capsys.readouterr().err


def test_saved_cells_are_reused_only_when_their_settings_match(monkeypatch, tmp_path):
    calls = []

    def fake_run(objective, seed, output_dir, disable_tqdm, settings, max_steps, eval_every, config_overrides,
                 final_heldout=None):
        calls.append((objective, seed, settings.steps_per_generation, config_overrides))
        summary = {"settings": {**dataclasses.asdict(settings), "max_steps": max_steps, "eval_every": eval_every},
                   "config_overrides": config_overrides, "summary_path": str(Path(output_dir) / "summary.json"),
                   "optimizer_steps": max_steps}  # fmt: skip
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(staleness, "run_embedded", fake_run)
    job = ("GRPO", 4, 1, str(tmp_path), 24, 4, 2e-4, "addition", None)
    assert staleness._run_cell(job)[2] is False and calls == [("GRPO", 1, 4, {})]
    assert staleness._run_cell(job)[2] is True and len(calls) == 1  # resumed from summary.json
    changed = ("GRPO", 4, 1, str(tmp_path), 12, 4, 2e-4, "addition", None)  # other number of generation batches: stale, rerun
    assert staleness._run_cell(changed)[2] is False and len(calls) == 2
    variant = ("DHPO-E+dual-clip", 4, 1, str(tmp_path), 24, 4, 2e-4, "addition", None)  # the DHPO-E preset with delta = 3
    assert staleness._run_cell(variant)[0] == ("DHPO-E+dual-clip", 4, 1)
    assert calls[-1] == ("DHPO-E", 1, 4, {"delta": 3.0})
    assert (tmp_path / "k4" / "DHPO-E+dual-clip-seed1" / "summary.json").is_file()
    saved = json.loads((tmp_path / "k4" / "GRPO-seed1" / "summary.json").read_text())
    assert saved["cpu_seconds"] >= 0  # recorded with the cell, so that a resumed study still sums it
    # the long task's settings (nested lengths, no digits) resume the same way; a changed task setting reruns
    long_job = ("GRPO", 4, 1, str(tmp_path / "long"), 2, 1, 2e-4, "long", None)
    assert staleness._run_cell(long_job)[2] is False and staleness._run_cell(long_job)[2] is True
    # a cell saved before a setting existed (its summary lacks it) is reused while the setting is at its default
    summary_path = tmp_path / "long" / "k4" / "GRPO-seed1" / "summary.json"
    older = json.loads(summary_path.read_text())
    assert older["settings"].pop("final_heldout_seed") == LongSettings().final_heldout_seed
    summary_path.write_text(json.dumps(older))
    assert staleness._run_cell(long_job)[2] is True
    monkeypatch.setitem(staleness.TASKS, "long", lambda: dataclasses.replace(LongSettings(), final_heldout_seed=7))
    assert staleness._run_cell(long_job)[2] is False  # not at its default: the saved cell did not run with it
    monkeypatch.setitem(staleness.TASKS, "long", lambda: dataclasses.replace(LongSettings(), median_steps=5.0))
    assert staleness._run_cell(long_job)[2] is False and calls[-1][2] == 4
    # a run a stop signal cut short (code that still wrote its summary) is rerun, whatever its settings say
    assert staleness._run_cell(job)[2] is False and staleness._run_cell(job)[2] is True  # saved with job's settings
    cut = json.loads((tmp_path / "k4" / "GRPO-seed1" / "summary.json").read_text())
    (tmp_path / "k4" / "GRPO-seed1" / "summary.json").write_text(json.dumps({**cut, "optimizer_steps": 4 * 24 - 7}))
    assert staleness._run_cell(job)[2] is False and staleness._run_cell(job)[2] is True


def test_a_stopped_cell_is_not_saved_and_the_study_ends_with_the_signals_status(monkeypatch, tmp_path):
    import runpy
    import signal

    def stopped(*args, **kwargs):
        raise TrainingStopped("stopped by SIGTERM after step 5 of 96 (checkpoint c)", {"signal": "SIGTERM"})

    monkeypatch.setattr("dhpo_trl.demo.embedded.run_embedded", stopped)  # what the script's import binds
    argv = ["staleness.py", "--objectives", "GRPO", "--ks", "4", "--seeds", "1", "--generation-batches", "2",
            "--workers", "1", "--out-dir", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(Path(staleness.__file__)), run_name="__main__")
    assert exited.value.code == 128 + signal.SIGTERM
    assert not list(tmp_path.rglob("summary.json"))


def test_memoized_reward_scores_like_the_reward_and_calls_it_once_per_pair():
    seen = []

    def reward(completions, answer, **kwargs):
        seen.extend(zip(completions, answer))
        return [float(c.strip() == f"\\boxed{{{a}}}") for c, a in zip(completions, answer)]

    memo = memoized_reward(reward)
    completions = [" \\boxed{5}", " \\boxed{6}", " \\boxed{5}", " \\boxed{5}"]
    assert memo(completions, ["5", "5", "5", "6"]) == [1.0, 0.0, 1.0, 0.0]
    assert len(seen) == 3  # (" \\boxed{5}", "5") once, the other two pairs once each
    assert memo(completions[:2], ["5", "5"]) == [1.0, 0.0] and len(seen) == 3
    assert memo.__name__ == "reward"  # TRL logs rewards/<name>/mean


def test_embedded_batch_must_split_into_k_steps():
    with pytest.raises(ValueError, match="prompts_per_generation x num_generations = 256"):
        EmbeddedSettings(steps_per_generation=3).per_device_train_batch_size()


def test_config_overrides_reach_the_config_before_the_warm_start(monkeypatch, tmp_path):
    from dhpo_trl.demo import embedded

    monkeypatch.setattr(embedded, "load_task", lambda *a, **k: pytest.fail("warm start before checking the config"))
    with pytest.raises(ValueError, match="delta"):  # DHPOConfig refuses delta <= 1: the override reached it
        embedded.run_embedded("DHPO-E", output_dir=tmp_path, config_overrides={"delta": 0.5})
    with pytest.raises(ValueError, match=r"config_overrides=\['learning_rate'\] are set by the embedded run"):
        embedded.run_embedded("DHPO-E", output_dir=tmp_path, config_overrides={"learning_rate": 1.0})


def _fake_cells(monkeypatch, calls):
    """`run_embedded` replaced by a writer of a summary and a hand-made log history (no training)."""

    def fake_run(objective, seed, output_dir, disable_tqdm, settings, max_steps, eval_every, config_overrides,
                 final_heldout=None):
        calls.append((settings.task, objective, settings.steps_per_generation, seed))
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        spread = {"off_policy/log_ratio_spread": 0.03 if settings.task == "long" else 0.01,
                  "off_policy/abs_sequence_log_ratio": 0.001 if settings.task == "long" else 0.004}  # fmt: skip
        log = [{**e, **spread} if "loss" in e else e for e in history()]
        (out / "trainer_state.json").write_text(json.dumps({"log_history": log}))
        summary = {"task": settings.task, "settings": {**dataclasses.asdict(settings), "max_steps": max_steps,
                   "eval_every": eval_every}, "config_overrides": config_overrides, "heldout_accuracy_before": 0.2,
                   "heldout_accuracy_after": 0.4, "train_seconds": 1.0, "wall_seconds": 2.0, "num_heldout": 4,
                   "parameters": 10, "commit": "abc", "log_history_path": str(out / "trainer_state.json"),
                   "summary_path": str(out / "summary.json"), "cpu_seconds": 60.0, "optimizer_steps": max_steps}  # fmt: skip
        if final_heldout is not None:  # a policy right on a share of the problems that depends on the cell
            rng = random.Random(f"{objective} {config_overrides} {settings.steps_per_generation} {seed}")
            share = 0.3 + 0.1 * (objective == "DHPO-E") + 0.05 * rng.random()
            correct = "".join("1" if rng.random() < share else "0" for _ in range(final_heldout))
            summary.update(final_heldout={"num_problems": final_heldout, "correct": correct,
                                          "accuracy": correct.count("1") / final_heldout}, warm_start_key="k3y")  # fmt: skip
        (out / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(staleness, "run_embedded", fake_run)
    monkeypatch.setattr(staleness, "load_task", lambda settings: None)


def test_long_study_runs_in_plan_order_compares_spreads_and_reports_missing_cells(monkeypatch, tmp_path):
    calls = []
    _fake_cells(monkeypatch, calls)
    common = ["--task", "long", "--objectives", "GRPO", "DHPO-E", "--ks", "4", "1", "--reference-seeds", "0",
              "--generation-batches", "2", "--eval-every", "1", "--workers", "1", "--out-dir", str(tmp_path / "out"),
              "--docs-dir", str(tmp_path / "docs")]  # fmt: skip
    assert staleness.main([*common, "--seeds", "0", "1"]) == 0
    # k = 4 first: each objective's first seed then its two-digit reference, the next seed; no reference at k = 1
    assert calls == [("long", "GRPO", 4, 0), ("addition", "GRPO", 4, 0), ("long", "DHPO-E", 4, 0),
                     ("addition", "DHPO-E", 4, 0), ("long", "GRPO", 4, 1), ("long", "DHPO-E", 4, 1),
                     ("long", "GRPO", 1, 0), ("long", "DHPO-E", 1, 0), ("long", "GRPO", 1, 1), ("long", "DHPO-E", 1, 1)]  # fmt: skip
    results = json.loads((tmp_path / "docs" / "long_completions.json").read_text())
    assert results["meta"]["missing"] == [] and results["meta"]["task"] == "long"
    page = (tmp_path / "docs" / "long_completions.md").read_text()
    assert page == staleness.page_from_json(results) and "Incomplete" not in page
    assert "| GRPO | 0.0300 / 0.0100 (3.0x) |" in page  # k = 4 only: on-policy k = 1 is no column of the comparison
    assert "| GRPO | 0.0010 / 0.0040 (0.2x) |" in page  # mean |log s|
    assert "| GRPO | 30.0 / 2.5 (12.0x) |" in page  # the spread in units of |log s|: 0.03 / 0.001 against 0.01 / 0.004
    assert (tmp_path / "docs" / "long_completions_accuracy.png").is_file()

    # a third seed, reported before it runs: nothing runs, the page names the missing cells and the resume command
    assert staleness.main([*common, "--seeds", "0", "1", "2", "--report-only"]) == 0 and len(calls) == 10
    results = json.loads((tmp_path / "docs" / "long_completions.json").read_text())
    assert results["meta"]["missing"] == ["long GRPO k=4 seed 2", "long DHPO-E k=4 seed 2", "long GRPO k=1 seed 2",
                                          "long DHPO-E k=1 seed 2"]  # fmt: skip
    page = (tmp_path / "docs" / "long_completions.md").read_text()
    assert "Incomplete: 4 cells" in page and "--report-only" not in results["meta"]["command"]


def test_on_policy_objectives_choose_the_rows_run_at_k_1(monkeypatch, tmp_path):
    calls = []
    _fake_cells(monkeypatch, calls)
    common = ["--task", "long", "--objectives", "GRPO", "GSPO", "DHPO-E", "--seeds", "0", "--generation-batches", "2",
              "--eval-every", "1", "--workers", "1", "--out-dir", str(tmp_path / "out"), "--docs-dir",
              str(tmp_path / "docs")]  # fmt: skip
    assert staleness.main([*common, "--ks", "4", "1", "--on-policy-objectives", "DHPO-E", "GRPO"]) == 0
    assert calls == [("long", "GRPO", 4, 0), ("long", "GSPO", 4, 0), ("long", "DHPO-E", 4, 0), ("long", "DHPO-E", 1, 0),
                     ("long", "GRPO", 1, 0)]  # fmt: skip
    results = json.loads((tmp_path / "docs" / "long_completions.json").read_text())
    assert sorted(results["aggregate"]["GSPO"]) == ["4"] and sorted(results["aggregate"]["GRPO"]) == ["1", "4"]
    for bad in (["--ks", "4", "1", "--on-policy-objectives", "SAPO"], ["--ks", "4", "--on-policy-objectives", "GRPO"]):
        with pytest.raises(SystemExit):
            staleness.main([*common, *bad])
    assert len(calls) == 5


@pytest.mark.parametrize("argv, flag", [(["--seeds", "1", "1"], "--seeds"), (["--ks", "4", "2", "4"], "--ks"),
                                        (["--objectives", "GRPO", "DHPO-E", "DHPO-E"], "--objectives"),
                                        (["--task", "long", "--reference-seeds", "0", "0"], "--reference-seeds"),
                                        (["--ks", "1", "4", "--on-policy-objectives", "GRPO", "GRPO"],
                                         "--on-policy-objectives"),
                                        (["--seeds", "4294967296"], "argument --seeds")])  # fmt: skip
def test_a_repeated_value_is_refused_before_anything_runs(monkeypatch, capsys, argv, flag):
    monkeypatch.setattr(staleness, "load_task", lambda *a, **k: pytest.fail("ran despite a repeated value"))
    with pytest.raises(SystemExit) as exited:
        staleness.main(argv)
    assert exited.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].split(": ")[2] == flag


def test_reference_seeds_need_the_long_task(capsys):
    with pytest.raises(SystemExit):
        staleness.main(["--reference-seeds", "0"])
    assert "--reference-seeds" in capsys.readouterr().err


def test_powered_study_reports_the_final_heldout_accuracy_its_noise_and_what_is_missing(monkeypatch, tmp_path):
    calls = []
    _fake_cells(monkeypatch, calls)
    common = ["--task", "long", "--objectives", "GRPO", "DHPO-E", "SAPO", "--ks", "4", "2", "--final-heldout", "300",
              "--generation-batches", "2", "--eval-every", "1", "--workers", "1", "--out-dir", str(tmp_path / "out"),
              "--docs-dir", str(tmp_path / "docs")]  # fmt: skip
    assert staleness.main([*common, "--seeds", "0", "1", "2"]) == 0
    # seed-major within each k: every objective of seed 0, then of seed 1, ...
    assert calls[:6] == [("long", o, 4, s) for s in (0, 1) for o in ("GRPO", "DHPO-E", "GRPO")]  # SAPO: a GRPO variant
    results = json.loads((tmp_path / "docs" / "long_completions_power.json").read_text())
    page = (tmp_path / "docs" / "long_completions_power.md").read_text()
    assert page == staleness.page_from_json(results) and "Partial" not in page
    assert results["meta"]["warm_start_keys"] == ["k3y"] and "`warmstart-k3y`" in page
    for objective in ("GRPO", "DHPO-E", "SAPO"):
        for k in (4, 2):
            summaries = [json.loads((tmp_path / "out" / f"k{k}" / f"{objective}-seed{s}" / "summary.json").read_text())
                         for s in (0, 1, 2)]  # fmt: skip
            scores = np.array([[int(c) for c in s["final_heldout"]["correct"]] for s in summaries])
            accuracy = scores.sum(axis=1) / 300
            mean, std = results["aggregate"][objective][str(k)]["final_heldout_accuracy"]
            assert (mean, std) == pytest.approx((accuracy.mean(), accuracy.std(ddof=1)), abs=1e-12)
            noise = results["noise"][objective][str(k)]
            evaluation = np.sqrt(np.trace(np.cov(scores.T))) / 300  # the covariance matrix's diagonal
            assert noise["seed_std"] == pytest.approx(np.sqrt(np.cov(scores.T).mean()), abs=1e-12)
            assert noise["evaluation_std"] == pytest.approx(evaluation, abs=1e-12)
            assert noise["training_std"] == pytest.approx(np.sqrt(max(0, std**2 - evaluation**2)), abs=1e-12)
            assert noise["binomial_std"] == pytest.approx(np.sqrt(mean * (1 - mean) / 300), abs=1e-12)
            assert f"| {objective} | {k} | 3 | {100 * std:.1f} | {100 * noise['binomial_std']:.1f} |" in page
    stds = sorted(results["aggregate"][o]["4"]["final_heldout_accuracy"][1] for o in ("GRPO", "DHPO-E", "SAPO"))
    assert f"| 4 | 3 | {200 * stds[1]:.1f} | {200 * stds[2]:.1f} |" in page

    # two more seeds, reported before they run: nothing runs, the page is marked partial and names them
    assert staleness.main([*common, "--seeds", "0", "1", "2", "3", "--report-only"]) == 0 and len(calls) == 18
    results = json.loads((tmp_path / "docs" / "long_completions_power.json").read_text())
    page = (tmp_path / "docs" / "long_completions_power.md").read_text()
    left = results["meta"]["cpu_minutes"] / 18 * 6  # the finished cells' mean, times the cells not run
    assert f"**Partial: 18 of 24 cells finished**; about {left:.0f} CPU minutes left" in page
    assert "long SAPO k=2 seed 3" in results["meta"]["missing"] and "long SAPO k=2 seed 3" in page
    # a cell saved without the final set is run again; one with it is reused
    summary_path = tmp_path / "out" / "k4" / "GRPO-seed0" / "summary.json"
    saved = json.loads(summary_path.read_text())
    summary_path.write_text(json.dumps({**saved, "final_heldout": None}))
    assert staleness.main([*common, "--seeds", "0"]) == 0 and calls[18:] == [("long", "GRPO", 4, 0)]


def test_final_heldout_is_refused_where_it_cannot_act(capsys):
    for bad in (["--final-heldout", "100"], ["--task", "long", "--final-heldout", "0"],
                ["--task", "long", "--final-heldout", "100", "--reference-seeds", "0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            staleness.main(bad)
        assert "--final-heldout" in capsys.readouterr().err


def test_a_powered_study_with_one_seed_done_reports_means_and_what_it_lacks(monkeypatch, tmp_path):
    calls = []
    _fake_cells(monkeypatch, calls)
    common = ["--task", "long", "--objectives", "GRPO", "DHPO-E", "--ks", "4", "2", "--final-heldout", "50",
              "--generation-batches", "2", "--eval-every", "1", "--workers", "1", "--out-dir", str(tmp_path / "out"),
              "--docs-dir", str(tmp_path / "docs")]  # fmt: skip
    assert staleness.main([*common, "--seeds", "0"]) == 0
    assert staleness.main([*common, "--seeds", "0", "1", "--report-only"]) == 0 and len(calls) == 4
    results = json.loads((tmp_path / "docs" / "long_completions_power.json").read_text())
    page = (tmp_path / "docs" / "long_completions_power.md").read_text()
    grpo = results["aggregate"]["GRPO"]["4"]["final_heldout_accuracy"][0]
    assert f"| GRPO | {grpo:.1%} (1) |" in page and results["noise"] == {}
    assert "**Partial: 4 of 8 cells finished**" in page and "No row has two seeds yet" in page
    assert "| 4 | 0 | — | — | — | — |" in page  # no pair has a noise to compare against


def test_a_cells_system_exit_in_the_main_process_is_a_lost_cell_not_the_studys_end(monkeypatch, tmp_path, capsys):
    """With one worker the cells run in the main process: a cell's `SystemExit(0)` (argparse or `sys.exit()` in a
    library) ends the study with one line naming the cell and status 1, as in a pool, not with status 0 and no page;
    the cell before it is saved and the same command reuses it."""
    calls = []
    _fake_cells(monkeypatch, calls)
    fake = staleness.run_embedded

    def exits_in_the_second_cell(*args, **kwargs):
        if len(calls) == 1:
            raise SystemExit(0)
        return fake(*args, **kwargs)

    monkeypatch.setattr(staleness, "run_embedded", exits_in_the_second_cell)
    argv = ["--task", "long", "--objectives", "GRPO", "DHPO-E", "--ks", "4", "--seeds", "0", "--generation-batches",
            "2", "--eval-every", "1", "--workers", "1", "--out-dir", str(tmp_path / "out"), "--docs-dir",
            str(tmp_path / "docs")]  # fmt: skip
    assert staleness.cli(argv) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[staleness] ")]
    assert len(lines) == 1 and "_run_cell(('DHPO-E', 4, 0" in lines[0] and "SystemExit(0)" in lines[0], lines
    assert not (tmp_path / "docs").exists() and calls == [("long", "GRPO", 4, 0)]
    monkeypatch.setattr(staleness, "run_embedded", fake)
    assert staleness.cli(argv) == 0 and calls == [("long", "GRPO", 4, 0), ("long", "DHPO-E", 4, 0)]
