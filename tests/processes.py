"""Child processes that never outlive their test: every process a test starts runs in its own session (process
group), and the whole group is killed when the test's call returns, fails, times out or is interrupted.

`subprocess.run(..., timeout=...)` kills only the direct child: torchrun's workers, a bash script's background
jobs or a server a script started would keep running (and holding ports, memory and CPU) after a failed test.

A process group is not the whole tree: torchrun, and every `run` below, start their children in sessions of their
own. When the process between them dies abruptly (a pytest killed by SIGTERM runs no `finally`), those children are
out of its group and orphaned. `kill_tree` therefore also signals every descendant, found through their parent ids
before anything is signalled (an orphan leaves the tree as soon as its parent dies).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

DEVNULL = subprocess.DEVNULL


def kill_group(process: subprocess.Popen | int, grace: float = 10.0) -> None:
    """Stop the process group led by `process` (a Popen, or a pid): SIGTERM, up to `grace` seconds for the leader
    to exit, then SIGKILL to whatever is left of the group (nothing if it is already gone).

    SIGTERM first because torchrun starts its workers in sessions of their own, outside the launcher's group, and
    stops them only when it is terminated itself; a bare SIGKILL of the group would leave them running. The leader
    is polled through its Popen, which keeps its exit status (a bare pid is only waited for the grace period)."""
    pid = process.pid if isinstance(process, subprocess.Popen) else process
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    if isinstance(process, subprocess.Popen):
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, whatever its session, parents before children (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(int(stat[1]), []).append(int(entry))
    found, queue = [], list(children.get(pid, []))
    while queue:
        child = queue.pop(0)
        found.append(child)
        queue.extend(children.get(child, []))
    return found


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state, ppid, pgrp, ...; field 22, the start time, is index 19), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(") ", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    """Whether `pid` still runs the process that started at `started` (a zombie runs nothing; a reused pid is
    another process)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and (started is None or stat[19] == started)


def kill_tree(process: subprocess.Popen | int, grace: float = 10.0) -> list[int]:
    """Stop `process`, its process group and every descendant, whichever session it is in: SIGTERM to all of them
    (torchrun stops its workers on SIGTERM), up to `grace` seconds, then SIGKILL to whatever is left. Returns the
    pids still alive afterwards (empty when everything is gone)."""
    pid = process.pid if isinstance(process, subprocess.Popen) else process
    reaped = isinstance(process, subprocess.Popen) and process.returncode is not None
    # Before any signal: an orphan leaves the tree. A reaped leader's pid may already be another process's, so only
    # its group is signalled then (its orphaned children have left its tree anyway).
    tree = [pid] if reaped else [pid, *descendants(pid)]
    started = {p: (_stat(p) or [None] * 20)[19] for p in tree}

    def signal_all(sig):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for p in tree[1:] if reaped else tree:
            if _alive(p, started[p]):
                try:
                    os.kill(p, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if isinstance(process, subprocess.Popen):
            process.poll()  # reap the leader: a zombie leader would otherwise count as alive below
        if not any(_alive(p, started[p]) for p in tree):
            break
        time.sleep(0.05)
    for p in tree:  # children started during the grace period
        if _alive(p, started[p]):
            late = [q for q in descendants(p) if q not in started]
            tree.extend(late)
            started.update({q: (_stat(q) or [None] * 20)[19] for q in late})
    signal_all(signal.SIGKILL)
    if isinstance(process, subprocess.Popen):
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    time.sleep(0.1)  # SIGKILL is delivered asynchronously
    return [p for p in tree if _alive(p, started[p])]


def run(command, *, timeout: float, check: bool = False, capture_output: bool = True, text: bool = True,
        **popen_kwargs) -> subprocess.CompletedProcess:  # fmt: skip
    """`subprocess.run` in a new session; the child's whole process group and every descendant still in its tree
    are killed in every case on the way out (a finished leader may leave workers behind; see `kill_tree`). Raises `subprocess.TimeoutExpired` after `timeout` seconds.

    Output goes to temporary files, not pipes: a grandchild that inherited a pipe would keep it open, and reading
    to its end would wait for the grandchild instead of the child."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        if capture_output:
            popen_kwargs.update(stdout=out, stderr=err)
        process = subprocess.Popen(command, start_new_session=True, **popen_kwargs)
        timed_out = False
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_tree(process)
            process.wait()  # reap the leader (killed above if it was still running)
        stdout, stderr = (_read(out, text), _read(err, text)) if capture_output else (None, None)
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result


def torchrun(script, *args, timeout: float, accelerate_cpu: bool = True, nproc: int = 2, env: dict | None = None,
             cwd=None) -> subprocess.CompletedProcess:  # fmt: skip
    """`script args` on `nproc` CPU processes (`torchrun --standalone`, gloo), through `run`: the whole tree is stopped
    on the way out. No GPU, offline, one torch thread per rank. `accelerate_cpu` sets ACCELERATE_USE_CPU=1 (accelerate's
    DDP over gloo); False removes it, which runs using accelerate's DeepSpeed plugin need. `env` adds variables."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
               *map(str, args)]  # fmt: skip
    return run(command, timeout=timeout, env=_rank_variables(accelerate_cpu, env), cwd=cwd)


