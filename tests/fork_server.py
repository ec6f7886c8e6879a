"""`python tests/fork_server.py SOCKET [--preload MODULE,...]`: a process that imports the modules once and then, for
each request on the Unix socket SOCKET, forks a `tests/forked_ranks.py` launcher with the request's arguments,
environment, working folder, stdout and stderr, and answers with the launcher's exit status.

`forked_ranks.py` imports the package before it forks its ranks (6-10 s of CPU on the 2-core machine); started as a
new interpreter per launch, it pays that import every time. Forked from this process, a launcher starts with the
imports done. It is the launcher a new interpreter would be: `forked_ranks.main` in a session of its own (its group
is what a timeout kills), this interpreter's initial signal handlers, the request's environment and folder.
The environment is applied after the imports: `processes.forked_ranks` keeps one server per value of the variables
libraries read when imported (`IMPORT_PREFIXES`), so those are the same as at the imports.

Protocol, one connection per launch: the client sends an 8-byte length and a JSON request {"argv", "env", "cwd"}
with the stdout and stderr file descriptors attached (SCM_RIGHTS); the server answers {"pid": launcher} and then
{"status": the launcher's exit status as `subprocess.Popen` reports it, -N when signal N killed it, "cpu_seconds":
the CPU time of the launcher and the descendants it reaped}. A client that
sends b"kill", or closes the connection, has the launcher's whole tree stopped (`processes.kill_tree`) before the
status comes back; a client that closes or stalls inside its request is dropped, the other launches go on. The
server exits, stopping every launcher it still runs, when its stdin reaches end of file (the test process that
started it ended, however it ended) or on SIGTERM; and a launcher gets SIGTERM, which it passes to its ranks, when
the server dies.
"""

import argparse
import atexit
import collections
import contextlib
import ctypes
import json
import os
import runpy
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

import forked_ranks  # this folder: sys.path[0] when run as a script
from processes import FORKED_RANKS, _read, kill_tree

PR_SET_PDEATHSIG = 1
HEADER = struct.Struct("!Q")


def receive_request(conn: socket.socket, timeout: float = 30.0) -> tuple[dict, list[int]]:
    """The request and its file descriptors; raises (the descriptors closed) for a client that closes, stalls past
    `timeout` seconds or sends something else, which the server must survive: other clients' launches run on."""
    conn.settimeout(timeout)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
    try:
        while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
            chunk = conn.recv(1 << 16)
            if not chunk:
                raise EOFError("the client closed the connection inside its request")
            data += chunk
        request = json.loads(data[HEADER.size :])
        if len(fds) != 2 or not isinstance(request, dict):
            raise ValueError("a request is a JSON object with the stdout and stderr descriptors attached")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return request, fds


def send(conn: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):  # a client gone: its launcher is stopped when its connection is read
        conn.sendall((json.dumps(message) + "\n").encode())


