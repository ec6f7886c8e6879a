"""`dhpo_trl.demo.cell_pool`: an error in the block ends every worker of the pool, a replacement for a worker that
ended included, even those that took the pool's SIGTERM as a graceful stop (as `run_embedded` does), and the block
does not hang on them; another child of the main process is left alone. A worker that dies in a task (SIGKILL) ends
the block with `WorkerDied` instead of a `Pool.map` that waits forever; one that ends with exit status 0 (as the
pool's `maxtasksperchild` ends one) and the pool's own SIGTERMs at the end are no death.

The pool runs in a driver script of its own (the spawned workers import it, as `__mp_main__`, for the task), so a
hanging stop fails this test by its timeout instead of hanging pytest. Two workers: one to end (or die), one in a
graceful task that only a SIGKILL ends; one for a block that ends normally."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import processes

from dhpo_trl.demo.cell_pool import Watchdog, death_message, pool_workers, report_worker

REPO = Path(__file__).resolve().parents[1]
DRIVER = """
import multiprocessing, os, signal, sys, time
from pathlib import Path
sys.path[:0] = [{repo!r}]
from dhpo_trl.demo.cell_pool import POLL_SECONDS, WorkerDied, cell_pool


def stop_gracefully(folder):
    # A cell's side of a stop: SIGTERM only asks, the task returns and the worker waits for the next task.
    stopped = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    Path(folder, str(os.getpid())).touch()
    while not stopped:
        time.sleep(0.05)
    signal.signal(signal.SIGTERM, previous)
    return os.getpid()


def exit_normally(folder):
    # A worker that ends with exit status 0, as the pool's maxtasksperchild ends one (after the watchdog saw it).
    Path(folder, str(os.getpid())).touch()
    time.sleep(3 * POLL_SECONDS)
    os._exit(0)


def run_until_terminated(folder):
    # A cell with no stop handler: the pool's SIGTERM at the stop ends its worker (-15), which is no death.
    Path(folder, str(os.getpid())).touch()
    time.sleep(300)


def wait_for(folder, count):
    while len(os.listdir(folder)) < count:
        time.sleep(0.1)


if __name__ == "__main__":
    folder, case = sys.argv[1:]
    bystander = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,), daemon=True)
    bystander.start()  # a child of this process that is none of the pool's
    try:
        with cell_pool(1 if case == "end" else 2) as pool:
            if case == "end":  # a block that ends normally, its worker idle: no error, the results kept
                print(pool.map(abs, [-2, 3], chunksize=1))
                time.sleep(3 * POLL_SECONDS)  # the watchdog polls the idle worker
            elif case == "error":
                pool.apply_async(exit_normally, (folder,))  # the pool starts a replacement
                pool.apply_async(run_until_terminated, (folder,))  # the other worker; the replacement takes the next
                pool.apply_async(stop_gracefully, (folder,))
                wait_for(folder, 3)  # the replacement is in a graceful task
                time.sleep(3 * POLL_SECONDS)  # the watchdog saw the ended worker
                raise RuntimeError("a cell failed")  # the stop's grace outlasts a poll: the SIGTERMed worker is seen
            else:
                result = pool.map_async(stop_gracefully, [folder, folder], chunksize=1)
                wait_for(folder, 2)  # both workers are in a task
                os.kill(int(sorted(os.listdir(folder))[0]), signal.SIGKILL)  # its task is lost
                killed = time.monotonic()
                result.get()  # waits forever for the lost task, but for the watchdog
        code = 0
    except WorkerDied:
        print(time.monotonic() - killed if case == "death" else -1.0)
        code = 5
    except RuntimeError:
        code = 3
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


def _drive(tmp_path, case: str) -> tuple[int, str, str, list[int]]:
    """Run the driver's `case`; (its exit status, stdout, stderr, the pids of the workers that ran a task). Asserts
    that no process it started outlives it."""
    driver, folder = tmp_path / "driver.py", tmp_path / "started"
    driver.write_text(DRIVER.format(repo=str(REPO)))
    folder.mkdir()
    marker = f"CELL_POOL_TEST={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    pool = processes.popen([sys.executable, str(driver), str(folder), case], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        stdout, stderr = pool.communicate(timeout=240)  # a stop that waits for a worker never ends
        left = time.monotonic() + 10  # the bystander's SIGKILL lands asynchronously
        while _marked(marker) and time.monotonic() < left:
            time.sleep(0.1)
        assert _marked(marker) == [], stderr  # the driver exited: none of its workers, replacements included, is left
        return pool.returncode, stdout, stderr, [int(name) for name in os.listdir(folder)]
    finally:
        processes.kill_tree(pool, grace=1)


