"""dhpo_trl.evaluation.plotting, figure content: which points each line holds, titles, axis labels, legends and integer steps,
which accuracy series is drawn, and how a run's trainer_state.json is found. (main() is tested in test_plotting.)"""

import json

import matplotlib.pyplot as plt
import pytest

from dhpo_trl.evaluation import plotting
from dhpo_trl.evaluation.plotting import Run, build_figures, find_trainer_state, load_run


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_series_keeps_numeric_points_with_a_step():
    run = Run("r", None, [
        {"step": 1, "x": 0.5}, {"step": 2, "x": True}, {"step": 3, "x": "nan"}, {"x": 9.0}, {"step": 4, "x": 2},
        {"step": 5, "y": 1.0}, {"step": 6, "x": None}, {"step": 7, "x": float("nan")},
    ])  # fmt: skip
    steps, values = run.series("x")
    assert steps == [1, 4, 7] and values[:2] == [0.5, 2] and values[2] != values[2]  # NaN is a number: kept
    assert run.has("x") and run.has("y") and not run.has("z")
    assert Run("e", None, [{"step": 1, "x": False}]).has("x") is False  # a bool is not a metric value


def lines(axis):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in axis.get_lines()}


def test_line_figures_titles_labels_and_legends():
    a = Run("A", None, [{"step": 1, "entropy": 2.0, "completions/mean_length": 40.0}, {"step": 3, "entropy": 1.0}])
    b = Run("B", None, [{"step": 2, "completions/mean_length": 50.0}])
    figures, notes = build_figures([a, b])
    entropy = figures["entropy"].axes[0]
    assert (entropy.get_title(), entropy.get_xlabel(), entropy.get_ylabel()) == (
        "Policy entropy", "step", "entropy (nats / token)"
    )  # fmt: skip
    assert lines(entropy) == {"A": ([1, 3], [2.0, 1.0])}  # a run without the metric draws no line
    assert [t.get_text() for t in entropy.get_legend().get_texts()] == ["A"]
    length = figures["response_length"].axes[0]
    assert (length.get_title(), length.get_ylabel()) == ("Mean response length", "tokens")
    assert lines(length) == {"A": ([1], [40.0]), "B": ([2], [50.0])}
    assert all(tick == int(tick) for tick in entropy.xaxis.get_major_locator().tick_values(1, 3))
    assert "skipped mixing_weight: no run logged 'dhpo/mixing_weight/mean'" in notes
    assert "skipped clip_fraction: no run logged 'dhpo/clip_fraction/*'" in notes
    assert set(figures) == {"entropy", "response_length"}


@pytest.mark.parametrize(
    ("keys", "chosen", "ylabel"),
    [
        (("reward", "eval/heldout_accuracy", "eval/avg"), "eval/avg", "accuracy (%)"),
        (("reward", "eval/heldout_accuracy"), "eval/heldout_accuracy", "accuracy"),
        (("reward",), "reward", "reward"),
    ],
)
def test_accuracy_prefers_the_benchmark_average(keys, chosen, ylabel):
    history = [{"step": s, **{k: 10.0 * s + i for i, k in enumerate(keys)}} for s in (1, 2)]
    figures, _ = build_figures([Run("A", None, history)])
    axis = figures["accuracy"].axes[0]
    assert axis.get_title() == f"Average accuracy ({chosen})" and axis.get_ylabel() == ylabel
    assert lines(axis) == {"A": ([1, 2], [10.0 + keys.index(chosen), 20.0 + keys.index(chosen)])}


def test_accuracy_key_logged_by_any_run_is_used_for_all():
    a = Run("A", None, [{"step": 1, "reward": 0.5}])
    b = Run("B", None, [{"step": 1, "eval/avg": 30.0}])
    figures, notes = build_figures([a, b])
    assert lines(figures["accuracy"].axes[0]) == {"B": ([1], [30.0])}
    _, notes = build_figures([Run("A", None, [{"step": 1, "loss": 1.0}])])
    assert notes[2] == "skipped accuracy: no run logged any of ['eval/avg', 'eval/heldout_accuracy', 'reward']"


def test_clip_figure_has_one_panel_per_logged_branch():
    a = Run(
        "A",
        None,
        [{"step": 1, "dhpo/clip_fraction/token_high": 0.1}, {"step": 2, "dhpo/clip_fraction/token_high": 0.2}],
    )
    b = Run("B", None, [{"step": 1, "dhpo/clip_fraction/sequence_low": 0.3, "dhpo/mixing_weight/mean": 0.4}])
    figures, _ = build_figures([a, b])
    axes = figures["clip_fraction"].axes
    assert [axis.get_title() for axis in axes] == ["clip fraction: token high", "clip fraction: sequence low"]
    assert [(axis.get_xlabel(), axis.get_ylabel()) for axis in axes] == [("step", "fraction clipped")] * 2
    assert lines(axes[0]) == {"A": ([1, 2], [0.1, 0.2])} and lines(axes[1]) == {"B": ([1], [0.3])}
    assert [t.get_text() for t in axes[1].get_legend().get_texts()] == ["B"]
    mixing = figures["mixing_weight"].axes[0]
    assert (mixing.get_title(), mixing.get_ylabel()) == ("DHPO mixing weight", "mean mixing weight")
    assert lines(mixing) == {"B": ([1], [0.4])}


