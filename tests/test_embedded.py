"""The embedded CPU default: synthetic task, cached warm start, and a short, deterministic DHPO-E run."""

import json
import os
import pickle
import re
import signal
from pathlib import Path

import pytest

from dhpo_trl.demo import embedded
from dhpo_trl.demo.arithmetic import generate_problems, make_splits, to_dataset
from dhpo_trl.demo.embedded import EmbeddedSettings, main, run_embedded
from dhpo_trl.scoring.rewards import math_verify_reward

# A few seconds of everything: 20 warm-start steps, 4 RL steps (two generation batches), 16 held-out problems.
SHORT = EmbeddedSettings(num_train=64, num_heldout=16, warmup_steps=20, max_steps=4, prompts_per_generation=8,
                         num_generations=4, eval_every=2)  # fmt: skip


def test_problems_have_correct_answers_and_disjoint_deterministic_splits():
    train, heldout = make_splits(300, 50, digits=(2, 3), seed=7)
    for problem in train + heldout:
        assert int(problem.answer) == eval(problem.question)  # "37+45" evaluated by Python
        assert 10 <= problem.left <= 999 and 10 <= problem.right <= 999
        assert problem.prompt == f"Q: {problem.question}\nA:"
    assert not set(train) & set(heldout)
    assert len(set(train)) == 300
    assert make_splits(300, 50, digits=(2, 3), seed=7) == (train, heldout)
    assert make_splits(300, 50, digits=(2, 3), seed=8)[0] != train
    assert to_dataset(heldout[:3])["answer"] == [p.answer for p in heldout[:3]]


def test_reward_scores_target_completion_one_and_wrong_sum_zero():
    problem = generate_problems(1, digits=(2, 2), seed=0)[0]
    wrong = f" \\boxed{{{int(problem.answer) + 1}}}"
    assert math_verify_reward([problem.target_completion(), wrong, "no box"], [problem.answer] * 3) == [1.0, 0.0, 0.0]


def test_bad_task_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="digits"):
        generate_problems(3, digits=(3, 2), seed=0)
    with pytest.raises(ValueError, match="count"):
        generate_problems(9000, digits=(1, 1), seed=0)
    with pytest.raises(ValueError, match="algorithm"):
        run_embedded("PPO", settings=SHORT)
    with pytest.raises(ValueError, match="max_steps"):
        run_embedded(max_steps=0, settings=SHORT)


