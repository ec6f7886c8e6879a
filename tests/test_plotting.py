"""dhpo_trl.evaluation.plotting: figures hold exactly the logged series, labelled per run; files are written; gaps noted."""

import json

import pytest

from dhpo_trl.evaluation import plotting


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


def test_command_prints_each_png_and_closes_its_figures(tmp_path, capsys):
    import matplotlib.pyplot as plt

    run_a = _write_run(tmp_path / "a", _log_history(1.0))
    run_b = _write_run(tmp_path / "b", _log_history(2.0))
    out = tmp_path / "plots"
    assert plotting.main([str(run_a), str(run_b), "--labels", "GRPO", "DHPO-E", "--out", str(out)]) == 0
    names = ["entropy", "response_length", "accuracy", "clip_fraction", "mixing_weight"]
    assert capsys.readouterr().out.splitlines() == [str(out / f"{name}.png") for name in names]
    assert plt.get_fignums() == []  # a notebook or a loop of calls does not pile up open figures


def test_command_help_and_usage_errors(capsys):
    with pytest.raises(SystemExit) as exit_:
        plotting.main(["--help"])
    assert exit_.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines to the terminal width
    assert shown.startswith("usage: dhpo-plot [-h] [--labels LABELS [LABELS ...]] --out OUT [--debug] runs [runs ...] ")
    for text in (
        "Training-dynamics plots (the paper's Figs. 1-3) from one or more runs' `trainer_state.json` log histories. ",
        "runs trainer_state.json files or training output directories ",
        "--labels LABELS [LABELS ...] one legend label per run (default: folder names) ",
        "--out OUT directory for the PNG and SVG files ",
        "--debug show the Python traceback of an error instead of its one-line message",
    ):
        assert text in shown, text
    assert shown.split(" positional arguments:")[0].endswith("log histories.")  # only the docstring's first paragraph
    with pytest.raises(SystemExit) as exit_:
        plotting.main(["run"])  # --out is required
    assert exit_.value.code == 2
    assert "the following arguments are required: --out" in capsys.readouterr().err


def test_command_reports_bad_input_on_one_line_and_debug_keeps_the_traceback(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert plotting.main([str(missing), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (
        f"dhpo-plot: error: Run {missing} does not exist: pass a trainer_state.json file or a training output "
        "directory.\n"
    )
    run = _write_run(tmp_path / "r", _log_history(1.0))
    assert plotting.main([str(run), str(run), "--labels", "one", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (
        "dhpo-plot: error: Got 1 labels for 2 runs: give one label per run, in order.\n"
    )
    assert plotting.main([str(missing), "--out", str(tmp_path / "o"), "--debug"]) == 2
    assert capsys.readouterr().err.startswith("Traceback (most recent call last):\n")
    assert not (tmp_path / "o").exists()  # nothing is written for bad input
