"""`dhpo_trl.demo.cell_pool`: an error in the block ends every worker of the pool, a replacement for a worker that
ended included, even those that took the pool's SIGTERM as a graceful stop (as `run_embedded` does), and the block does
not hang on them; another child of the main process is left alone. A cell lost in a task (its worker SIGKILLed, its
`os._exit(0)`, its `SystemExit(0)`) ends the block with one line from `reported` and status 1 instead of a `Pool.map`
that waits forever, and so does a worker that dies as it starts, before it reports (its import of the driver failing in
the worker only, a SIGKILL, its initializer raising), instead of a pool that replaces it forever; the pool's own
SIGTERMs at the end are no death; `close` and `terminate` are refused.

The pool runs in a driver script of its own (the spawned workers import it, as `__mp_main__`, for the task), so a
hanging stop fails this test by its timeout instead of hanging pytest. Two workers: one to end (or die, or lose its
cell), one in a graceful task that only a SIGKILL ends, or idle."""

from __future__ import annotations

import errno
import functools
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import processes
import pytest

import dhpo_trl.demo.cell_pool as cell_pool_module
from dhpo_trl.demo.cell_pool import (
    NAME_CHARACTERS,
    Cell,
    CellExited,
    CellFailed,
    CellPool,
    Watchdog,
    WorkerContext,
    WorkerDied,
    WorkerNotStarted,
    close,
    death_message,
    drain,
    report_worker,
    reported,
    start_message,
    worker_end,
)
from dhpo_trl.demo.stops import TrainingStopped

REPO = Path(__file__).resolve().parents[1]
DRIVER = """
import argparse, errno, functools, multiprocessing, os, signal, sys, threading, time
from pathlib import Path
sys.path[:0] = [{repo!r}]
import dhpo_trl.demo.cell_pool as cell_pool_module
from dhpo_trl.demo.cell_pool import POLL_SECONDS, CellExited, cell_pool, reported

if __name__ == "__mp_main__":  # a pool's worker, importing this script as it starts: it fails before it reports
    if sys.argv[2] == "import fails":  # a module that only the spawned worker imports, missing
        import a_module_missing_in_the_worker
    elif sys.argv[2] == "killed starting":  # the OOM killer, as a worker imports torch
        os.kill(os.getpid(), signal.SIGKILL)
    elif sys.argv[2] == "initializer raises":
        def refuse(started):
            raise OSError("the worker's setup failed")
        cell_pool_module.report_worker = refuse  # the initializer the pool unpickles in the worker
    elif sys.argv[2] == "idle death" and Path(sys.argv[1]).with_name("replacing").exists():
        time.sleep(300)  # the replacement for the killed worker imports slowly (torch): unreported at the block's end


def stop_gracefully(folder):
    # A cell's side of a stop: SIGTERM only asks, the task returns and the worker waits for the next task.
    stopped = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    Path(folder, str(os.getpid())).touch()
    while not stopped:
        time.sleep(0.05)
    signal.signal(signal.SIGTERM, previous)
    return os.getpid()


def exit_zero(folder):
    # A cell that ends its worker with exit status 0, as os._exit(0) in a library does.
    Path(folder, str(os.getpid())).touch()
    os._exit(0)


def parse_help(folder, name="cell"):
    # A cell that parses a command line with argparse: --help raises SystemExit(0).
    Path(folder, str(os.getpid())).touch()
    argparse.ArgumentParser(prog=name).parse_args(["--help"])


def divide(folder, by):
    # A cell with a bug: a ZeroDivisionError, which the previous pool's map raised as a traceback.
    Path(folder, str(os.getpid())).touch()
    return 1 / by


def run_until_terminated(folder):
    # A cell with no stop handler: the pool's SIGTERM at the stop ends its worker (-15), which is no death.
    Path(folder, str(os.getpid())).touch()
    time.sleep(300)


def wait_for(folder, count):
    while len(os.listdir(folder)) < count:
        time.sleep(0.1)


def block(folder, case):
    global lost
    if case == "error":  # no poll: a worker's end leaves a replacement for the stop to kill
        cell_pool_module.POLL_SECONDS = 300
    children_ended = []
    def on_child(signum, frame):  # the program's own SIGCHLD handler, which the block's must call on
        children_ended.append(signum)
    if case == "end":
        signal.signal(signal.SIGCHLD, on_child)
    with cell_pool(2) as pool:
        if case == "end":  # a block that ends normally, a worker in a task, one idle: no error, the results kept
            print(pool.map(abs, [-2, 3], chunksize=1))
            for name, end in [("close", pool.close), ("terminate", pool.terminate), ("with", lambda: pool.__exit__(
                    None, None, None))]:  # each would end the workers while the block runs
                try:
                    end()
                except RuntimeError:
                    print(name, "refused")
            print(pool.map(abs, [-4], chunksize=1))  # the pool runs on
            time.sleep(3 * POLL_SECONDS)  # the watchdog polls the idle workers
            signal.raise_signal(signal.SIGCHLD)  # another child of the program ended
            print("chained", children_ended)
            pool.apply_async(stop_gracefully, (folder,))
            wait_for(folder, 1)  # the stop waits the grace for it: a watchdog running on would see the idle one end
        elif case == "error":
            pool.apply_async(exit_zero, (folder,))  # the pool starts a replacement
            pool.apply_async(run_until_terminated, (folder,))  # the other worker; the replacement takes the next
            pool.apply_async(stop_gracefully, (folder,))
            wait_for(folder, 3)  # the replacement is in a graceful task
            raise RuntimeError("a cell failed")
        elif case == "stop while closing":  # a stop signal as the block's end closes the pool (its grace for a cell)
            pool.apply_async(stop_gracefully, (folder,))
            wait_for(folder, 1)
            lost = time.monotonic()
            threading.Timer(2 * POLL_SECONDS, os.kill, (os.getpid(), signal.SIGTERM)).start()
            raise RuntimeError("a cell failed")
        elif case == "system exit":  # argparse's --help in a cell, through each of the pool's ways to run a task
            pool.apply_async(stop_gracefully, (folder,))
            wait_for(folder, 1)
            for name, call in [
                ("apply", lambda: pool.apply(parse_help, (folder,))),
                ("apply_async", lambda: pool.apply_async(parse_help, (folder,)).get()),
                ("map", lambda: pool.map(parse_help, [folder])),
                ("map_async", lambda: pool.map_async(parse_help, [folder]).get()),
                ("imap", lambda: list(pool.imap(parse_help, [folder]))),
                ("imap_unordered", lambda: list(pool.imap_unordered(parse_help, [folder]))),
                ("starmap_async", lambda: pool.starmap_async(parse_help, [(folder,)]).get()),
            ]:
                try:
                    call()
                except CellExited:  # the worker lives on and takes the next task
                    print("exited", name)
            lost = time.monotonic()
            pool.starmap(parse_help, [(folder, "cell-7")])
        elif case == "cell raises":  # the other worker in a graceful task, stopped with the pool
            pool.apply_async(stop_gracefully, (folder,))
            wait_for(folder, 1)
            lost = time.monotonic()
            list(pool.imap_unordered(functools.partial(divide, folder), [0]))
        elif case == "idle death":  # a worker killed as it waits for a task, holding the task queue's lock
            result = pool.apply_async(stop_gracefully, (folder,))
            wait_for(folder, 1)
            time.sleep(3 * POLL_SECONDS)  # the other worker waits for a task
            busy = int(os.listdir(folder)[0])
            idle = [child for child in multiprocessing.active_children()
                    if "PoolWorker" in child.name and child.pid != busy]  # fmt: skip
            Path(folder).with_name("replacing").touch()
            lost = time.monotonic()
            os.kill(idle[0].pid, signal.SIGKILL)
            result.get()
        elif case == "start refused 3":  # a cell ends its worker; the pool's thread cannot start its replacement
            pool.apply_async(exit_zero, (folder,)).get()
        elif case.startswith("start refused"):  # the pool's constructor cannot start its workers: no block
            raise AssertionError("the block ran")
        elif case in ("import fails", "killed starting", "initializer raises", "exec fails"):  # each replacement too
            lost = time.monotonic()
            pool.map(abs, [-1, 2], chunksize=1)
        else:  # a worker killed (SIGKILL) or ended (exit status 0) in a task, which `Pool.map` waits for forever
            if case == "exit 0":
                pool.apply_async(stop_gracefully, (folder,))
                wait_for(folder, 1)
                time.sleep(3 * POLL_SECONDS)  # the watchdog polled both workers alive before the cell ends one
                lost = time.monotonic()
                result = pool.imap_unordered(exit_zero, [folder])
            else:
                result = pool.map_async(stop_gracefully, [folder, folder], chunksize=1)
            wait_for(folder, 2)  # the cells are in their tasks
            if case == "death":
                lost = time.monotonic()
                os.kill(int(sorted(os.listdir(folder))[0]), signal.SIGKILL)
            result.get() if case == "death" else list(result)
    if case == "end":
        print("restored", signal.getsignal(signal.SIGCHLD) is on_child)
    return 0


def refuse_start(refused):
    # The system refusing the `refused`-th process started from here on (fork or spawn failing with EAGAIN).
    start, starts = multiprocessing.process.BaseProcess.start, []

    def refusing(process):
        starts.append(process)
        if len(starts) == refused:
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        start(process)

    multiprocessing.process.BaseProcess.start = refusing


if __name__ == "__main__":
    folder, case = sys.argv[1:3]  # then --debug, read by `reported`
    lost = None
    bystander = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,), daemon=True)
    bystander.start()  # a child of this process that is none of the pool's
    if case == "exec fails":  # the interpreter gone (a venv rebuilt under a running study): each spawn's exec fails
        from multiprocessing import resource_tracker
        resource_tracker.ensure_running()  # started by the first lock, before the interpreter went
        multiprocessing.spawn.set_executable(str(Path(folder).with_name("removed-python")))
    if case.startswith("start refused"):  # the pool's first, second or third start (the replacement for a death)
        refuse_start(int(case.split()[-1]))
        lost = time.monotonic()
    try:
        code = reported(lambda argv: block(folder, case), None, "[driver]")  # 1: a cell lost, reported on one line
    except RuntimeError:
        code = 3
    left = [child.name for child in multiprocessing.active_children() if child is not bystander]
    print("left after the block:", left)  # before the interpreter's exit, which would terminate them
    print(-1.0 if lost is None else time.monotonic() - lost)
    alive = bystander.is_alive()
    bystander.kill()
    sys.exit(code if alive else 4)
"""


