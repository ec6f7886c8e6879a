"""A pool of spawned processes for embedded runs (the studies' cells) whose stop neither hangs nor orphans.

`multiprocessing.Pool.terminate()` (what its block runs on exit) sends SIGTERM to the workers and waits for them. A
worker in the middle of `run_embedded` takes that as a graceful stop: it finishes the optimizer step, returns
`TrainingStopped` and waits for a task the closing pool never hands it, so the pool waits forever. And a stop signal
to the main process alone ends it at once (the default action), leaving the workers to finish their cells as orphans.
So here:

* the first SIGTERM / SIGUSR1 to the main process raises `TrainingStopped` in it (a second one ends it at once);
  one that arrives as the block's end closes the pool is raised once the pool is closed: raised in the middle, it
  would leave the pool running, its workers waiting for tasks that never come;
* whatever ends the block (that, a worker's `TrainingStopped`, a failing cell, a dead worker, its end) terminates the
  pool, and kills (SIGKILL) the workers still there after `GRACE_SECONDS`: a cell in progress is not saved either
  way (`run_embedded` writes its summary last, atomically) and the same command reruns it. A terminate still running
  `GRACE_SECONDS` after that waits for what no kill ends (`close`) and is left, the pool unjoined. The block itself
  may not close or terminate the pool (below).

The workers to kill are found without reading the pool's private state: the pool starts each worker, a replacement
for one that died included, through the `Process` of the context it is given (`WorkerContext`, below), which keeps
them. Their own `Process` objects, not pids: a worker that ended keeps its exit status there and is not signalled,
so no other process that got its pid is, and no other child of the main process is one of them. A replacement still
starting (importing the main module) when the block ends is killed too.

A cell that raises a `BaseException` that is not an `Exception` (`SystemExit` from argparse in a cell or a library's
`sys.exit()`, `KeyboardInterrupt`) would end its worker, with exit status 0 for `SystemExit(0)`: the pool's tasks run
as `Cell`s, which raise `CellExited` instead, naming the cell; the pool carries it back as any error of a task, and it
ends the block (`reported`: one line, exit status 1). A cell that raises an `Exception` other than a stop
(`TrainingStopped`) raises `CellFailed` the same way, naming the cell, its error the cause (its traceback, the worker's
included, under `--debug`). A block that waits for its cells as they finish (`imap_unordered`) ends at the first
such error; `map` would wait for every other cell first. The cells still running then are stopped with the pool and
not saved: the rerun runs them again, and skips the finished ones.

A worker that dies while the block runs (an OOM kill, a SIGKILL from a cluster, `os._exit` in a cell) takes its task
with it, and `Pool.map` would wait for that task forever. A worker of this pool has no legitimate end while the block
runs: the pool has no `maxtasksperchild`, and its end-of-work sentinel and SIGTERMs are sent only by `close` and
`terminate`, which the block may not call (the block's end calls the latter). So any end is a death, exit status 0
included, and so is the end of a worker that never got as far as its report: one whose import of the main module fails
in the spawned process only, whose initializer raises, or that the OOM killer ends as it starts. The pool replaces such
a worker, and its replacement fails the same way, forever: it took no task, so nothing waits for it, and the study
would print tracebacks and never end. The pool starts its workers through its context's `Process` (the `context` it is
given, public), so `WorkerContext` keeps every worker the pool started, replacements included, before any of its code
runs; that covers a worker that dies before it can run any code of ours, which no report from the worker can, and
without counting unreported starts against a bound: the first end is the death. A watchdog thread polls those workers
every `POLL_SECONDS`; the first one it finds ended has `WorkerDied` raised in the main thread, wherever it waits, and
the block ends as on an error above, naming whether the worker had reported (a cell lost: rerun) or died while it
started (no cell ran: its traceback above, or a kill, says what to fix before the rerun). A worker that a stop
signal (SIGTERM, SIGUSR1) ended is a stop, not a death: a cell stops gracefully only in training, and the same signal
outside it (the warm start, an evaluation) or to a worker still starting ends the worker at once; the main thread
raises `TrainingStopped` naming the signal and the worker, and the study exits with 128 + the signal's number, as a
cluster that sent it expects of a stop the same command resumes. The finished cells are saved by their workers, so
the same command resumes. The watchdog is stopped before the pool is terminated, so the pool's own
SIGTERMs and sentinels are no death. To reach the main thread where it waits on a lock, the watchdog sends it SIGCHLD
(`signal.pthread_kill`): a real signal interrupts the wait, which `_thread.interrupt_main` does not, and SIGCHLD's
default action is to ignore it, so one that arrives after the block leaves its handler is harmless.

A worker the system refuses to start (`Process.start` raising `OSError`: fork or spawn failing with EAGAIN for too
many processes, ENOMEM) leaves no process to watch. The pool starts its first workers in its constructor, where the
error would end the study with a traceback, and each replacement for a dead worker in its worker-handler thread,
which the error ends (it prints its traceback): the death that asked for the replacement is reported, but a line
blaming it alone hides that the rerun would fail on the start again. The context's `Process` records such an error on
its process (`SpawnProcess`): the constructor's raises `WorkerNotStarted` (the pool already ended the workers it
started), and the watchdog reports a later one before any death: one line from `reported` naming the worker and the
error, and what to do (fewer workers, or more free memory), status 1.

The queue's pipe (64 KiB, about 47 bytes a worker) holds some 1,400 reports, and the watchdog empties it as they come.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import multiprocessing
import multiprocessing.pool
import multiprocessing.spawn
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator

from ..user_errors import DEBUG_FLAG, debug_given
from .stops import TrainingStopped

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # those DHPOTrainer.train() stops on (training/resume.py)
GRACE_SECONDS = 2.0  # for the idle workers to take the pool's end-of-work sentinel and exit
POLL_SECONDS = 0.5  # how often the watchdog looks for a dead worker
# A spawned worker's status when the exec of its interpreter fails: `Process.start` does not raise (the spawn starts
# it through `_posixsubprocess`, whose error pipe it never reads) and no Python ran to print a traceback.
EXEC_FAILED = 255
NAME_CHARACTERS = 300  # of a cell's arguments in `CellExited`'s, `CellFailed`'s message: one line, whatever they are


class WorkerDied(RuntimeError):
    """A pool's worker died while the block ran: the cell it ran is lost (not saved), the finished ones are kept.
    Not a `TrainingStopped`: no stop was asked for (a worker that a stop signal ended is one: `worker_end`)."""


class WorkerNotStarted(WorkerDied):
    """The system refused to start one of the pool's workers (`OSError` from `Process.start`): no cell ran in it."""