def write_state(directory, history):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    return directory / "trainer_state.json"


def test_trainer_state_is_found_at_the_top_or_in_the_highest_checkpoint(tmp_path):
    run = tmp_path / "run"
    write_state(run / "checkpoint-9", [])
    latest = write_state(run / "checkpoint-10", [])  # 10 > 9 as a number, not as text
    (run / "checkpoint-11").mkdir()  # no state inside: ignored
    write_state(run / "checkpoint-final", [])  # not checkpoint-N: ignored
    assert find_trainer_state(run) == latest
    top = write_state(run, [])
    assert find_trainer_state(run) == top
    assert find_trainer_state(latest) == latest
    assert find_trainer_state(str(latest)) == latest


def test_labels_default_to_the_run_folder(tmp_path):
    state = write_state(tmp_path / "grpo-run", [{"step": 1, "entropy": 1.0}])
    assert load_run(state).label == "grpo-run" and load_run(state.parent).label == "grpo-run"
    assert load_run(state, "GRPO").label == "GRPO"
    assert load_run(state).source == state and load_run(state).log_history == [{"step": 1, "entropy": 1.0}]


@pytest.mark.parametrize("content", [[1, 2], {"global_step": 3}, {"log_history": {"step": 1}}])
def test_a_state_without_a_log_history_list_is_rejected(tmp_path, content):
    (tmp_path / "trainer_state.json").write_text(json.dumps(content))
    with pytest.raises(ValueError, match="has no 'log_history' list: is it a transformers trainer_state.json"):
        load_run(tmp_path)


def test_plot_runs_without_labels_and_into_a_new_folder(tmp_path, capsys):
    write_state(tmp_path / "a", [{"step": 1, "entropy": 1.0}])
    figures = plotting.plot_runs([tmp_path / "a"], None, tmp_path / "out" / "nested")
    assert set(figures) == {"entropy"}
    assert lines(figures["entropy"].axes[0]) == {"a": ([1], [1.0])}
    assert sorted(p.name for p in (tmp_path / "out" / "nested").iterdir()) == ["entropy.png", "entropy.svg"]
    err = capsys.readouterr().err
    assert "note: skipped response_length: no run logged 'completions/mean_length'" in err


def test_figure_sizes_grids_and_integer_steps():
    run = Run("A", None, [{"step": 1, "entropy": 1.0, **{f"dhpo/clip_fraction/{b}": 0.1 for b in
                                                        plotting.CLIP_BRANCHES[:3]}}])  # fmt: skip
    figures, _ = build_figures([run])
    assert tuple(figures["entropy"].get_size_inches()) == (6.0, 4.0)
    assert tuple(figures["clip_fraction"].get_size_inches()) == (13.5, 4.0)  # 4.5 inches per panel
    for axis in (figures["entropy"].axes[0], *figures["clip_fraction"].axes):
        gridlines = axis.xaxis.get_gridlines()
        assert gridlines[0].get_visible() and gridlines[0].get_alpha() == 0.3
        assert all(t == int(t) for t in axis.xaxis.get_major_locator().tick_values(1, 2))


def test_files_are_written_at_120_dpi_into_an_existing_folder(tmp_path):
    write_state(tmp_path / "a", [{"step": 1, "entropy": 1.0}])
    (tmp_path / "out").mkdir()
    plotting.plot_runs([tmp_path / "a"], ["A"], tmp_path / "out")
    plotting.plot_runs([tmp_path / "a"], ["A"], tmp_path / "out")  # a second time into the same folder
    png = (tmp_path / "out" / "entropy.png").read_bytes()
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (720, 480)  # 6 x 4 inches at 120 dpi


def test_a_folder_without_any_state_names_the_fix(tmp_path):
    with pytest.raises(ValueError) as error:
        find_trainer_state(tmp_path)
    assert str(error.value) == (
        f"Run {tmp_path} has no trainer_state.json, neither at the top level nor in a checkpoint-N/ folder. "
        "Save a checkpoint (save_strategy) or call trainer.save_state()."
    )
    with pytest.raises(ValueError, match=f"Run {tmp_path / 'missing'} does not exist: pass a trainer_state.json"):
        find_trainer_state(tmp_path / "missing")
