"""`dhpo_trl.demo.cell_pool`: an error in the block ends every worker of the pool, a replacement for a worker that
died included, even those that took the pool's SIGTERM as a graceful stop (as `run_embedded` does), and the block
does not hang on them; another child of the main process is left alone.

The pool runs in a driver script of its own (the spawned workers import it, as `__mp_main__`, for the task), so a
hanging stop fails this test by its timeout instead of hanging pytest."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import processes

from dhpo_trl.demo.cell_pool import pool_workers

REPO = Path(__file__).resolve().parents[1]
DRIVER = """
import multiprocessing, os, signal, sys, time
from pathlib import Path
sys.path[:0] = [{repo!r}]
from dhpo_trl.demo.cell_pool import cell_pool


def stop_gracefully(folder):
    # A cell's side of a stop: SIGTERM only asks, the task returns and the worker waits for the next task.
    stopped = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    Path(folder, str(os.getpid())).touch()
    while not stopped:
        time.sleep(0.05)
    signal.signal(signal.SIGTERM, previous)
    return os.getpid()


def wait_for(folder, count):
    while len(os.listdir(folder)) < count:
        time.sleep(0.1)


if __name__ == "__main__":
    folder = sys.argv[1]
    bystander = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,), daemon=True)
    bystander.start()  # a child of this process that is none of the pool's
    try:
        with cell_pool(2) as pool:
            pool.map_async(stop_gracefully, [folder, folder], chunksize=1)
            wait_for(folder, 2)  # both workers are in a task
            os.kill(int(sorted(os.listdir(folder))[0]), signal.SIGKILL)  # the pool starts a replacement
            pool.apply_async(stop_gracefully, (folder,))
            wait_for(folder, 3)  # the replacement is in a task
            raise RuntimeError("a cell failed")
    except RuntimeError:
        alive = bystander.is_alive()
        bystander.kill()
        sys.exit(3 if alive else 4)
"""


def _alive(pid: int) -> bool:
    stat = processes._stat(pid)
    return stat is not None and stat[2] != "Z"


def test_an_error_in_the_block_ends_every_worker_a_replacement_included(tmp_path):
    driver, folder = tmp_path / "driver.py", tmp_path / "started"
    driver.write_text(DRIVER.format(repo=str(REPO)))
    folder.mkdir()
    pool = processes.popen([sys.executable, str(driver), str(folder)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _, stderr = pool.communicate(timeout=240)  # a stop that waits for its gracefully stopped workers never ends
        assert pool.returncode == 3, stderr  # the block's error, raised after the workers are gone; 4: the stop
        # killed a child of the main process that was not the pool's
        workers = [int(name) for name in os.listdir(folder)]
        assert len(workers) == 3, workers  # two workers and the replacement ran a task
        assert [pid for pid in workers if _alive(pid)] == []  # the driver exited: none of them outlives it
    finally:
        processes.kill_tree(pool, grace=1)


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