def test_an_error_in_the_block_ends_every_worker_a_replacement_included(tmp_path):
    status, _, stderr, workers = _drive(tmp_path, "error")
    # 3: the block's error, raised after the workers are gone; 5: the ended worker taken for a death; 4: the stop
    # killed a child of the main process that was not the pool's
    assert status == 3, stderr
    assert len(workers) == 3, workers  # two workers and the replacement ran a task


def test_a_block_that_ends_normally_keeps_its_results_and_leaves_no_worker(tmp_path):
    status, stdout, stderr, _ = _drive(tmp_path, "end")
    assert status == 0, stderr  # 5: the pool's end taken for a death
    assert stdout.split("\n")[0] == "[2, 3]"


def test_a_worker_killed_in_a_task_ends_the_block_with_worker_died(tmp_path):
    status, stdout, stderr, workers = _drive(tmp_path, "death")
    assert status == 5, stderr  # WorkerDied, not a hang (the timeout) nor another error; 4: a bystander killed
    assert len(workers) == 2, workers
    assert float(stdout.split()[-1]) < 30  # from the SIGKILL to the block's end: a poll, the stop's grace, the joins


def test_the_workers_to_kill_are_the_children_whose_pid_and_name_a_worker_reported():
    """`pool_workers` picks a child only by the pid and the name together: a pid a dead worker reported and another
    child got since (a pid reused) is left alone, and so is a process that is no child of this one."""
    context = multiprocessing.get_context("fork")
    child = context.Process(target=time.sleep, args=(60,), daemon=True)
    child.start()
    started = context.SimpleQueue()
    try:
        for reported in [(child.pid, "SpawnPoolWorker-1"), (os.getppid(), multiprocessing.current_process().name)]:
            started.put(reported)  # the pid of a child under another name; a process that is not a child
        assert pool_workers(started) == [] and started.empty()
        started.put((child.pid, child.name))
        assert pool_workers(started) == [child] and started.empty()
    finally:
        child.kill()
        child.join()
        started.close()


def _reported_child(context, started, then):
    """A fork child that reports itself on `started` as a pool's worker does, then runs `then()`; returned once its
    report is on the queue."""
    child = context.Process(target=lambda: (report_worker(started), then()), daemon=True)
    child.start()
    while started.empty():
        time.sleep(0.01)
    return child


def test_the_watchdog_reports_a_reported_worker_that_died_and_nothing_else():
    """`Watchdog.check` (its polls, called directly): a reported worker that ended with exit status 0 or that lives
    is no death; one that a signal ended is, with its signal, also when the pool reaped it before any poll saw it
    (status unknown); a child that never reported is none of the pool's."""
    context = multiprocessing.get_context("fork")
    main, children = threading.main_thread().ident, []
    try:
        for then, kill, seen_first, expected in [
            (lambda: time.sleep(0.3), False, True, None),  # ends normally
            (lambda: time.sleep(60), False, True, None),  # lives
            (lambda: time.sleep(60), True, True, -signal.SIGKILL),  # killed after a poll saw it
            (lambda: time.sleep(60), True, False, "unknown"),  # killed and reaped before any poll
        ]:  # fmt: skip
            started = context.SimpleQueue()
            watchdog = Watchdog(started, main)  # not started: its polls are the calls below
            bystander = context.Process(target=lambda: os._exit(1), daemon=True)  # an unreported child that fails
            bystander.start()
            child = _reported_child(context, started, then)
            children += [child, bystander]
            if seen_first:
                assert watchdog.check() is None
            if kill:
                child.kill()
            child.join(10)
            bystander.join(10)
            if not seen_first:
                multiprocessing.active_children()  # reaps the child, as the pool's own thread does
            exitcode = None if expected == "unknown" else expected
            death = watchdog.check()
            assert death == (None if expected is None else death_message(child.name, child.pid, exitcode)), death
            assert watchdog.reported == {(child.pid, child.name)}
            started.close()
    finally:
        for child in children:
            child.kill()
            child.join()


def test_a_death_names_the_worker_and_how_it_ended():
    """`death_message`: the worker's name and pid, then its signal (by name, by number for a real-time one), its exit
    status, or that it is unknown."""
    realtime = signal.SIGRTMIN + 2
    for exitcode, named in [(-signal.SIGKILL, "signal SIGKILL"), (-realtime, f"signal {realtime}"),
                            (1, "exit status 1"), (None, "exit status unknown")]:  # fmt: skip
        message = death_message("SpawnPoolWorker-3", 4321, exitcode)
        assert "SpawnPoolWorker-3 (pid 4321)" in message and f"({named})" in message and "\n" not in message, message