def _alive(pid: int) -> bool:
    stat = processes._stat(pid)
    return stat is not None and stat[2] != "Z"


def _marked(marker: str) -> list[int]:
    """The live processes whose environment holds `marker` (the driver's and its children, orphans included)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/environ").read_bytes():
                found.append(int(entry))
        except OSError:
            pass
    return [pid for pid in found if _alive(pid)]


def _drive(tmp_path, case: str, *flags: str, timeout: float = 240) -> tuple[int, str, str, list[int]]:
    """Run the driver's `case` with the command-line `flags`; (its exit status, stdout, stderr, the pids of the workers
    that ran a task). Asserts that no worker outlives the block and no process it started outlives it; a driver still
    running after `timeout` seconds (a hang) fails, its process tree killed."""
    driver, folder = tmp_path / "driver.py", tmp_path / "started"
    driver.write_text(DRIVER.format(repo=str(REPO)))
    folder.mkdir()
    marker = f"CELL_POOL_TEST={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    pool = processes.popen([sys.executable, str(driver), str(folder), case, *flags], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        stdout, stderr = pool.communicate(timeout=timeout)  # a stop that waits for a worker never ends
        left = time.monotonic() + 10  # the bystander's SIGKILL lands asynchronously
        while _marked(marker) and time.monotonic() < left:
            time.sleep(0.1)
        assert _marked(marker) == [], stderr  # the driver exited: none of its workers, replacements included, is left
        # nor did any outlive the block (the interpreter's exit terminates the daemonic ones: a later command would
        # run beside them, and a main process killed outright would orphan them)
        assert "left after the block: []" in stdout.splitlines(), (stdout, stderr)
        return pool.returncode, stdout, stderr, [int(name) for name in os.listdir(folder)]
    finally:
        processes.kill_tree(pool, grace=1)


def test_an_error_in_the_block_ends_every_worker_a_replacement_included(tmp_path):
    status, _, stderr, workers = _drive(tmp_path, "error")
    # 3: the block's error, raised after the workers are gone; 4: the stop killed a child of the main process that was
    # not the pool's
    assert status == 3, stderr
    assert len(workers) == 3, workers  # two workers and the replacement ran a task


def test_a_stop_signal_as_the_blocks_end_closes_the_pool_ends_the_study_as_a_stop_once_the_pool_is_closed(tmp_path):
    """A first SIGTERM to the main process while the block's end closes the pool (here in the grace for a worker in a
    graceful task, after an error in the block) neither ends the main process at once, orphaning that worker, nor
    leaves the close half done: the pool is closed as without it, then the stop ends the study as a stop, on one line
    with status 128 + SIGTERM."""
    status, stdout, stderr, workers = _drive(tmp_path, "stop while closing", timeout=60)
    lines = [line for line in stderr.splitlines() if line.startswith("[driver] ")]
    assert status == 128 + signal.SIGTERM and len(lines) == 1 and "SIGTERM" in lines[0], (status, stderr)
    assert 0 <= float(stdout.split()[-1]) < 30 and len(workers) == 1, (stdout, workers)


def test_a_block_that_ends_normally_keeps_its_results_and_leaves_no_worker(tmp_path):
    """Its results kept; `close`, `terminate` and `with pool:` refused, the pool running on; the program's own SIGCHLD
    handler called in the block and restored after; the pool's own SIGTERMs and sentinels at the end, during the
    stop's grace for a worker in a graceful task, are no death."""
    status, stdout, stderr, _ = _drive(tmp_path, "end")
    assert status == 0, stderr  # 1: the pool's end, or a close, taken for a death
    refused = ["close refused", "terminate refused", "with refused"]
    # The program's own SIGCHLD handler ran in the block (called by the block's) and is its handler again after.
    chained = [f"chained [{int(signal.SIGCHLD)}]", "restored True"]
    assert stdout.split("\n")[:7] == ["[2, 3]", *refused, "[4]", *chained], stdout


