"""`--debug` on both training commands, `dhpo-train` and `python -m dhpo_trl`, through their `main(argv)`: every
error they report on one line (an input error, status 2; a non-finite gradient norm, status 1) is printed with its
whole traceback instead, down to the frame that raised it, and the exit status stays the same; `dhpo-train` releases
its process groups (without the barrier: a peer may be gone) either way."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import tiny_cli

from dhpo_trl.demo import embedded
from dhpo_trl.scale_out import cli
from dhpo_trl.training import nonfinite

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