class CellFailed(WorkerDied):
    """A cell raised an `Exception` that is not a stop: raised by `Cell` in its place, naming the cell, so that the
    block ends on one line (`reported`) with the original as its cause."""


class CellExited(WorkerDied):
    """A cell raised a `BaseException` that is not an `Exception` (`SystemExit`, `KeyboardInterrupt`) in its worker,
    where it would have ended the worker: raised by `Cell` instead, so the pool carries it back to the block. Its cell
    is lost as a dead worker's is, and `reported` reports it the same way."""


class Cell:
    """`func` as a pool's task: an `Exception` escaping it that is not a `TrainingStopped` is raised as `CellFailed`,
    and a `BaseException` of `carried` that is not an `Exception` as `CellExited`, naming `func` and its arguments,
    from the original (whose traceback the pool's remote traceback then shows). A study that runs its cells in its
    main process (one worker, no pool) wraps them as `Cell(func, (SystemExit,))`: there a cell's `SystemExit(0)` would
    end the study with status 0, and a `KeyboardInterrupt` is the user's Ctrl-C, left as it is."""

    def __init__(self, func: Callable, carried: tuple[type[BaseException], ...] = (BaseException,)) -> None:
        self.func, self.carried = func, carried

    def __call__(self, *args, **kwargs):
        try:
            return self.func(*args, **kwargs)
        except TrainingStopped:  # a stop: `reported` reports it as one
            raise
        except Exception as error:
            raise CellFailed(exit_message(self.func, args, kwargs, error, FAILED)) from error
        except self.carried as error:
            raise CellExited(exit_message(self.func, args, kwargs, error)) from error