def forked_ranks(script, *args, timeout: float, accelerate_cpu: bool = True, nproc: int = 2, env: dict | None = None,
                 cwd=None, preload: tuple[str, ...] | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """`torchrun` with the ranks forked from one interpreter that imported torch, transformers, TRL and the package
    (`tests/forked_ranks.py`: torchrun's rank environment, exit status and stop of the other ranks): for tests whose
    subject is what the ranks compute, not the launch. Same arguments and result as `torchrun`; `preload` replaces
    the modules imported before the fork (the launcher's own tests, whose scripts need less).

    The launcher is forked from a fork server of this process (`tests/fork_server.py`) that did those imports once,
    one per preload and import environment (`fork_server.IMPORT_PREFIXES`), so a launch pays no import; DHPO_FORK_SERVER=0, or
    an OMP_NUM_THREADS other than 1 (a fork cannot use an OpenMP pool), starts the launcher as a new interpreter."""
    import fork_server  # imports this module: not at the top
    from forked_ranks import PRELOAD

    modules = ",".join(PRELOAD if preload is None else preload)
    argv = [f"--nproc={nproc}", f"--preload={modules}", str(script), *map(str, args)]
    variables = _rank_variables(accelerate_cpu, env)
    if os.environ.get("DHPO_FORK_SERVER") == "0" or variables.get("OMP_NUM_THREADS") != "1":
        return run([sys.executable, FORKED_RANKS, *argv], timeout=timeout, env=variables, cwd=cwd)
    return fork_server.launch(modules, argv, variables, cwd, timeout)


def served_python(env: dict, timeout: float) -> tuple[list[str], dict]:
    """(command, environment) for `python ARGS` run as `tests/served_python.py ARGS`: forked from this process's fork
    server for the default preload and `env`'s import variables (started if none runs), so that it pays no import;
    `[*command, SCRIPT, ...]` with the environment returned. Its exit status and output are those of `python ARGS`;
    a signal meant for it goes to the served process (the server's child), not to the command's own. As for
    `forked_ranks`, DHPO_FORK_SERVER=0 or an OMP_NUM_THREADS other than 1 runs a new interpreter instead."""
    import fork_server  # imports this module: not at the top
    from forked_ranks import PRELOAD

    env = _as_started(env)
    if os.environ.get("DHPO_FORK_SERVER") == "0" or env.get("OMP_NUM_THREADS") != "1":
        return [sys.executable], env
    server = fork_server.server(",".join(PRELOAD), env, timeout)
    return [sys.executable, SERVED_PYTHON], {**env, "DHPO_FORK_SERVER_SOCKET": server.path}


def free_port() -> int:
    """A local TCP port free at the time of the call (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


FORKED_RANKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forked_ranks.py")
FORK_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fork_server.py")
SERVED_PYTHON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "served_python.py")


# Variables that imports in the test process set in its own environment: DeepSpeed's import sets
# PYTORCH_NVML_BASED_CUDA_CHECK (setdefault "1"), torch's inductor writes its default cache folder to
# TORCHINDUCTOR_CACHE_DIR. A child's imports set them the same way. Inherited, they would make every launch after
# the test process's first such import another import environment to the fork servers (`fork_server.IMPORT_PREFIXES`),
# and start a second server with the same imports (7-10 s of CPU), so a launch gets them as this process started.
SET_BY_IMPORTS = ("PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR")
STARTED_WITH = {name: os.environ.get(name) for name in SET_BY_IMPORTS}


def _rank_variables(accelerate_cpu: bool, env: dict | None) -> dict:
    variables = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    variables.pop("ACCELERATE_USE_CPU", None)
    if accelerate_cpu:
        variables["ACCELERATE_USE_CPU"] = "1"
    variables.update(env or {})
    return _as_started(variables)


def _as_started(variables: dict) -> dict:
    """`variables` with `SET_BY_IMPORTS` as this process started, where they hold the values its imports set (also
    when copied from its environment by a caller)."""
    variables = dict(variables)
    for name, started in STARTED_WITH.items():
        if variables.get(name) == os.environ.get(name) != started:
            if started is None:
                del variables[name]
            else:
                variables[name] = started
    return variables


def _read(handle, text: bool):
    handle.seek(0)
    data = handle.read()
    return data.decode(errors="replace") if text else data


def popen(command, **popen_kwargs) -> subprocess.Popen:
    """`subprocess.Popen` in a new session: pair it with `kill_group(process)` in a `finally`."""
    return subprocess.Popen(command, start_new_session=True, **popen_kwargs)