def become_launcher(request: dict, fds: list[int], server: int, inherited: list[int]) -> None:
    """In the forked child: the launcher a new interpreter running `forked_ranks.py ARGV` would be, or with "python"
    in the request, what `python ARGS` would run (`run_python`). Never returns."""
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != server:  # the server died before the line above
        os._exit(128 + signal.SIGTERM)
    signal.set_wakeup_fd(-1)
    for number, handler in forked_ranks.INHERITED_HANDLERS.items():
        signal.signal(number, handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in inherited:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    for target, fd in zip((0, 1, 2), (devnull, *fds), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    # What the imports made of the value they saw, as in a new interpreter; a value of the launch's own is kept.
    for key, (seen, left) in IMPORTS_CHANGED.items():
        if request["env"].get(key) != seen:
            continue
        if left is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = left
    os.chdir(request["cwd"])
    if "python" in request:
        run_python(request["python"])
    sys.argv = [FORKED_RANKS, *request["argv"]]  # the launcher's own command line (its usage errors name it)
    sys.exit(forked_ranks.main(request["argv"]))  # a rank's own exit leaves through here too, as in a new interpreter


def run_python(args: list[str]) -> None:
    """`python ARGS` in this process: a script, or `-m module`, as `__main__` with its arguments and module path."""
    if args[:1] == ["-m"]:
        sys.argv = [args[1], *args[2:]]  # runpy puts the module's file in sys.argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")
    sys.exit(0)


def serve(path: str, imported_under: tuple) -> int:
    server = os.getpid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda number, frame: None)  # a handler, so that the wakeup fd hears of it
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    launchers: dict[int, socket.socket] = {}  # launcher pid -> its client's connection
    try:
        print("ready", flush=True)
        # Nobody reads that pipe from here on: a library that prints later would fill it and block this process.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
        while True:
            ready, _, _ = select.select([listener, sys.stdin, wake_read, *launchers.values()], [], [])
            if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1 << 10):
                return 0
            if wake_read in ready:
                os.read(wake_read, 1 << 10)
            while launchers:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
                if not pid:
                    break
                conn = launchers.pop(pid, None)
                if conn is None:  # a child of the imports, not a launcher
                    continue
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)  # what a finished launcher left in its group
                # The launcher's CPU with its reaped descendants': the client's own rusage cannot see a process
                # that is not its descendant.
                send(conn, {"status": os.waitstatus_to_exitcode(status),  # as Popen reports it
                            "cpu_seconds": usage.ru_utime + usage.ru_stime})  # fmt: skip
                conn.close()
            for pid, conn in list(launchers.items()):
                if conn in ready and conn.recv(16) in (b"", b"kill"):
                    kill_tree(pid)  # reaped, and its status sent, on the next turn
            if listener in ready:
                conn, _ = listener.accept()
                try:
                    request, fds = receive_request(conn)
                except (OSError, EOFError, ValueError):  # a client gone or garbled: the other launches go on
                    conn.close()
                    continue
                if import_environment(request["env"]) != imported_under:
                    send(conn, {"refused": "the import variables differ from the server's (IMPORT_PREFIXES)"})
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                inherited = [listener.fileno(), wake_read, wake_write, conn.fileno(),
                             *(c.fileno() for c in launchers.values())]  # fmt: skip
                pid = os.fork()
                if pid == 0:
                    become_launcher(request, fds, server, inherited)
                for fd in fds:
                    os.close(fd)
                launchers[pid] = conn
                send(conn, {"pid": pid})
    finally:
        if os.getpid() == server:  # not in a launcher or a rank leaving through here
            for pid in launchers:
                kill_tree(pid)
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
                os.rmdir(os.path.dirname(path))


# Variables a library may read when it is imported (huggingface_hub's and datasets' offline flags and caches, torch's
# and OpenMP's threads, DeepSpeed's accelerator, the interpreter's module path, the temporary folder, the package's
# warm-start cache, `dhpo_trl.demo.warmstart.DEFAULT_CACHE_DIR`): a launch is
# served only by a server that imported under the same values. The others (ACCELERATE_USE_CPU, torchrun's variables,
# a test's own) are read when the launch runs.
IMPORT_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "DATASETS", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "CUDA",
                   "DS_", "PYTHON", "TOKENIZERS", "HOME", "XDG_", "TMP", "TEMP", "LD_",
                   "DHPO_TRL_CACHE")  # fmt: skip
# The variables the server's imports set, changed or removed: (the value they saw, the value they left; None where
# unset). A launcher's environment is the request's with these applied where it has the value the imports saw, as a
# new interpreter's is after the same imports (the import variables always have it: they pick the server).
IMPORTS_CHANGED: dict[str, tuple[str | None, str | None]] = {}
MAX_SERVERS = 3  # per test process: each holds its imports in memory (about 0.6 GB); the suite uses 2-3 at a time
SERVERS: "collections.OrderedDict[tuple, Server]" = collections.OrderedDict()


def import_environment(env: dict) -> tuple:
    return tuple(sorted((key, value) for key, value in env.items() if key.startswith(IMPORT_PREFIXES)))