EXITED = "it was not saved; rerun the same command to resume (finished cells are kept)"
FAILED = (
    f"it was not saved, nor were the cells still running ({DEBUG_FLAG} shows its traceback); once it is fixed, "
    "rerun the same command to resume (finished cells are kept)"
)


def exit_message(func: Callable, args: tuple, kwargs: dict, error: BaseException, then: str = EXITED) -> str:
    """The one-line report of the cell `func(*args, **kwargs)` that raised `error`, its arguments cut to
    `NAME_CHARACTERS`, then `then`. One line: a `repr` may span several (an array's, a table's). A
    `functools.partial` is named as the function it calls, with its bound arguments: its own name says nothing."""
    while isinstance(func, functools.partial):
        func, args, kwargs = func.func, (*func.args, *args), {**func.keywords, **kwargs}
    call = " ".join(", ".join([*map(repr, args), *(f"{key}={value!r}" for key, value in kwargs.items())]).splitlines())
    if len(call) > NAME_CHARACTERS:
        call = call[: NAME_CHARACTERS - 3] + "..."
    raised = " ".join(repr(error).splitlines())
    raised = raised if len(raised) <= NAME_CHARACTERS else f"{type(error).__name__}(...)"
    name = getattr(func, "__qualname__", type(func).__qualname__)
    return f"cell_pool: the cell {name}({call}) raised {raised}: {then}"


class CellPool(multiprocessing.pool.Pool):
    """A `multiprocessing.pool.Pool` whose tasks run as `Cell`s and that only `cell_pool` ends: `close` and
    `terminate` (so also `with pool:`) are refused, since they would end the workers while the block runs, which the
    watchdog takes for deaths (and `terminate` would wait for a worker in a graceful stop)."""

    def apply_async(self, func, *args, **kwargs):
        return super().apply_async(Cell(func), *args, **kwargs)

    def map(self, func, *args, **kwargs):
        return super().map(Cell(func), *args, **kwargs)

    def map_async(self, func, *args, **kwargs):
        return super().map_async(Cell(func), *args, **kwargs)

    def starmap(self, func, *args, **kwargs):
        return super().starmap(Cell(func), *args, **kwargs)

    def starmap_async(self, func, *args, **kwargs):
        return super().starmap_async(Cell(func), *args, **kwargs)

    def imap(self, func, *args, **kwargs):
        return super().imap(Cell(func), *args, **kwargs)

    def imap_unordered(self, func, *args, **kwargs):
        return super().imap_unordered(Cell(func), *args, **kwargs)

    def close(self) -> None:
        raise RuntimeError(
            "cell_pool: the block does not close its pool (its workers' ends would be taken for deaths): wait for "
            "the results with map() or get(); the block's end ends the pool"
        )

    def terminate(self) -> None:
        raise RuntimeError(
            "cell_pool: the block does not terminate its pool (its workers' ends would be taken for deaths): raise "
            "an error to end the block early; the block's end ends the pool"
        )