@pytest.mark.parametrize("case", ["death", "idle death", "exit 0", "system exit"])
def test_a_cell_lost_in_a_task_ends_the_block_on_one_line_with_status_1(tmp_path, case):
    """A worker SIGKILLed in a task or as it waits for one (holding the lock of the pool's task queue, which the
    pool's terminate takes), a cell's `os._exit(0)` (through `imap_unordered`) and its `SystemExit(0)` (argparse's
    --help, through `starmap`): `reported` prints one line naming the worker, its exit status, or the cell and what it
    raised, and returns 1 within seconds, not a `Pool.map` or a terminate that waits forever; the other worker, in a
    graceful task, is ended too, and so is the pool's replacement for the idle one, still starting (a slow import)
    when the terminate is given up. Before the last, the `SystemExit(0)` of a cell run each other way the pool has
    reaches the block as `CellExited`, its worker living on."""
    status, stdout, stderr, workers = _drive(tmp_path, case)
    lines = [line for line in stderr.splitlines() if line.startswith("[driver] ")]
    assert status == 1 and len(lines) == 1, stderr  # not a hang (the timeout) nor a traceback; 4: a bystander killed
    assert 0 <= float(stdout.split()[-1]) < 30  # from the loss to the block's end: a poll, the stop's grace, the joins
    assert len(workers) == (1 if case == "idle death" else 2), workers
    if case == "system exit":
        exited = [line.removeprefix("exited ") for line in stdout.splitlines() if line.startswith("exited ")]
        assert exited == ["apply", "apply_async", "map", "map_async", "imap", "imap_unordered", "starmap_async"]
        assert "parse_help(" in lines[0] and "'cell-7'" in lines[0] and "SystemExit(0)" in lines[0], lines
    else:
        lost = {"death": [sorted(workers)[0]], "exit 0": workers}.get(case)  # the pid killed; either cell's for exit 0
        exitcode = 0 if case == "exit 0" else -signal.SIGKILL
        # The workers are the driver's second and third processes (the bystander is its first); its exit status is
        # known also when the pool reaped it before the watchdog looked.
        if lost is None:  # the idle worker: the one that ran no task
            lost = [int(re.search(r"\(pid (\d+)\)", lines[0])[1])]
            assert lost[0] not in workers, (lines, workers)
        died = [death_message(f"SpawnPoolWorker-{n}", pid, exitcode) for n in (2, 3) for pid in lost]
        assert lines[0].removeprefix("[driver] ") in died, lines


@pytest.mark.parametrize(
    ("case", "exitcode"), [("import fails", 1), ("killed starting", -signal.SIGKILL), ("initializer raises", 1)]
)
def test_a_worker_that_dies_before_it_reports_ends_the_block_on_one_line_with_status_1(tmp_path, case, exitcode):
    """Every worker fails as it starts, before its report, and so would each replacement the pool makes for it: an
    import of the main script that fails in the spawned worker only, a SIGKILL as it imports (the OOM killer), the
    pool's initializer raising. The block ends within seconds, not by the timeout (the pool would replace its
    workers forever), with one line from `reported` saying that a worker died while it started, with its exit status
    or signal, and status 1; no worker is left and no cell ran."""
    status, stdout, stderr, workers = _drive(tmp_path, case, timeout=60)
    lines = [line for line in stderr.splitlines() if line.startswith("[driver] ")]
    assert status == 1 and len(lines) == 1, stderr  # 4: a bystander killed
    assert 0 <= float(stdout.split()[-1]) < 30 and workers == [], (stdout, workers)
    named = re.search(r" worker (SpawnPoolWorker-\d+) \(pid (\d+)\) ", lines[0])
    assert named, lines
    # Not a cell lost: what to fix before the rerun.
    assert lines[0].removeprefix("[driver] ") == death_message(named[1], int(named[2]), exitcode, False), lines
    if exitcode > 0:  # the worker's own traceback is above the line
        assert ("ModuleNotFoundError" if case == "import fails" else "OSError: the worker's setup failed") in stderr


def test_a_worker_whose_interpreter_cannot_run_ends_the_block_on_one_line_naming_it(tmp_path):
    """The spawn's exec of the interpreter fails (gone, not executable, no memory to load it): `Process.start` does
    not raise and the worker ends with status 255 before any Python runs, so it prints no traceback. The block ends
    within seconds with one line, status 1, naming the worker's exit status and the interpreter that could not run,
    and pointing to no traceback."""
    status, stdout, stderr, workers = _drive(tmp_path, "exec fails", timeout=60)
    lines = [line for line in stderr.splitlines() if line.startswith("[driver] ")]
    assert status == 1 and len(lines) == 1 and workers == [], (stderr, workers)
    assert 0 <= float(stdout.split()[-1]) < 30, stdout
    assert "(exit status 255)" in lines[0] and str(tmp_path / "removed-python") in lines[0], lines
    assert "Traceback" not in stderr and "traceback above" not in lines[0], stderr


