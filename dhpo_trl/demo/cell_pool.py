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
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
from collections.abc import Iterator

from .embedded import TrainingStopped

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # those DHPOTrainer.train() stops on (training/resume.py)
GRACE_SECONDS = 2.0  # for the idle workers to take the pool's end-of-work sentinel and exit


@contextlib.contextmanager
def cell_pool(workers: int) -> Iterator[multiprocessing.pool.Pool]:
    """A spawn pool of `workers` processes, stopped as the module docstring says. Call from the main thread."""
    pool = multiprocessing.get_context("spawn").Pool(workers)
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
        close(pool)
        raise
    finally:
        restore()
        pool.terminate()  # idempotent; the workers have nothing left to do
        pool.join()


def close(pool: multiprocessing.pool.Pool, grace: float = GRACE_SECONDS) -> None:
    """`pool.terminate()` in a thread; after `grace` seconds, SIGKILL for the workers still alive (those that took
    its SIGTERM as a graceful stop and wait for a task), so that it returns."""
    closing = threading.Thread(target=pool.terminate, daemon=True)
    closing.start()
    closing.join(grace)
    for process in pool._pool:  # Pool keeps its worker processes there only
        if process.is_alive():
            process.kill()
    closing.join()