def reported(main: Callable[[list[str] | None], int], argv: list[str] | None, prefix: str) -> int:
    """`main(argv)`'s exit status, with a stop or a lost cell reported on one line of stderr after `prefix`: a stop
    signal's status (the cells in progress are not saved; the same command resumes), or 1 for a worker that died or
    could not start, or a cell that raised (`WorkerDied`, `WorkerNotStarted`, `CellFailed`, `CellExited`: its cell is
    not saved; a rerun starts it over). With `--debug` in `argv` (default: the command line; `debug_given`), its
    traceback instead of the line, with the same status: a cell's shows where it raised, in the worker; so too for
    `main`'s own one-line errors, a `SystemExit` with a message (status 1), which leaves `main` as it is without."""
    debug = debug_given(sys.argv[1:] if argv is None else argv)
    try:
        return main(argv)
    except SystemExit as exited:
        if not (debug and isinstance(exited.code, str)):  # argparse's usage errors (a number) stay one line
            raise
        traceback.print_exception(exited, file=sys.stderr)
        return 1
    except TrainingStopped as stopped:
        if debug:
            traceback.print_exception(stopped, file=sys.stderr)
            return stopped.exit_status
        return stopped.report(prefix, "; the same command resumes the study")
    except WorkerDied as died:
        if debug:
            traceback.print_exception(died, file=sys.stderr)
        else:
            print(f"{prefix} {died}", file=sys.stderr, flush=True)
        return 1


def death_message(name: str, pid: int, exitcode: int, ready: bool = True) -> str:
    """The one-line report of a worker that died with `exitcode` (`Process.exitcode`: -N for signal N), after it
    reported itself (`ready`: a cell may be lost) or while it started (no cell ran in it, and its replacement would
    fail the same way: the cause comes first)."""
    if exitcode < 0:
        try:
            how = f"signal {signal.Signals(-exitcode).name}"
        except ValueError:  # a real-time signal: no name
            how = f"signal {-exitcode}"
    else:
        how = f"exit status {exitcode}"
    if ready:
        return (
            f"cell_pool: worker {name} (pid {pid}) died ({how}) while the pool ran: the cell it ran, if any, was "
            "not saved; rerun the same command to resume (finished cells are kept)"
        )
    return (
        f"cell_pool: worker {name} (pid {pid}) died ({how}) while it started, before it ran any cell: "
        f"{starting_cause(exitcode)}; fix that, then rerun the same command to resume (finished cells are kept)"
    )


def worker_end(name: str, pid: int, exitcode: int, ready: bool = True) -> WorkerDied | TrainingStopped:
    """What ends the block for a worker that ended with `exitcode`: a stop where a stop signal (`STOP_SIGNALS`) ended
    it, as one that reached it in training stops it (a cell runs a graceful stop only around training: the warm start
    or an evaluation, or a worker still starting, takes the signal's default action and dies); else `WorkerDied`."""
    stopped = [signum.name for signum in STOP_SIGNALS if exitcode == -signum]
    if not stopped:
        return WorkerDied(death_message(name, pid, exitcode, ready))
    where = "outside training (between cells, a warm start or an evaluation)" if ready else "as it started"
    return TrainingStopped(f"stopped by {stopped[0]} to worker {name} (pid {pid}), which ended it {where}: the cells "
                           "in progress are not saved", {"signal": stopped[0]})  # fmt: skip


def starting_cause(exitcode: int) -> str:
    """What ended a worker with `exitcode` before it reported: a kill, an exec that failed (`EXEC_FAILED`), or its
    Python code, whose traceback the worker printed."""
    if exitcode < 0:
        return "it was killed as it started (out of memory? fewer workers need less)"
    if exitcode == EXEC_FAILED:
        interpreter = os.fsdecode(multiprocessing.spawn.get_executable())
        return (
            f"the system could not run its interpreter {interpreter} (missing, not executable, or too little memory "
            "to load it), which leaves no traceback"
        )
    return "its import of the main module or its setup failed in the spawned process: see its traceback above"


def start_message(name: str, error: OSError) -> str:
    """The one-line report of the worker `name` whose start raised `error` (its errno's name where it has one)."""
    code = errno.errorcode.get(error.errno) if error.errno is not None else None
    raised = " ".join(f"{type(error).__name__}{f' {code}' if code else ''}: {error.strerror or error}".splitlines())
    return (
        f"cell_pool: worker {name} could not start ({raised[:NAME_CHARACTERS]}): the system refused a new process "
        "(too many processes, or too little memory); run fewer workers or free memory, then rerun the same command "
        "to resume (finished cells are kept)"
    )


