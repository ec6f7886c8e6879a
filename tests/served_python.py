"""`python tests/served_python.py ARGS...`: what `python ARGS...` (a script or `-m module`) does, run by the fork
server (`tests/fork_server.py`) whose socket DHPO_FORK_SERVER_SOCKET names: forked from an interpreter that already
imported the package, so it pays no import. Its output goes where this process's goes, its exit status is this
process's (a signal that killed it kills this one), and SIGTERM or SIGINT to this process stops it and its tree.
Without a server, where the server imported under other import variables (`fork_server.IMPORT_PREFIXES`), or for
interpreter options other than `-m` (`-c`, `-u`, `-X`...), this process becomes `python ARGS...` itself (exec).

For commands that take the interpreter as a setting: `scripts/gpu_check.py --python`, in its CPU dry run's test. The
served process is the server's child, so its CPU is in no rusage of this process or its callers: where
DHPO_SERVED_CPU_FILE names a file, the server's figure for it is appended there (`gpu_check.py` adds it to the part's).
"""

import json
import os
import signal
import socket
import sys

from fork_server import HEADER, Answers  # this folder: sys.path[0] when run as a script

CPU_FILE = "DHPO_SERVED_CPU_FILE"  # where set: a served command appends its CPU seconds there, one number a line


def main(args: list[str]) -> None:
    path = os.environ.get("DHPO_FORK_SERVER_SOCKET")
    # The server runs a script or `-m module`; interpreter options (-c, -u, -X ...) need an interpreter of their own.
    if path and args and (args[0] == "-m" or not args[0].startswith("-")):
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(path)
        payload = json.dumps({"python": args, "argv": [], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(conn, [HEADER.pack(len(payload)) + payload], [1, 2])
        answers = Answers(conn)
        if "refused" not in answers.next(None):
            stop = lambda number, frame: conn.sendall(b"kill")  # noqa: E731 - the server stops the tree, then answers
            signal.signal(signal.SIGTERM, stop)
            signal.signal(signal.SIGINT, stop)
            answer = answers.next(None)
            if os.environ.get(CPU_FILE):  # not this process's descendant: no rusage of its callers counts it
                with open(os.environ[CPU_FILE], "a") as record:
                    record.write(f"{answer['cpu_seconds']}\n")
            code = answer["status"]
            if code < 0:  # killed by a signal (as Popen reports it): die of it too
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            sys.exit(code)
    os.execv(sys.executable, [sys.executable, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
