"""`--debug` on both training commands, `dhpo-train` and `python -m dhpo_trl`, through their `main(argv)`: every
error they report on one line (an input error, status 2; a non-finite gradient norm, status 1) is printed with its
whole traceback instead, down to the frame that raised it, and the exit status stays the same; `dhpo-train` releases
its process groups (without the barrier: a peer may be gone) either way. On every command that takes `--debug`, a
usage error (an unknown option, a value of the wrong type, a missing value) stays one line with status 2, with or
without it, as the help of `--debug` says."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tiny_cli

from dhpo_trl.demo import embedded
from dhpo_trl.evaluation import cli as evaluation_cli
from dhpo_trl.evaluation import plotting
from dhpo_trl.scale_out import cli
from dhpo_trl.training import nonfinite
from dhpo_trl.user_errors import DEBUG_HELP

TRACEBACK = "Traceback (most recent call last):\n"


def raised_in(err: str, function: str) -> bool:
    """Whether `err` holds a traceback frame of `function`, as the interpreter prints one."""
    return re.search(rf'^  File ".+", line \d+, in {re.escape(function)}$', err, re.MULTILINE) is not None


def diverge(*args, **kwargs):
    """A run whose gradient norm is NaN at optimizer step 3: the trainer's own check raises."""
    return nonfinite.checked(math.nan, 3, True)


class DivergingTrainer:
    """What `build_trainer` returns: its `train()` stops on a NaN gradient norm, as DHPOTrainer's."""

    args = SimpleNamespace(resume_from_checkpoint=None, output_dir="out", push_to_hub=False)
    graceful_stop = None

    def train(self, **kwargs):
        diverge()


def dhpo_train_main(argv):
    """`dhpo-train`'s status, exiting as the command does (no heap scan of this process: tests/tiny_cli.py)."""
    with tiny_cli.exits_as_the_command():
        return cli.main(argv)


def dhpo_train_input_error(tmp_path, monkeypatch, debug):
    return dhpo_train_main(["--config", str(tmp_path / "missing.yaml"), *debug]), "_read_config"


def dhpo_train_nonfinite(tmp_path, monkeypatch, debug):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(cli, "parse_args", lambda argv: (SimpleNamespace(dataset_name="org/math"), None, None))
    monkeypatch.setattr(cli, "build_trainer", lambda *args: DivergingTrainer())
    return dhpo_train_main(debug), "checked"


def embedded_main(argv):
    """`python -m dhpo_trl`'s status: main's return value, or the SystemExit code it raises."""
    try:
        return embedded.main(argv)
    except SystemExit as exited:
        return exited.code


def embedded_input_error(tmp_path, monkeypatch, debug):
    monkeypatch.setattr(embedded, "run_embedded", lambda *args, **kwargs: pytest.fail("ran despite bad input"))
    (tmp_path / "file").write_text("")
    return embedded_main(["--output-dir", str(tmp_path / "file" / "x"), *debug]), "make_folder"


def embedded_nonfinite(tmp_path, monkeypatch, debug):
    monkeypatch.setattr(embedded, "run_embedded", diverge)
    return embedded_main(["--output-dir", str(tmp_path / "out"), *debug]), "checked"


CASES = {
    "dhpo-train input error": (dhpo_train_input_error, "dhpo-train", 2, [False]),
    "dhpo-train non-finite": (dhpo_train_nonfinite, "dhpo-train", 1, [False]),
    "python -m dhpo_trl input error": (embedded_input_error, "python -m dhpo_trl", 2, []),
    "python -m dhpo_trl non-finite": (embedded_nonfinite, "python -m dhpo_trl", 1, []),
}


@pytest.mark.parametrize("case", CASES)
def test_debug_prints_the_whole_traceback_with_the_same_exit_status(case, tmp_path, monkeypatch, capsys):
    run, prog, status, releases = CASES[case]
    released = []  # the `barrier` of each release of the process groups, which still runs
    release = cli.release_process_groups
    monkeypatch.setattr(
        cli, "release_process_groups", lambda barrier: released.append(barrier) or release(barrier=barrier)
    )
    plain, _ = run(tmp_path, monkeypatch, [])
    assert plain == status and released == releases
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and line.startswith(f"{prog}: error: ")  # one line, no traceback
    released.clear()
    shown, frame = run(tmp_path, monkeypatch, ["--debug"])
    assert shown == status and released == releases  # a script reading the status sees no difference
    err = capsys.readouterr().err
    assert err.startswith(TRACEBACK) and raised_in(err, frame), err[-2000:]
    assert f"{prog}: error: " not in err  # the traceback instead of the line, not both


class CrashingTrainer(DivergingTrainer):
    """What `build_trainer` returns: its `train()` raises `error`, a bug or an interrupt rather than a user error."""

    def __init__(self, error: BaseException):
        self.error = error

    def train(self, **kwargs):
        raise self.error


