"""Child processes that never outlive their test: every process a test starts runs in its own session (process
group), and the whole group is killed when the test's call returns, fails, times out or is interrupted.

`subprocess.run(..., timeout=...)` kills only the direct child: torchrun's workers, a bash script's background
jobs or a server a script started would keep running (and holding ports, memory and CPU) after a failed test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile

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


def run(command, *, timeout: float, check: bool = False, capture_output: bool = True, text: bool = True,
        **popen_kwargs) -> subprocess.CompletedProcess:  # fmt: skip
    """`subprocess.run` in a new session; the child's whole process group is killed in every case on the way out
    (a finished leader may leave workers behind). Raises `subprocess.TimeoutExpired` after `timeout` seconds.

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
            kill_group(process)
            process.wait()  # reap the leader (killed above if it was still running)
        stdout, stderr = (_read(out, text), _read(err, text)) if capture_output else (None, None)
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result


GLOO_ABORT = "terminate called without an active exception"  # pytorch/pytorch#179291, see dist_scripts/_teardown.py


def run_ranks(command, *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """`run` for a torchrun command, rerun once when a rank died of gloo's thread abort alone (SIGABRT, exit code
    -6, with that message: seen under the suite's load, never alone); any other failure is returned at once."""
    result = run(command, timeout=timeout, **kwargs)
    if result.returncode != 0 and GLOO_ABORT in (result.stderr or "") and "exitcode: -6" in (result.stderr or ""):
        result = run(command, timeout=timeout, **kwargs)
    return result


def _read(handle, text: bool):
    handle.seek(0)
    data = handle.read()
    return data.decode(errors="replace") if text else data


def popen(command, **popen_kwargs) -> subprocess.Popen:
    """`subprocess.Popen` in a new session: pair it with `kill_group(process)` in a `finally`."""
    return subprocess.Popen(command, start_new_session=True, **popen_kwargs)