@pytest.mark.parametrize("refused", [1, 2, 3])
def test_a_worker_the_system_refuses_to_start_ends_the_block_on_one_line_with_status_1(tmp_path, refused):
    """`Process.start` raising OSError (EAGAIN: too many processes) for the pool's first worker, its second (the
    first started, then ended by the pool), or the replacement for a worker whose cell ended it (started by the
    pool's own thread, which the error ends): the block ends within seconds with one line from `reported` naming the
    worker that could not start and the error, and status 1; no worker is left. For the replacement, the death that
    asked for it may be the line instead, when the watchdog polls between the two."""
    status, stdout, stderr, workers = _drive(tmp_path, f"start refused {refused}", timeout=60)
    lines = [line for line in stderr.splitlines() if line.startswith("[driver] ")]
    assert status == 1 and len(lines) == 1, stderr  # not a traceback; 4: a bystander killed
    assert 0 <= float(stdout.split()[-1]) < 30 and len(workers) == (refused == 3), (stdout, workers)
    # The pool's workers are the driver's second process on (the bystander is its first).
    refusal = start_message(f"SpawnPoolWorker-{refused + 1}", OSError(errno.EAGAIN, os.strerror(errno.EAGAIN)))
    deaths = [death_message(f"SpawnPoolWorker-{n}", pid, 0) for n in (2, 3) for pid in workers]
    assert lines[0].removeprefix("[driver] ") in [refusal, *(deaths if refused == 3 else [])], lines


def test_a_refused_start_names_the_worker_and_the_error_on_one_line():
    """`start_message`: the worker, the error's type and errno name (its number where it has none), its message on
    one line, and what to do: fewer workers or free memory, then the same command."""
    for error, shown in [(OSError(errno.EAGAIN, os.strerror(errno.EAGAIN)), "BlockingIOError EAGAIN: "),
                         (OSError(errno.ENOMEM, "Cannot\nallocate memory"), "OSError ENOMEM: Cannot allocate memory"),
                         (OSError("no errno"), "OSError: no errno")]:  # fmt: skip
        message = start_message("SpawnPoolWorker-4", error)
        assert "\n" not in message and f"worker SpawnPoolWorker-4 could not start ({shown}" in message, message
        assert "fewer workers" in message and "rerun the same command" in message, message


def test_the_watchdog_reports_a_refused_start_before_any_death():
    """`Watchdog.first_end`: a worker whose start raised (`start_error`, set by the pool's context) is reported as such,
    before a worker that died (the death that asked for its replacement), which it is reported as without one."""
    started = multiprocessing.get_context("fork").SimpleQueue()
    try:
        refused = _Ended(9, None)
        refused.start_error = OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        watchdog = Watchdog(started, [_Ended(7, 0), refused], threading.main_thread().ident)
        end = watchdog.first_end()
        assert isinstance(end, WorkerNotStarted) and str(end) == start_message("SpawnPoolWorker-9", refused.start_error)
        watchdog.workers.pop()
        end = watchdog.first_end()
        assert type(end) is WorkerDied and str(end) == death_message("SpawnPoolWorker-7", 7, 0, False)
    finally:
        started.close()


def test_the_pools_context_keeps_the_error_of_a_start_the_system_refused(monkeypatch):
    """`WorkerContext.Process` makes `SpawnProcess`es, named as the spawn context's, whose `start` keeps the OSError
    it raises (and raises it); another error is not kept."""
    context = WorkerContext()
    process = context.Process(target=time.sleep, args=(0,))
    assert context.workers == [process] and process.name.startswith("SpawnProcess-") and process.start_error is None
    refusal = OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", lambda self: (_ for _ in ()).throw(refusal))
    with pytest.raises(OSError) as raised:
        process.start()
    assert raised.value is refusal and process.start_error is refusal
    other = context.Process(target=time.sleep, args=(0,))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", lambda self: (_ for _ in ()).throw(ValueError()))
    with pytest.raises(ValueError):
        other.start()
    assert other.start_error is None


def test_the_pools_context_starts_the_process_the_pool_asks_for():
    """`WorkerContext.Process` as the pool calls it (`Pool.Process`: keywords only): the spawned process runs its
    target with its arguments under its name, as the spawn context's would."""
    context = WorkerContext()
    process = context.Process(target=sys.exit, args=(3,), name="SpawnPoolWorker-7")
    assert context.workers == [process] and process.name == "SpawnPoolWorker-7"
    process.start()
    process.join(60)
    assert process.exitcode == 3  # sys.exit(3) ran in the worker


def test_under_debug_a_cells_system_exit_shows_where_the_cell_raised_it(tmp_path):
    """`--debug` on the command line: `reported` prints the traceback of `CellExited` instead of the line, with the
    same status 1, and the pool's remote traceback in it shows the frame in the worker that raised `SystemExit`."""
    status, _, stderr, _ = _drive(tmp_path, "system exit", "--debug")
    last = stderr.rstrip("\n").split("\n")[-1]
    assert status == 1 and "Traceback (most recent call last):\n" in stderr and "[driver] " not in stderr, stderr
    assert re.search(r'^  File ".+", line \d+, in parse_help$', stderr, re.MULTILINE), stderr  # in the worker
    assert last.startswith("dhpo_trl.demo.cell_pool.CellExited: "), last  # the error, not the cause, comes last
    assert "parse_help(" in last and "'cell-7'" in last and "SystemExit(0)" in last, last


@pytest.mark.parametrize("flags", [[], ["--debug"]], ids=["line", "debug"])
def test_a_cell_that_raises_ends_the_block_on_one_line_or_under_debug_with_the_workers_traceback(tmp_path, flags):
    """A cell's `ZeroDivisionError` ends the block within seconds with status 1, the other worker's cell stopped
    with the pool: one line naming the cell, its arguments and what it raised; under `--debug`, the traceback
    instead, whose remote part shows the frame in the worker that raised it, `CellFailed` last."""
    status, stdout, stderr, workers = _drive(tmp_path, "cell raises", *flags, timeout=60)
    lines = [line for line in stderr.splitlines() if line.startswith("[driver] ")]
    assert status == 1 and 0 <= float(stdout.split()[-1]) < 30 and len(workers) == 2, (stdout, stderr, workers)
    last = stderr.rstrip("\n").split("\n")[-1]
    if not flags:
        assert len(lines) == 1 and "Traceback" not in stderr, stderr
        assert f"divide({str(tmp_path / 'started')!r}, 0) raised ZeroDivisionError(" in lines[0], lines
        return
    assert lines == [] and re.search(r'^  File ".+", line \d+, in divide$', stderr, re.MULTILINE), stderr
    assert "ZeroDivisionError: division by zero" in stderr, stderr
    assert last.startswith("dhpo_trl.demo.cell_pool.CellFailed: ") and "started', 0) raised" in last, last