@pytest.mark.parametrize("error", [RuntimeError("a bug in training"), KeyboardInterrupt()], ids=["bug", "interrupt"])
@pytest.mark.parametrize("debug", [[], ["--debug"]], ids=["plain", "debug"])
def test_dhpo_train_releases_its_process_groups_before_a_bug_or_an_interrupt_leaves(error, debug, monkeypatch):
    released = []  # the `barrier` of each release of the process groups
    monkeypatch.setattr(cli, "release_process_groups", lambda barrier: released.append(barrier) or [])
    monkeypatch.setattr(cli, "parse_args", lambda argv: (SimpleNamespace(dataset_name="org/math"), None, None))
    monkeypatch.setattr(cli, "build_trainer", lambda *args: CrashingTrainer(error))
    with pytest.raises(type(error)) as raised:
        cli.main(debug)
    assert raised.value is error  # the same error leaves main, with its traceback, for the interpreter to print
    assert released == [False]  # released once, without a barrier: the crashed peer may never arrive


def exit_status(main):
    """`main(argv)`'s status: its return value, or the SystemExit code it raises (argparse's usage errors)."""

    def status(argv):
        try:
            return main(argv)
        except SystemExit as exited:
            return exited.code

    return status


evaluate_main, plot_main, dhpo_train_status = map(exit_status, (evaluation_cli.main, plotting.main, dhpo_train_main))


def load_study(name):
    """`benchmarks/NAME.py`, a script outside the package."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


study, staleness = load_study("study"), load_study("staleness")
# command: (main(argv) -> status, its prog, the function that would start its work); the studies' prog is their
# file's name, as `python benchmarks/NAME.py` runs them
COMMANDS = {
    "dhpo-train": (dhpo_train_status, "dhpo-train", (cli, "build_trainer")),
    "dhpo-evaluate": (evaluate_main, "dhpo-evaluate", (evaluation_cli, "evaluate")),
    "dhpo-plot": (plot_main, "dhpo-plot", (plotting, "plot_runs")),
    "python -m dhpo_trl": (embedded_main, "python -m dhpo_trl", (embedded, "run_embedded")),
    "study.py": (exit_status(study.cli), "study.py", (study, "run_embedded")),
    "staleness.py": (exit_status(staleness.cli), "staleness.py", (staleness, "run_embedded")),
}
# (command, argv, the option its error names): an unknown option, a value of the wrong type, a missing value
USAGE_ERRORS = [
    ("dhpo-train", ["--max_steps", "2", "--bogus_flag", "1"], "--bogus_flag"),  # dhpo-train's own check, past argparse
    ("dhpo-train", ["--max_steps", "two"], "--max_steps"),
    ("dhpo-evaluate", ["model", "--bogus-flag"], "--bogus-flag"),
    ("dhpo-evaluate", ["model", "--batch-size", "eight"], "--batch-size"),
    ("dhpo-plot", ["run", "--out", "plots", "--bogus-flag"], "--bogus-flag"),
    ("dhpo-plot", ["run", "--out"], "--out"),
    ("python -m dhpo_trl", ["--bogus-flag"], "--bogus-flag"),
    ("python -m dhpo_trl", ["--seed", "one"], "--seed"),
    ("study.py", ["--bogus-flag"], "--bogus-flag"),
    ("study.py", ["--workers", "two"], "--workers"),
    ("staleness.py", ["--bogus-flag"], "--bogus-flag"),
    ("staleness.py", ["--ks", "2", "four"], "--ks"),
]


@pytest.mark.parametrize("debug", [[], ["--debug"]], ids=["plain", "debug"])
@pytest.mark.parametrize(("command", "argv", "option"), USAGE_ERRORS, ids=[f"{c} {o}" for c, _, o in USAGE_ERRORS])
def test_a_usage_error_is_one_line_with_status_2_with_or_without_debug(command, argv, option, debug, monkeypatch,
                                                                       capsys):  # fmt: skip
    """Its traceback would show the parser only: the line (after argparse's usage) names the option, under the
    command's own name, and nothing else runs."""
    main, prog, (module, work) = COMMANDS[command]
    # A study's prog is its file's name; the others name themselves, also when launched as a file of another name
    # (`accelerate launch dhpo_trl/scale_out/cli.py`).
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{prog}" if prog.endswith(".py") else "dhpo_trl/scale_out/cli.py"])
    monkeypatch.setattr(module, work, lambda *args, **kwargs: pytest.fail(f"{command} ran despite a usage error"))
    assert main([*argv, *debug]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith(f"{prog}: error: ") and option in errors[0] and err.endswith(errors[0] + "\n"), err


def test_the_help_of_debug_says_a_usage_error_stays_one_line(monkeypatch, capsys):
    """What the usage-error test checks is what `--help` promises, on each command that documents `--debug`."""
    for main in (evaluate_main, plot_main, embedded_main, exit_status(study.cli), exit_status(staleness.cli)):
        assert main(["--help"]) == 0
        help_text = " ".join(capsys.readouterr().out.split())
        assert " ".join(DEBUG_HELP.split()) in help_text and "usage error" in DEBUG_HELP
    monkeypatch.setattr(cli.sys, "argv", ["dhpo-train"])
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "except for a usage error" in " ".join(capsys.readouterr().out.split())