def test_short_run_writes_outputs_reuses_cache_and_is_deterministic(tmp_path, capsys):
    cache = tmp_path / "cache"
    first = run_embedded("DHPO-E", seed=3, output_dir=tmp_path / "a", cache_dir=cache, settings=SHORT,
                         disable_tqdm=True)  # fmt: skip
    assert first["warm_start_from_cache"] is False
    # 20 steps never reach the 20% target: all of them ran, and the line says how the probe stood at the end
    assert first["warm_start_steps"] == 20
    assert re.search(r"^Warm start \(20 supervised steps, right on \d+% of the training probe\) trained in ",
                     capsys.readouterr().out, re.MULTILINE)  # fmt: skip
    assert first["optimizer_steps"] == 4
    assert [step for step, _ in first["heldout_accuracies"]] == [0, 2, 4]
    assert first["heldout_accuracy_before"] == first["heldout_accuracies"][0][1]
    assert first["heldout_accuracy_after"] == first["heldout_accuracies"][-1][1]
    for _, accuracy in first["heldout_accuracies"] + first["reward"]:
        assert 0.0 <= accuracy <= 1.0
    assert len(first["entropy"]) == 4 and all(value > 0 for _, value in first["entropy"])
    assert (Path(first["checkpoint_dir"]) / "model.safetensors").is_file()
    assert (Path(first["checkpoint_dir"]) / "README.md").read_text().count("DHPO settings") == 1
    assert Path(first["plot_path"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    history = json.loads(Path(first["log_history_path"]).read_text())["log_history"]
    assert [e["eval/heldout_accuracy"] for e in history if "eval/heldout_accuracy" in e] == [
        a for _, a in first["heldout_accuracies"]
    ]
    assert json.loads(Path(first["summary_path"]).read_text())["heldout_accuracies"] == first["heldout_accuracies"]
    assert len(list(cache.glob("warmstart-*"))) == 1

    second = run_embedded("DHPO-E", seed=3, output_dir=tmp_path / "b", cache_dir=cache, settings=SHORT,
                          disable_tqdm=True)  # fmt: skip
    assert second["warm_start_from_cache"] is True
    assert second["warm_start_steps"] == 20
    assert "Warm start (20 supervised steps, right on " in capsys.readouterr().out
    assert second["warm_start_seconds"] < first["warm_start_seconds"]
    for key in ("heldout_accuracies", "reward", "entropy"):  # same seed, same numbers
        assert [step for step, _ in second[key]] == [step for step, _ in first[key]], key
        assert [value for _, value in second[key]] == pytest.approx([value for _, value in first[key]], abs=1e-6), key


def test_cli_rejects_unknown_algorithm():
    with pytest.raises(SystemExit):
        main(["--algorithm", "PPO"])


def test_summary_prints_each_phase_and_where_to_go_next(capsys):
    from dhpo_trl.demo.embedded import _print_summary

    summary = {
        "algorithm": "DHPO-E", "heldout_accuracy_before": 0.25, "heldout_accuracy_after": 0.5, "num_heldout": 200,
        "optimizer_steps": 96, "wall_seconds": 171.4, "warm_start_from_cache": True,
        "phase_seconds": {"warm_start": 0.4, "baseline_evaluation": 2.2, "rl": 160.6, "rl_evaluation": 12.3,
                          "save": 8.2},
        "checkpoint_dir": "c", "plot_path": "p", "log_history_path": "l", "summary_path": "s",
    }  # fmt: skip
    _print_summary(summary)
    assert capsys.readouterr().out == (
        "\nDHPO-E done: held-out accuracy 25.0% -> 50.0% (+25.0 points) on 200 problems\n"
        "  optimizer steps : 96\n"
        "  wall time       : 171s = warm start 0s (cached) + accuracy before RL 2s + RL 161s (of which held-out "
        "evaluations 12s) + saving 8s\n"
        "  checkpoint      : c\n"
        "  plot            : p\n"
        "  log history     : l\n"
        "  summary         : s\n"
        "Next: how the objectives compare as updates go off-policy, docs/study/staleness.md; the Python API on this "
        "task, examples/notebooks/dhpo_quickstart.ipynb\n"
    )
    _print_summary({**summary, "warm_start_from_cache": False, "heldout_accuracy_after": 0.125})
    out = capsys.readouterr().out
    assert "25.0% -> 12.5% (-12.5 points) on 200 problems" in out
    assert "171s = warm start 0s + accuracy before RL 2s" in out  # trained, not loaded: no "(cached)"


def test_the_warm_start_follows_the_task_settings(monkeypatch):
    """load_task hands the warm start the training problems (not the held-out ones), the step limit and the target."""
    captured = {}
    monkeypatch.setattr(embedded, "load_or_warm_start", lambda warm, **kwargs: captured.update(warm=warm, **kwargs))
    settings = EmbeddedSettings(num_train=30, num_heldout=5, warmup_steps=77, warmup_target_accuracy=0.35)
    train, heldout, _ = embedded.load_task(settings, cache_dir="somewhere", use_cache=False)
    warm = captured["warm"]
    assert (warm.steps, warm.target_accuracy, warm.problems) == (77, 0.35, train)
    assert (len(train), len(heldout)) == (30, 5) and not set(train) & set(heldout)
    assert (captured["cache_dir"], captured["use_cache"]) == ("somewhere", False)
    # The task's problems are seed 0's whatever the RL seed, so every run of a study shares one warm start
    assert (train, heldout) == make_splits(30, 5, digits=(2, 2), seed=0)
    train, heldout, _ = embedded.load_task(settings, 3)  # an explicit held-out count wins over the settings'
    assert (len(train), len(heldout)) == (30, 3)
    assert (captured["cache_dir"], captured["use_cache"]) == (None, True)  # cached by default
    assert EmbeddedSettings().warmup_target_accuracy == 0.5  # the first run starts RL from a half-right policy


class _SignalAt(embedded.TrainerCallback):
    """Sends this process `signum` at the end of optimizer step `step`, as a cluster's preemption would."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stopped_run_raises_and_writes_nothing_that_marks_it_finished(tmp_path, monkeypatch, signum):
    from dhpo_trl.training.trainer import DHPOTrainer

    init = DHPOTrainer.__init__

    def with_signal(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.add_callback(_SignalAt(1, signum))

    monkeypatch.setattr(DHPOTrainer, "__init__", with_signal)
    out = tmp_path / "run"
    with pytest.raises(embedded.TrainingStopped) as stopped:
        run_embedded("DHPO-E", seed=3, output_dir=out, cache_dir=tmp_path / "cache", settings=SHORT, disable_tqdm=True)
    assert stopped.value.args[1]["step"] == 1 and (out / "checkpoint-1").is_dir()  # the stop's own checkpoint
    assert stopped.value.exit_status == 128 + signum
    # a study reads summary.json as a finished cell; the final model marks a finished run
    assert not (out / "summary.json").exists() and not (out / "checkpoint-final").exists()
    # a pool worker hands the exception to the study's process: it must survive pickling with its stop
    again = pickle.loads(pickle.dumps(stopped.value))
    assert str(again) == str(stopped.value) and again.exit_status == 128 + signum


def test_the_cli_reports_a_stop_in_one_line_with_the_signals_status(tmp_path, monkeypatch, capsys):
    stop = {"signal": "SIGTERM", "step": 3, "checkpoint": str(tmp_path / "checkpoint-3")}

    def stopped(*args, **kwargs):
        raise embedded.TrainingStopped("stopped by SIGTERM after step 3 of 8 (checkpoint x)", stop)

    monkeypatch.setattr(embedded, "run_embedded", stopped)
    with pytest.raises(SystemExit) as exited:
        main(["--output-dir", str(tmp_path / "out")])
    assert exited.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SIGTERM after step 3" in err[0]


def test_the_cli_reports_a_nonfinite_gradient_in_one_line_with_status_1(tmp_path, monkeypatch, capsys):
    """As `dhpo-train`: the error's one line (the step it names) and exit status 1, no traceback; `--debug` prints
    the traceback instead, with the same status."""
    from dhpo_trl import NonFiniteGradientError

    def diverged(*args, **kwargs):
        raise NonFiniteGradientError(7, float("nan"), None, False)

    monkeypatch.setattr(embedded, "run_embedded", diverged)
    with pytest.raises(SystemExit) as exited:
        main(["--output-dir", str(tmp_path / "out")])
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m dhpo_trl: error: ") and "step 7" in err[0]
    with pytest.raises(SystemExit) as exited:
        main(["--output-dir", str(tmp_path / "out"), "--debug"])
    assert exited.value.code == 1 and capsys.readouterr().err.startswith("Traceback (most recent call last):\n")
