"""A pool of spawned processes for embedded runs (the studies' cells) whose stop neither hangs nor orphans.

`multiprocessing.Pool.terminate()` (what its block runs on exit) sends SIGTERM to the workers and waits for them. A
worker in the middle of `run_embedded` takes that as a graceful stop: it finishes the optimizer step, returns
`TrainingStopped` and waits for a task the closing pool never hands it, so the pool waits forever. And a stop signal
to the main process alone ends it at once (the default action), leaving the workers to finish their cells as orphans.
So here:

* the first SIGTERM / SIGUSR1 to the main process raises `TrainingStopped` in it (a second one ends it at once);
* whatever leaves the block with an error (that, a worker's `TrainingStopped`, a failing cell) terminates the pool,
  and kills (SIGKILL) the workers still there after `GRACE_SECONDS`: a cell in progress is not saved either way
  (`run_embedded` writes its summary last, atomically) and the same command reruns it.

The workers to kill are found without reading the pool's private state: the pool's initializer has each worker,
a replacement for one that died included, put its pid on a queue, and those pids pick the pool's workers out of
`multiprocessing.active_children()` (the main process's own children, so a pid there is never a reused one).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator

from .stops import TrainingStopped

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # those DHPOTrainer.train() stops on (training/resume.py)
GRACE_SECONDS = 2.0  # for the idle workers to take the pool's end-of-work sentinel and exit


@contextlib.contextmanager
def cell_pool(workers: int) -> Iterator[multiprocessing.pool.Pool]:
    """A spawn pool of `workers` processes, stopped as the module docstring says. Call from the main thread."""
    context = multiprocessing.get_context("spawn")
    started = context.SimpleQueue()  # each worker's pid, put there by the worker as it starts
    pool = context.Pool(workers, initializer=report_pid, initargs=(started,))
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def handle(signum, frame) -> None:
        restore()  # a second signal takes the previous action: the default one ends the process at once
        name = signal.Signals(signum).name
        raise TrainingStopped(f"stopped by {name}: the cells in progress are not saved", {"signal": name})

    for signum in STOP_SIGNALS:
        signal.signal(signum, handle)
    try:
        yield pool
    except BaseException:
        restore()
        close(pool, started)
        raise
    finally:
        restore()
        pool.terminate()  # idempotent; the workers have nothing left to do
        pool.join()
        started.close()


def report_pid(started: multiprocessing.queues.SimpleQueue) -> None:
    """The pool's initializer: the worker's pid, put synchronously, so it is on the queue before any task runs."""
    started.put(os.getpid())


def pool_workers(started: multiprocessing.queues.SimpleQueue) -> list[multiprocessing.process.BaseProcess]:
    """The live children of this process whose pids the pool's workers put on `started` (which this empties)."""
    pids = set()
    while not started.empty():
        pids.add(started.get())
    return [process for process in multiprocessing.active_children() if process.pid in pids]


def close(
    pool: multiprocessing.pool.Pool, started: multiprocessing.queues.SimpleQueue, grace: float = GRACE_SECONDS
) -> None:
    """`pool.terminate()` in a thread; after `grace` seconds, SIGKILL for the pool's workers still alive (those that
    took its SIGTERM as a graceful stop and wait for a task), so that it returns. `started`: the pids the workers
    put there through `report_pid`."""
    closing = threading.Thread(target=pool.terminate, daemon=True)
    closing.start()
    closing.join(grace)
    for process in pool_workers(started):
        process.kill()
    closing.join()