def _raises(error):
    def main(argv):
        raise error

    return main


@pytest.mark.parametrize("given", ["argv", "command line"])
def test_reported_prints_a_lost_cell_or_a_stop_on_one_line_or_under_debug_its_traceback(given, monkeypatch, capsys):
    """`reported`: `main`'s status; a lost cell's (`WorkerDied`, `CellExited`) 1, a stop's 128 + its signal, after
    one line `<prefix> <message>`, or with `--debug` (in `argv` whatever the command line says, or on the command line
    when `argv` is None) the error's traceback instead, down to `main`'s frame, with the same status."""
    assert reported(lambda argv: 0, [], "[study]") == 0 and reported(len, ["--seeds", "0"], "[study]") == 2
    stop = TrainingStopped("stopped by SIGUSR1: the cells in progress are not saved", {"signal": "SIGUSR1"})
    for error, status in [(CellExited("a cell raised SystemExit(0)"), 1), (WorkerDied("a worker died"), 1),
                          (stop, 128 + signal.SIGUSR1)]:  # fmt: skip
        for flags in ([], ["--seeds", "0", "--debug"], ["--debug", "--seeds", "0"]):
            # `argv` given: the command line, which says the opposite, is not read
            command_line = flags if given == "command line" else [] if flags else ["--debug"]
            monkeypatch.setattr(sys, "argv", ["study.py", *command_line])
            assert reported(_raises(error), flags if given == "argv" else None, "[study]") == status
            err = capsys.readouterr().err
            if flags:
                assert err.startswith("Traceback") and re.search(r", in main$", err, re.MULTILINE), err
                assert err.endswith(f"{type(error).__name__}: {error}\n") and "[study]" not in err, err
            else:
                assert err.startswith(f"[study] {error}") and err.count("\n") == 1, err


@pytest.mark.parametrize("flags", [["--debug"], ["--workers", "2", "--deb"]], ids=["debug", "abbreviated"])
def test_under_debug_reported_traces_a_lost_cell_and_mains_own_one_line_error(flags, capsys):
    """`--debug` as the study's argparse reads it (`--deb` too) acts: a lost cell's traceback, and `main`'s own
    one-line error (a `SystemExit` with a message, as study.py's refusal of a run of another budget) traced with the
    interpreter's status 1; without it that `SystemExit` leaves `reported` as it came, and argparse's usage error (a
    number) does either way."""
    budget = SystemExit("outputs/study/GRPO-seed0/summary.json ran 3 optimizer steps, not --max-steps 4")
    assert reported(_raises(WorkerDied("a worker died")), flags, "[study]") == 1
    assert capsys.readouterr().err.startswith("Traceback"), flags
    assert reported(_raises(budget), flags, "[study]") == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith(f"SystemExit: {budget}\n"), err
    for argv, error in [([], budget), (flags, SystemExit(2))]:
        with pytest.raises(SystemExit) as raised:
            reported(_raises(error), argv, "[study]")
        assert raised.value is error and capsys.readouterr().err == ""


def test_the_watchdog_reads_every_report_waiting_each_a_workers_pid_and_name():
    """`drain` adds every report waiting on the queue to those read before and empties it; `report_worker` puts the
    worker's pid and process name, as its `Process` in the main process has them (what the watchdog matches)."""
    context = multiprocessing.get_context("fork")
    started = context.SimpleQueue()
    try:
        for report in [(11, "SpawnPoolWorker-1"), (12, "SpawnPoolWorker-2"), (13, "SpawnPoolWorker-3")]:
            started.put(report)
        before = {(10, "SpawnPoolWorker-0")}
        assert drain(started, before) is before and started.empty()
        assert before == {(10 + n, f"SpawnPoolWorker-{n}") for n in range(4)}
        child = _reported_child(context, started, lambda: None)
        child.join(10)
        assert drain(started, set()) == {(child.pid, child.name)} and started.empty()
    finally:
        started.close()


def _reported_child(context, started, then):
    """A fork child that reports itself on `started` as a pool's worker does, then runs `then()`; returned once its
    report is on the queue."""
    child = context.Process(target=lambda: (report_worker(started), then()), daemon=True)
    child.start()
    while started.empty():
        time.sleep(0.01)
    return child


def test_the_watchdog_reports_the_first_worker_that_died_reported_or_not_and_nothing_else():
    """`Watchdog.check` (its polls, called directly) on the workers a pool made (`workers`): one that lives, or is
    not started yet, is no death; one that ended is, with its exit status 0 or its signal, also when the pool reaped
    it before any poll saw it, and said to have died while it started when it never reported (its import, its
    initializer or a kill as it started); a child that is none of the pool's workers is left out, whatever its end."""
    context = multiprocessing.get_context("fork")
    main, children = threading.main_thread().ident, []
    try:
        for then, reports, kill, seen_first, expected in [
            (lambda: time.sleep(0.3), True, False, True, 0),  # ends with exit status 0: no worker ends in the block
            (lambda: time.sleep(60), True, False, True, None),  # lives
            (lambda: time.sleep(60), True, True, True, -signal.SIGKILL),  # killed after a poll saw it
            (lambda: time.sleep(60), True, True, False, -signal.SIGKILL),  # killed and reaped before any poll
            (lambda: os._exit(1), False, False, False, 1),  # its import or initializer failed: it never reported
            (lambda: time.sleep(60), False, True, True, -signal.SIGKILL),  # killed as it started
            (lambda: time.sleep(60), False, False, True, None),  # starting
        ]:  # fmt: skip
            started = context.SimpleQueue()
            unstarted = context.Process(target=time.sleep, args=(60,), daemon=True)  # made, not started: no pid
            workers = [unstarted]
            watchdog = Watchdog(started, workers, main)  # not started: its polls are the calls below
            bystander = context.Process(target=lambda: os._exit(1), daemon=True)  # a child of no pool that fails
            bystander.start()
            if reports:
                child = _reported_child(context, started, then)
            else:
                child = context.Process(target=then, daemon=True)
                child.start()
            workers.append(child)  # after the one not started: the first worker that ended is reported
            children += [child, bystander]
            if seen_first:
                assert watchdog.first_end() is None
            if kill:
                child.kill()
            if expected is not None:  # a living child is left to the `finally`
                child.join(10)
            bystander.join(10)
            if not seen_first:
                multiprocessing.active_children()  # reaps the child, as the pool's own thread does
            end = watchdog.first_end()
            death = None if end is None else str(end)
            wanted = None if expected is None else death_message(child.name, child.pid, expected, reports)
            assert death == wanted, death
            assert watchdog.reported == ({(child.pid, child.name)} if reports else set())
            started.close()
    finally:
        for child in children:
            child.kill()
            child.join()


