"""dhpo_trl.plotting: figures hold exactly the logged series, labelled per run; files are written; gaps noted."""

import json

import pytest

from dhpo_trl import plotting


def _log_history(scale: float, with_dhpo: bool = True) -> list[dict]:
    history = []
    for step in range(1, 6):
        entry = {
            "step": step,
            "loss": 0.1,
            "entropy": scale * (1.0 - 0.1 * step),
            "completions/mean_length": 50.0 + scale * step,
            "reward": 0.1 * step,
        }
        if with_dhpo:
            entry.update({f"dhpo/clip_fraction/{b}": scale * 0.01 * step for b in plotting.CLIP_BRANCHES})
            entry["dhpo/mixing_weight/mean"] = 0.5 + 0.01 * step * scale
        history.append(entry)
        if step % 2 == 0:  # evaluation entries carry no training metrics, as the callback logs them
            history.append({"step": step, "eval/gsm8k": 10.0 * step, "eval/avg": 10.0 * step * scale})
    return history


def _write_run(directory, history, checkpoint: int | None = None):
    target = directory / f"checkpoint-{checkpoint}" if checkpoint is not None else directory
    target.mkdir(parents=True, exist_ok=True)
    (target / "trainer_state.json").write_text(json.dumps({"global_step": 5, "log_history": history}))
    return directory


def _lines_by_label(figure) -> dict:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in figure.axes[0].get_lines()}


def test_figures_hold_the_logged_series_with_labels(tmp_path):
    run_a = _write_run(tmp_path / "a", _log_history(1.0))
    # run b: only checkpoints, the last one (checkpoint-10) must be read, not checkpoint-2
    _write_run(tmp_path / "b", [{"step": 1, "entropy": 99.0}], checkpoint=2)
    run_b = _write_run(tmp_path / "b", _log_history(2.0), checkpoint=10)
    figures = plotting.plot_runs([run_a, run_b], ["GRPO", "DHPO-E"], tmp_path / "plots")

    assert set(figures) == {"entropy", "response_length", "accuracy", "clip_fraction", "mixing_weight"}
    entropy = _lines_by_label(figures["entropy"])
    assert set(entropy) == {"GRPO", "DHPO-E"}
    assert entropy["GRPO"][0] == [1, 2, 3, 4, 5]
    assert entropy["DHPO-E"][1] == pytest.approx([2.0 * (1.0 - 0.1 * s) for s in range(1, 6)])
    accuracy = _lines_by_label(figures["accuracy"])  # eval/avg preferred over reward
    assert accuracy["DHPO-E"] == ([2, 4], pytest.approx([40.0, 80.0]))
    assert figures["accuracy"].axes[0].get_title() == "Average accuracy (eval/avg)"
    clip_axes = figures["clip_fraction"].axes
    assert [axis.get_title() for axis in clip_axes] == [
        "clip fraction: token low",
        "clip fraction: token high",
        "clip fraction: sequence low",
        "clip fraction: sequence high",
    ]
    assert list(clip_axes[3].get_lines()[1].get_ydata()) == pytest.approx([0.02 * s for s in range(1, 6)])
    mixing = _lines_by_label(figures["mixing_weight"])
    assert mixing["GRPO"][1] == pytest.approx([0.5 + 0.01 * s for s in range(1, 6)])
    for name in figures:
        for extension in ("png", "svg"):
            written = tmp_path / "plots" / f"{name}.{extension}"
            assert written.stat().st_size > 5_000, written


def test_missing_metrics_are_skipped_with_a_note(tmp_path, capsys):
    history = [{k: v for k, v in entry.items() if not k.startswith("eval/")} for entry in _log_history(1.0, False)]
    state_file = _write_run(tmp_path / "grpo", history) / "trainer_state.json"
    assert plotting.main([str(state_file), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "skipped clip_fraction" in err and "skipped mixing_weight" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        f"{name}.{ext}" for name in ("entropy", "response_length", "accuracy") for ext in ("png", "svg")
    )
    figures, _ = plotting.build_figures([plotting.load_run(state_file)])
    assert figures["accuracy"].axes[0].get_title() == "Average accuracy (reward)"  # fallback without eval/*
    assert _lines_by_label(figures["entropy"]).keys() == {"grpo"}  # default label: the run's folder


def test_bad_runs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        plotting.load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no trainer_state.json"):
        plotting.load_run(tmp_path / "empty")
    run = _write_run(tmp_path / "r", _log_history(1.0))
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        plotting.plot_runs([run, run], ["only-one"], tmp_path / "o")