@contextlib.contextmanager
def cell_pool(workers: int) -> Iterator[CellPool]:
    """A spawn pool of `workers` processes, stopped as the module docstring says. Call from the main thread."""
    context = WorkerContext()
    started = context.SimpleQueue()  # each worker's pid, put there by the worker as it starts
    try:
        pool = CellPool(workers, initializer=report_worker, initargs=(started,), context=context)
    except OSError:  # the pool terminated and joined the workers it had started
        started.close()
        refused = next((process for process in context.workers if process.start_error is not None), None)
        if refused is None:  # not a start: the pool's own pipes
            raise
        raise WorkerNotStarted(start_message(refused.name, refused.start_error)) from refused.start_error
    watchdog = Watchdog(started, context.workers, threading.main_thread().ident)
    previous = {signum: signal.getsignal(signum) for signum in (*STOP_SIGNALS, signal.SIGCHLD)}

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    stops: list[TrainingStopped] = []  # those that arrived as the block's end closed the pool
    ending = False

    def handle(signum, frame) -> None:
        restore()  # a second signal takes the previous action: the default one ends the process at once
        name = signal.Signals(signum).name
        stop = TrainingStopped(f"stopped by {name}: the cells in progress are not saved", {"signal": name})
        if not ending:
            raise stop
        stops.append(stop)

    def on_child(signum, frame) -> None:
        if callable(previous[signal.SIGCHLD]):
            previous[signal.SIGCHLD](signum, frame)
        if (end := watchdog.take_death()) is not None:
            raise end

    for signum in STOP_SIGNALS:
        signal.signal(signum, handle)
    signal.signal(signal.SIGCHLD, on_child)
    watchdog.start()
    try:
        yield pool
    finally:
        ending = True  # before any call: a signal's handler runs at one
        try:
            watchdog.stop()  # before the pool's SIGTERMs: those are no death
        finally:
            # Also when a death found as the block ended is raised in `stop` (at most once: `take_death`).
            watchdog.join()  # the one reader of `started` until then
            if close(pool, context.workers):  # kills what a graceful stop or a cell would leave waiting
                pool.join()
            started.close()
            restore()
        if stops:
            raise stops[0]