class _Ended:
    """A stand-in for the `Process` of a worker that ended; with `started`, reading its `exitcode` first puts its
    report there (a worker that reported, then died, as the watchdog looked)."""

    def __init__(self, pid: int, exitcode: int, started=None) -> None:
        self.pid, self.name, self.code, self.started = pid, f"SpawnPoolWorker-{pid}", exitcode, started

    @property
    def exitcode(self) -> int:
        if self.started is not None:
            self.started.put((self.pid, self.name))
            self.started = None
        return self.code


def test_the_watchdog_names_the_first_worker_that_ended_and_reads_the_reports_after_the_ends():
    """Several workers ended (a death, then the pool's replacements failing): the first the pool made is named, the
    cause. A worker whose report reaches the queue as the watchdog reads the ends (it reported, then died) is said to
    have reported, a cell perhaps lost, not to have died as it started: the reports are read after the ends."""
    started = multiprocessing.get_context("fork").SimpleQueue()
    try:
        workers = [_Ended(7, -signal.SIGKILL, started), _Ended(8, 1), _Ended(9, 1)]
        watchdog = Watchdog(started, workers, threading.main_thread().ident)
        end = watchdog.first_end()
        assert type(end) is WorkerDied and str(end) == death_message("SpawnPoolWorker-7", 7, -signal.SIGKILL, True)
    finally:
        started.close()


def test_a_death_names_the_worker_and_how_it_ended():
    """`death_message`: the worker's name and pid, then its signal (by name, by number for a real-time one) or its
    exit status; for a worker that died while it started, what to fix before the rerun: its traceback for an exit
    status, memory for a kill."""
    realtime = signal.SIGRTMIN + 2
    for exitcode, named in [(-signal.SIGKILL, "signal SIGKILL"), (-realtime, f"signal {realtime}"),
                            (0, "exit status 0"), (1, "exit status 1")]:  # fmt: skip
        for ready in (True, False):
            message = death_message("SpawnPoolWorker-3", 4321, exitcode, ready)
            assert "SpawnPoolWorker-3 (pid 4321)" in message and f"({named})" in message, message
            assert "\n" not in message and "rerun the same command" in message, message
            assert ("cell it ran" in message) == ready, message  # a cell lost only once the worker was ready
            if not ready:  # what to fix first: the worker's traceback, or the memory that a kill as it started says
                assert ("memory" in message, "traceback" in message) == (exitcode < 0, exitcode >= 0), message
    # Status 255 before the report: the exec of the interpreter failed, and no Python ran to print a traceback.
    message = death_message("SpawnPoolWorker-3", 4321, 255, False)
    assert "(exit status 255)" in message and f"interpreter {sys.executable} " in message, message
    assert "traceback above" not in message and "\n" not in message, message
    assert "traceback above" in death_message("SpawnPoolWorker-3", 4321, 1, False)


def test_a_worker_that_a_stop_signal_ended_stops_the_block_with_its_status():
    """`worker_end`: a worker that SIGTERM or SIGUSR1 ended, in a cell's warm start or evaluation (no graceful stop
    there) or as it started, ends the block as a stop (128 + the signal's number), naming the signal and the worker;
    any other end (SIGKILL, SIGINT, an exit status) is a death (`reported`: status 1)."""
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        for ready in (True, False):
            end = worker_end("SpawnPoolWorker-3", 4321, -signum, ready)
            assert isinstance(end, TrainingStopped) and end.exit_status == 128 + signum, end
            assert signum.name in str(end) and "SpawnPoolWorker-3 (pid 4321)" in str(end) and "\n" not in str(end)
    for exitcode in (-signal.SIGKILL, -signal.SIGINT, 0, 1, signal.SIGTERM):
        end = worker_end("SpawnPoolWorker-3", 4321, exitcode)
        assert type(end) is WorkerDied and str(end) == death_message("SpawnPoolWorker-3", 4321, exitcode), end


def _raise(error: BaseException):
    def cell(*args, **kwargs):
        raise error

    return cell