class Server:
    """A running fork server, child of this process in a session of its own."""

    def __init__(self, modules: str, env: dict, timeout: float):
        self.owner = os.getpid()  # a fork of this process (a test's) inherits the object, not the server
        self.folder = tempfile.mkdtemp(prefix="fork-server-")
        self.path = os.path.join(self.folder, "socket")
        command = [sys.executable, __file__, self.path, f"--preload={modules}"]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0,
                                        start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + timeout
        line = None  # lines a preloaded module printed come first (unbuffered: `select` sees every byte)
        while line != b"ready\n":
            wait = deadline - time.monotonic()
            ready = wait > 0 and select.select([self.process.stdout], [], [], wait)[0]
            line = self.process.stdout.readline() if ready else b""
            if not line:
                self.stop()
                raise RuntimeError(f"the fork server did not start within {timeout} s (preload {modules!r})")

    def stop(self) -> None:
        """End of stdin: the server stops whatever it still runs and exits; killed with its tree if it does not."""
        if os.getpid() != self.owner:
            return
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(self.process)
        self.process.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def launch(self, argv: list[str], env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
        command = [sys.executable, FORKED_RANKS, *argv]
        deadline = time.monotonic() + timeout
        payload = json.dumps({"argv": argv, "env": env, "cwd": os.path.abspath(cwd or os.getcwd())}).encode()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, socket.socket(socket.AF_UNIX) as conn:
            conn.connect(self.path)
            socket.send_fds(conn, [HEADER.pack(len(payload)) + payload], [out.fileno(), err.fileno()])
            answers = Answers(conn)
            if "refused" in answers.next(deadline):  # the key of SERVERS is the import environment
                raise RuntimeError("the fork server refused a launch of its own import environment")
            try:
                status, timed_out = answers.next(deadline)["status"], False
            except TimeoutError:  # the server stops the launcher's tree (a grace period at most), then answers
                conn.sendall(b"kill")
                status, timed_out = answers.next(time.monotonic() + 60)["status"], True
            stdout, stderr = (_read(handle, True) for handle in (out, err))
        if timed_out:
            raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(command, status, stdout, stderr)


class Answers:
    """The server's answers on one connection: a JSON object a line."""

    def __init__(self, conn: socket.socket):
        self.conn, self.buffer = conn, b""

    def next(self, deadline: float | None) -> dict:
        while b"\n" not in self.buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.conn], [], [], wait)[0]:
                raise TimeoutError
            chunk = self.conn.recv(1 << 16)
            if not chunk:
                raise RuntimeError("the fork server closed the connection before the launch's status")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def launch(modules: str, argv: list[str], env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    """`forked_ranks.py ARGV` launched by this process's server for `modules` and `env`'s import variables."""
    return server(modules, env, timeout).launch(argv, env, cwd, timeout)


def server(modules: str, env: dict, timeout: float) -> Server:
    """This process's server for `modules` and `env`'s import variables (started on the first launch that needs it;
    the least recently used one stopped beyond MAX_SERVERS): also what a `served_python.py` command names."""
    key = (modules, import_environment(env))
    found = SERVERS.pop(key, None)
    if found is not None and found.process.poll() is not None:
        found.stop()
        found = None
    if found is None:
        while len(SERVERS) >= MAX_SERVERS:
            SERVERS.popitem(last=False)[1].stop()
        found = Server(modules, env, timeout)
    SERVERS[key] = found
    return found


@atexit.register
def stop_all() -> None:
    """Every server of this process stopped (pytest's session end, or this interpreter's exit)."""
    while SERVERS:
        SERVERS.popitem()[1].stop()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("socket")
    parser.add_argument("--preload", default=",".join(forked_ranks.PRELOAD))
    options = parser.parse_args(argv)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # the test process is gone: stop (stdin's end says so too)
    if os.environ.get("OMP_NUM_THREADS") != "1":  # a fork cannot use an OpenMP pool (see forked_ranks.py)
        parser.error(
            "OMP_NUM_THREADS must be 1: a launcher forked from here cannot use an OpenMP pool of this process"
        )
    imported_under = import_environment(os.environ)  # before a preload sets any (DS_ACCELERATOR)
    before = dict(os.environ)
    forked_ranks.preload(options.preload)
    changed = {*before, *os.environ} - {key for key in before if before[key] == os.environ.get(key)}
    IMPORTS_CHANGED.update({key: (before.get(key), os.environ.get(key)) for key in changed})
    forked_ranks.freeze_heap()  # a launcher, and a `served_python.py` command, start with the imports frozen
    return serve(options.socket, imported_under)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