class WorkerContext(multiprocessing.context.SpawnContext):
    """The spawn context, keeping in `workers` every process made through it: given to a pool, its workers, each
    replacement included, in the order the pool made them (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.workers: list[SpawnProcess] = []  # appended by the pool's thread, read by copy

    def Process(self, *args, **kwargs) -> SpawnProcess:  # the name the pool calls
        process = SpawnProcess(*args, **kwargs)
        self.workers.append(process)
        return process


class SpawnProcess(multiprocessing.context.SpawnProcess):
    """The spawn context's process, keeping the `OSError` its `start` raised (`start_error`, None otherwise) for the
    watchdog to report: the pool's thread that started it ends with it. Named as the context's, so that the pool's
    workers keep their names (SpawnPoolWorker-N)."""

    start_error: OSError | None = None  # a class default: set on the main process's object only, after pickling

    def start(self) -> None:
        try:
            super().start()
        except OSError as error:
            self.start_error = error
            raise


class Watchdog(threading.Thread):
    """Reads the workers' reports from `started` into `reported` and, every `POLL_SECONDS`, has the thread `main`
    raise `WorkerDied` (through SIGCHLD; see the module docstring) for the first of `workers` (`WorkerContext`'s) that
    ended, whatever its exit status and whether it reported or not (no worker ends while the block runs), or
    `TrainingStopped` where a stop signal ended it (`worker_end`), until `stop`."""

    def __init__(
        self,
        started: multiprocessing.queues.SimpleQueue,
        workers: list[multiprocessing.process.BaseProcess],
        main: int,
    ) -> None:
        super().__init__(name="cell_pool-watchdog", daemon=True)
        self.started, self.workers, self.main = started, workers, main
        self.reported: set[tuple[int, str]] = set()
        # Reentrant: a SIGCHLD handled in the main thread while it holds the lock (in `stop`, or in the handler of
        # an earlier SIGCHLD) runs `take_death` in that thread.
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.death: BaseException | None = None  # the error to raise, until the main thread takes it

    def run(self) -> None:
        while not self.stopping.wait(POLL_SECONDS):
            death = self.first_end()
            with self.lock:  # no signal once `stop` began: the pool's own SIGTERMs end its workers then
                if death is not None and not self.stopping.is_set():
                    self.death = death
                    signal.pthread_kill(self.main, signal.SIGCHLD)
                    return  # one death ends the block

    def first_end(self) -> WorkerDied | TrainingStopped | None:
        """The error for the first worker the system refused to start, else for the first that ended, or None. Its
        `Process` keeps its exit status whichever thread reaped it (the pool's does); one not started yet has none."""
        refused = [process for process in list(self.workers) if getattr(process, "start_error", None) is not None]
        if refused:
            return WorkerNotStarted(start_message(refused[0].name, refused[0].start_error))
        ended = [(process, process.exitcode) for process in list(self.workers)]
        ended = [(process, exitcode) for process, exitcode in ended if exitcode is not None]
        # After the ends: a worker that reported had its report in the queue's pipe before it ended.
        drain(self.started, self.reported)
        if not ended:
            return None
        process, exitcode = ended[0]
        return worker_end(process.name, process.pid, exitcode, (process.pid, process.name) in self.reported)

    def take_death(self) -> BaseException | None:
        """The error to raise in the main thread for a death, once; None after `stop` (the block is ending already)."""
        with self.lock:
            death, self.death = (None if self.stopping.is_set() else self.death), None
            if death is not None:
                self.stopping.set()
            return death

    def stop(self) -> None:
        """No death is raised after this; the thread ends within a check (`join` it)."""
        with self.lock:
            self.stopping.set()


def report_worker(started: multiprocessing.queues.SimpleQueue) -> None:
    """The pool's initializer: the worker's pid and name, put synchronously, so they are on the queue before any task
    runs."""
    started.put((os.getpid(), multiprocessing.current_process().name))


def drain(started: multiprocessing.queues.SimpleQueue, reported: set[tuple[int, str]]) -> set[tuple[int, str]]:
    """`reported` with the (pid, name) reports waiting on `started` (which this empties) added."""
    while not started.empty():
        reported.add(started.get())
    return reported


def close(
    pool: multiprocessing.pool.Pool,
    workers: list[multiprocessing.process.BaseProcess],
    grace: float = GRACE_SECONDS,
) -> bool:
    """`pool.terminate()` in a thread; after `grace` seconds, SIGKILL for the pool's `workers` (`WorkerContext`'s: each
    one it started) still running (those that took its SIGTERM as a graceful stop and wait for a task, or a replacement
    still starting), so that it returns.

    Returns whether the terminate ended within `grace` seconds more. It never does where a worker died while it waited
    for a task (a SIGKILL to an idle worker): a waiting worker holds the lock of the pool's task queue, which the
    terminate takes first, and without the rest of the terminate the pool's result thread waits for the lost task, so
    `pool.join()` would wait forever too. The caller then leaves the pool as it is: its workers are dead, and its
    threads are daemons."""
    # The base class's terminate: `CellPool`'s is refused, to the block.
    closing = threading.Thread(target=multiprocessing.pool.Pool.terminate, args=(pool,), daemon=True)
    closing.start()
    closing.join(grace)
    for process in list(workers):  # a copy: the pool's thread appends to it
        if process.pid is not None:  # started: one made but not started yet has no process to kill
            process.kill()  # none once it ended: its `Process` keeps its exit status, and its pid is not signalled
    closing.join(grace)  # the rest joins the pool's threads and dead workers, unless it waits for a dead one's lock
    return not closing.is_alive()