def test_a_cell_raises_what_would_end_its_worker_as_cell_exited_naming_itself():
    """`Cell`, called here as a worker calls a task: its value and a stop (`TrainingStopped`) pass through
    unchanged; another `Exception` is raised as `CellFailed` from it, with `carried` too; a `SystemExit` (status 0, no
    status, a message), a `KeyboardInterrupt` or a `GeneratorExit` is raised as `CellExited` from it, or with
    `carried`, only those (a `KeyboardInterrupt` passes); each (what `reported` reports) names the function, its
    arguments and what it raised, and stays one line of bounded length whatever the arguments."""
    assert Cell(divmod)(7, 2) == (3, 1) and Cell(dict)(a=1) == {"a": 1}
    stop = TrainingStopped("stopped by SIGTERM", {"signal": "SIGTERM"})
    with pytest.raises(TrainingStopped) as raised:
        Cell(_raise(stop))(1)
    assert raised.value is stop
    for carried in [(BaseException,), (SystemExit,)]:
        bug = KeyError("a bug")
        with pytest.raises(CellFailed) as raised:
            Cell(_raise(bug), carried)(("GRPO", 1), seed=1)
        message = str(raised.value)
        assert isinstance(raised.value, WorkerDied) and raised.value.__cause__ is bug
        assert "(('GRPO', 1), seed=1) raised KeyError('a bug'): " in message and "--debug" in message, message
    for error in [SystemExit(0), SystemExit(), SystemExit("usage: cell"), KeyboardInterrupt(), GeneratorExit()]:
        cell = _raise(error)
        with pytest.raises(CellExited) as raised:
            Cell(cell)(("GRPO", 2, 0), seed=1)
        message = str(raised.value)
        assert isinstance(raised.value, WorkerDied) and raised.value.__cause__ is error
        assert f"{cell.__qualname__}(('GRPO', 2, 0), seed=1)" in message and repr(error) in message, message
    hostile = "x\n" * 100_000
    for args, error in [((hostile,), SystemExit(0)), ((1,), SystemExit(hostile))]:
        with pytest.raises(CellExited) as raised:
            Cell(_raise(error))(*args)
        message = str(raised.value)
        assert "\n" not in message and len(message) < 3 * NAME_CHARACTERS, len(message)
        assert (f"({repr(hostile)[:20]}" if args != (1,) else "SystemExit(...)") in message, message
    for error in [SystemExit(0), KeyboardInterrupt()]:  # in a study's main process: its Ctrl-C left as it is
        with pytest.raises(CellExited if isinstance(error, SystemExit) else KeyboardInterrupt) as raised:
            Cell(_raise(error), (SystemExit,))(1)
        assert (raised.value.__cause__ if isinstance(error, SystemExit) else raised.value) is error
    table = Table()  # an argument, or an exit status, whose repr spans lines (an array's, a data frame's)
    for args, error in [((table,), SystemExit(0)), ((1,), SystemExit(table))]:
        with pytest.raises(CellExited) as raised:
            Cell(_raise(error))(*args)
        message = str(raised.value)
        assert len(message.splitlines()) == 1 and "a b c 1 2 3" in message, message
    # At the bound: a call or an error of NAME_CHARACTERS characters shown whole, one more cut to NAME_CHARACTERS.
    whole, cut = "a" * (NAME_CHARACTERS - 2), "a" * (NAME_CHARACTERS - 1)  # repr adds the quotes
    fits, over = SystemExit("b" * (NAME_CHARACTERS - 14)), SystemExit("b" * (NAME_CHARACTERS - 13))  # "SystemExit('')"
    for args, error, shown in [((whole,), SystemExit(0), f"({whole!r})"),
                               ((cut,), SystemExit(0), f"({repr(cut)[: NAME_CHARACTERS - 3]}...)"),
                               ((1,), fits, f" raised {fits!r}:"), ((1,), over, " raised SystemExit(...):")]:  # fmt: skip
        with pytest.raises(CellExited) as raised:
            Cell(_raise(error))(*args)
        assert shown in str(raised.value), (shown, str(raised.value))
    # A partial is named as the function it calls, its bound arguments first (nested ones too); another callable
    # without a `__qualname__` (an instance) by its type.
    with pytest.raises(CellExited) as raised:
        Cell(functools.partial(functools.partial(_raise(SystemExit(0)), 1, seed=3), 2))(4, seed=5)
    assert " _raise.<locals>.cell(1, 2, 4, seed=5) raised SystemExit(0)" in str(raised.value), str(raised.value)
    with pytest.raises(CellFailed) as raised:
        Cell(Table())(2)
    assert " Table(2) raised TypeError(" in str(raised.value), str(raised.value)


class Table:
    def __repr__(self) -> str:
        return "a b c\n1 2 3\r\n"


def test_the_watchdog_thread_has_the_main_thread_take_a_death_once(monkeypatch):
    """`Watchdog.run`, the thread: a SIGCHLD before any death (another child's end) takes nothing and leaves it
    polling; when a reported worker ends, it sends SIGCHLD to the main thread, whose handler takes the death
    (`take_death`) once, and the thread ends. A death it signals as the block stops (`stop` before the main thread
    handles the signal) is not taken."""
    monkeypatch.setattr(cell_pool_module, "POLL_SECONDS", 0.05)
    context = multiprocessing.get_context("fork")
    main = threading.main_thread().ident
    taken, children, queues = [], [], []
    previous = signal.getsignal(signal.SIGCHLD)
    try:
        started = context.SimpleQueue()
        queues.append(started)
        workers = []
        watchdog = Watchdog(started, workers, main)
        signal.signal(signal.SIGCHLD, lambda signum, frame: taken.append(watchdog.take_death()))
        assert watchdog.take_death() is None  # a stray SIGCHLD
        child = _reported_child(context, started, lambda: time.sleep(0.3))  # ends with exit status 0
        children.append(child)
        workers.append(child)
        watchdog.start()
        watchdog.join(20)  # the main thread waits on a lock, as `Pool.map` does: the signal reaches it there
        died = [death for death in taken if death is not None]  # the child's own SIGCHLD takes nothing
        assert not watchdog.is_alive() and len(died) == 1, taken
        assert [str(death) for death in died] == [death_message(child.name, child.pid, 0)], died
        assert watchdog.take_death() is None  # once

        # A worker that ended, unreported, before the first poll: a death at the first.
        started = context.SimpleQueue()
        queues.append(started)
        child = context.Process(target=os._exit, args=(1,), daemon=True)
        child.start()
        child.join(10)
        children.append(child)
        watchdog, taken[:] = Watchdog(started, [child], main), []
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # the signal waits, as for a main thread busy
        try:
            watchdog.start()
            watchdog.join(20)
            assert not watchdog.is_alive()
            watchdog.stop()  # the block's end, before the main thread handles the signal
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        assert taken == [None]
    finally:
        signal.signal(signal.SIGCHLD, previous)
        for child in children:
            child.kill()
            child.join()
        for started in queues:
            started.close()


LOCK_HELD = """
import signal, sys, threading
sys.path[:0] = [{repo!r}]
from dhpo_trl.demo.cell_pool import Watchdog, WorkerDied

main = threading.main_thread().ident


class ChildEnds(threading.Event):
    # The watchdog's `stopping`: a child's SIGCHLD reaches the main thread while it holds the watchdog's lock, in
    # `stop` (as it sets the event) or in `take_death` run by the handler of an earlier SIGCHLD (as it reads it).
    def __init__(self, where):
        super().__init__()
        self.where = where

    def arrive(self, where):
        if where == self.where:
            self.where = None  # once
            signal.pthread_kill(main, signal.SIGCHLD)  # handled at the next call: the one below, the lock held

    def set(self):
        self.arrive("stop")
        super().set()

    def is_set(self):
        self.arrive("take")
        return super().is_set()


for where, death in [("stop", None), ("stop", "a worker died"), ("take", "a worker died")]:
    watchdog, taken = Watchdog(None, [], main), []
    watchdog.stopping, watchdog.death = ChildEnds(where), death

    def on_child(signum, frame):
        taken.append(watchdog.take_death())
        if taken[-1] is not None:
            raise WorkerDied(taken[-1])

    signal.signal(signal.SIGCHLD, on_child)
    try:
        if where == "stop":
            watchdog.stop()  # the block's end
        else:
            signal.pthread_kill(main, signal.SIGCHLD)  # the watchdog's signal for the death
            watchdog.stopping.wait(1)
        raised = None
    except WorkerDied as error:
        raised = str(error)
    print(where, raised, taken.count(death), watchdog.take_death(), flush=True)
"""


def test_a_sigchld_that_arrives_while_the_main_thread_holds_the_watchdogs_lock_does_not_deadlock_it():
    """A child's end can signal the main thread at any point, also while it holds the watchdog's lock (in `stop` at
    the block's end, or in `take_death` in the handler of the watchdog's own SIGCHLD): the handler it runs there takes
    the death, once, instead of waiting forever for the lock its own thread holds. In a process of its own, so that a
    deadlock fails by the timeout."""
    script = LOCK_HELD.format(repo=str(REPO))
    result = processes.run([sys.executable, "-c", script], timeout=30)
    assert result.returncode == 0, result.stderr
    # where; the death raised in the main thread (in `stop`, or by the nested handler); the handlers that took it;
    # what a later SIGCHLD takes
    assert result.stdout.splitlines() == [
        "stop None 1 None",  # no death: the handler run in `stop` takes nothing
        "stop a worker died 1 None",
        "take a worker died 1 None",
    ], result.stdout


@pytest.mark.parametrize("ends", [True, False], ids=["terminate ends", "terminate waits for a dead worker's lock"])
def test_close_terminates_the_pool_and_kills_the_workers_its_terminate_waits_for(ends):
    """`close`: the pool's `terminate` runs; after the grace, every worker the pool started (`workers`) still running
    is SIGKILLed, whether it reported itself or is still starting, so that a `terminate` waiting for them (as for
    workers that took its SIGTERM as a graceful stop) returns, and `close` says it ended; one that waits for what no
    kill ends (the task queue's lock, held by a worker killed as it waited for a task) is given up after a second
    grace, and `close` says so (the pool is not to be joined). A worker made but not started yet, and one that ended,
    are not signalled; another child of this process is left alone."""
    context = multiprocessing.get_context("fork")
    started = context.SimpleQueue()
    children, terminated, ended = [], [], []
    never = threading.Event()
    try:
        children.append(_reported_child(context, started, lambda: time.sleep(60)))  # a worker
        children.append(context.Process(target=time.sleep, args=(60,), daemon=True))  # a replacement, still starting
        children[-1].start()
        children.append(context.Process(target=os._exit, args=(0,), daemon=True))  # a worker that ended
        children[-1].start()
        children[-1].join(10)
        unstarted = context.Process(target=time.sleep, args=(60,), daemon=True)  # made by the pool, not started
        bystander = context.Process(target=time.sleep, args=(60,), daemon=True)
        bystander.start()

        class Pool:
            def _terminate(self):  # what `multiprocessing.pool.Pool.terminate`, the one `close` calls, runs
                terminated.append(True)
                for worker in children[:2]:
                    worker.join()
                if not ends:
                    never.wait()

        begun = time.monotonic()
        workers = [*children, unstarted]
        before = set(threading.enumerate())
        # Not a daemon, as the main thread that calls `close` in a study is not: the terminate it gives up must be
        # one (a thread inherits its creator's kind), or the interpreter would wait for it at exit, forever.
        closer = threading.Thread(target=lambda: ended.append(close(Pool(), workers, grace=0.3)), daemon=False)
        closer.start()
        closer.join(20)
        assert not closer.is_alive() and terminated == [True] and ended == [ends]
        left = [thread for thread in threading.enumerate() if thread not in before]
        assert all(thread.daemon for thread in left) and len(left) == (0 if ends else 1)
        assert time.monotonic() - begun >= (0.3 if ends else 0.6)  # the grace first; the second one given up
        assert [worker.exitcode for worker in children] == [-signal.SIGKILL, -signal.SIGKILL, 0]
        assert unstarted.pid is None and bystander.is_alive()
        children.append(bystander)
    finally:
        never.set()
        for child in children:
            child.kill()
            child.join()
        started.close()


def _exit_zero(*args):
    raise SystemExit(0)


def test_a_cell_pool_runs_its_tasks_as_cells_every_way_and_refuses_close():
    """`CellPool` (forked workers, in this process): each way to run a task passes the arguments and options through
    (a keyword argument, a callback) and returns the values; a cell's `SystemExit` comes back through each as
    `CellExited`; `close` is refused, naming how to wait instead, and the pool runs on; so is `terminate`."""
    pool = CellPool(1, context=multiprocessing.get_context("fork"))
    try:
        called = []
        assert pool.apply_async(pow, (2,), {"exp": 5}, callback=called.append).get(20) == 32
        assert pool.map(abs, [-2, 3], chunksize=1) == [2, 3]
        assert pool.map_async(abs, [-4], callback=called.append).get(20) == [4]
        assert pool.starmap(pow, [(2, 3)], chunksize=1) == [8]
        assert pool.starmap_async(pow, [(3, 2)], callback=called.append).get(20) == [9]
        assert list(pool.imap(abs, [-5], chunksize=1)) == [5]
        assert list(pool.imap_unordered(abs, [-6], chunksize=1)) == [6]
        assert called == [32, [4], [9]]
        for run in [lambda: pool.apply_async(_exit_zero, (1,)).get(20), lambda: pool.map(_exit_zero, [1]),
                    lambda: pool.map_async(_exit_zero, [1]).get(20), lambda: pool.starmap(_exit_zero, [(1,)]),
                    lambda: pool.starmap_async(_exit_zero, [(1,)]).get(20), lambda: list(pool.imap(_exit_zero, [1])),
                    lambda: list(pool.imap_unordered(_exit_zero, [1]))]:  # fmt: skip
            with pytest.raises(CellExited):
                run()
        with pytest.raises(RuntimeError) as refused:
            pool.close()
        assert "map()" in str(refused.value)  # the way to wait for the results
        assert pool.map(abs, [-7]) == [7]
        with pytest.raises(RuntimeError):  # and `terminate` (a `with` block's end): the block's end ends the pool
            pool.terminate()
    finally:
        multiprocessing.pool.Pool.terminate(pool)
