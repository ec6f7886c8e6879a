"""tests/fork_server.py: `processes.forked_ranks` launches through a server of the test process that imported the
modules once; each launch keeps the launcher's exit status, stop of the other ranks and timeout, and nothing the
server started outlives the process that started it."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import fork_server
import processes
import pytest
from test_processes import RANK_WORK, alive, wait_gone

PRELOAD = ("torch.distributed",)  # what RANK_WORK imports


def _ranks(result_stdout):
    return sorted((json.loads(line) for line in result_stdout.splitlines() if line.startswith("{")),
                  key=lambda seen: seen["RANK"])  # fmt: skip


def _parent(pid):
    return int(processes._stat(pid)[1])


@pytest.mark.parametrize("statuses, expected", [(("0", "0"), 0), (("0", "3"), 3), (("hang", "kill"), 128 + 9)],
                         ids=["ok", "exit-3", "killed"])  # fmt: skip
def test_a_served_launch_exits_as_the_launcher_and_stops_the_others(tmp_path, statuses, expected):
    script = tmp_path / "work.py"
    script.write_text(RANK_WORK.replace('"main": __name__', '"main": __name__, "launcher": os.getppid()'))
    result = processes.forked_ranks(script, *statuses, timeout=120, preload=PRELOAD, env={"EXTRA": "x"}, cwd=tmp_path)
    assert result.returncode == expected, result.stderr[-3000:]
    ranks = _ranks(result.stdout)
    assert [(seen["RANK"], seen["sum"], seen["argv"]) for seen in ranks] == [("0", 1.0, list(statuses)),
                                                                           ("1", 1.0, list(statuses))]  # fmt: skip
    assert wait_gone([seen["pid"] for seen in ranks]) == []
    server = fork_server.SERVERS[
        (",".join(PRELOAD), fork_server.import_environment(processes._rank_variables(True, None)))
    ]
    assert len({seen["launcher"] for seen in ranks}) == 1 and not alive(ranks[0]["launcher"])
    assert server.process.poll() is None  # serves the next launch


# Each rank writes its pid and its launcher's, then sleeps.
RANK_SLEEP = """
import json, os, sys, time
with open(os.path.join(sys.argv[1], os.environ["RANK"]), "w") as handle:
    json.dump({"pid": os.getpid(), "launcher": os.getppid(), "cwd": os.getcwd(), "extra": os.environ.get("EXTRA")}, handle)
time.sleep(600)
"""


def _wait_for_ranks(folder, seconds=60):
    deadline = time.monotonic() + seconds
    while not all((folder / rank).exists() and (folder / rank).read_text() for rank in ("0", "1")):
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.05)
    return [json.loads((folder / rank).read_text()) for rank in ("0", "1")]


def test_a_served_launch_that_times_out_leaves_nothing_and_the_server_serves_on(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text(RANK_SLEEP)
    processes.forked_ranks(script.parent / "none.py", timeout=120, preload=PRELOAD)  # the server's start is not timed
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        processes.forked_ranks(script, tmp_path, timeout=8, preload=PRELOAD, env={"EXTRA": "y"}, cwd=tmp_path)
    assert time.monotonic() - start < 8 + 15
    ranks = _wait_for_ranks(tmp_path, seconds=0)
    assert [(seen["cwd"], seen["extra"]) for seen in ranks] == [(str(tmp_path), "y")] * 2
    assert wait_gone([ranks[0]["launcher"], *(seen["pid"] for seen in ranks)]) == []
    assert processes.forked_ranks(script.parent / "none.py", timeout=60, preload=PRELOAD).returncode == 1


# A test process that launches RANK_SLEEP through its fork server, then is killed (SIGKILL: no cleanup of its own).
CLIENT = """
import sys
sys.path.insert(0, sys.argv[1])
import processes
processes.forked_ranks(sys.argv[2], sys.argv[3], timeout=600, preload=("torch.distributed",))
"""


def test_nothing_outlives_a_killed_test_process(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text(RANK_SLEEP)
    client = processes.popen([sys.executable, "-c", CLIENT, os.path.dirname(processes.__file__), str(script), str(tmp_path)],
                             env=processes._rank_variables(True, None))  # fmt: skip
    try:
        ranks = _wait_for_ranks(tmp_path)
        launcher = ranks[0]["launcher"]
        server = _parent(launcher)
        assert _parent(server) == client.pid
        client.send_signal(signal.SIGKILL)
        client.wait()
        assert wait_gone([server, launcher, *(seen["pid"] for seen in ranks)], seconds=20) == []
    finally:
        processes.kill_tree(client)


def test_the_import_environment_picks_the_server():
    base = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": "/a", "RANK": "0", "ACCELERATE_USE_CPU": "1"}
    key = fork_server.import_environment(base)
    assert key == (("HF_HUB_OFFLINE", "1"), ("OMP_NUM_THREADS", "1"), ("PYTHONPATH", "/a"))
    assert fork_server.import_environment({**base, "ACCELERATE_USE_CPU": "0", "EXTRA": "x"}) == key
    assert fork_server.import_environment({**base, "PYTHONPATH": "/b"}) != key
    assert fork_server.import_environment({**base, "DHPO_TRL_CACHE": "/c"}) != key  # read when warmstart is imported


def test_served_python_runs_in_the_server_and_outside_it_only_under_other_import_variables(tmp_path):
    """`python served_python.py SCRIPT ARGS` is `python SCRIPT ARGS` (arguments, `__main__`, exit status, output),
    forked from the server when the import variables are the server's, this process itself (exec) when not."""
    script = tmp_path / "parent.py"
    script.write_text("import os, sys\nprint(os.getppid(), __name__, sys.argv[1:])\nsys.exit(int(sys.argv[1]))\n")
    env = processes._rank_variables(True, None)
    server = fork_server.Server(",".join(PRELOAD), env, 120)
    served = [sys.executable, os.path.join(os.path.dirname(fork_server.__file__), "served_python.py"), str(script)]
    try:
        for extra, parent in (({}, server.process.pid), ({"HF_HOME": str(tmp_path)}, os.getpid())):
            for code in ("3", "137"):  # 137: an exit status, not SIGKILL
                variables = {**env, **extra, "DHPO_FORK_SERVER_SOCKET": server.path}
                result = subprocess.run([*served, code, "x"], env=variables, capture_output=True, text=True, timeout=120)
                assert result.returncode == int(code)
                assert result.stdout.split(None, 1) == [str(parent), f"__main__ ['{code}', 'x']\n"]
        # an interpreter option: run by an interpreter of its own, as `python -c` would
        command = [served[0], served[1], "-c", "import os, sys; print(os.getppid(), sys.argv[1:]); sys.exit(4)", "y"]
        variables = {**env, "DHPO_FORK_SERVER_SOCKET": server.path}  # the server's import variables
        result = subprocess.run(command, env=variables, capture_output=True, text=True, timeout=120)
        assert (result.returncode, result.stdout) == (4, f"{os.getpid()} ['y']\n"), result.stderr[-3000:]
    finally:
        server.stop()


# Rank 0 kills its launcher (SIGKILL: no status of its own), then both ranks sleep.
KILL_LAUNCHER = """
import os, signal, sys, time
open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w").write(str(os.getpid()))
if os.environ["RANK"] == "0":
    os.kill(os.getppid(), signal.SIGKILL)
time.sleep(600)
"""


def test_a_launcher_killed_by_a_signal_has_the_status_a_new_interpreter_has(tmp_path, monkeypatch):
    """`subprocess.Popen`'s -N for a launcher that signal N killed, served or not; its ranks are stopped."""
    script = tmp_path / "kill.py"
    script.write_text(KILL_LAUNCHER)
    codes = {}
    for served in ("1", "0"):
        monkeypatch.setenv("DHPO_FORK_SERVER", served)
        folder = tmp_path / served
        folder.mkdir()
        result = processes.forked_ranks(script, folder, timeout=120, preload=PRELOAD)
        codes[served] = result.returncode
        ranks = [int(path.read_text()) for path in folder.iterdir() if path.read_text()]
        assert ranks and wait_gone(ranks) == [], result.stderr[-3000:]
    assert codes == {"1": -signal.SIGKILL, "0": -signal.SIGKILL}


def test_the_server_survives_clients_that_leave_or_stall_inside_their_request(tmp_path):
    """A client gone before its request is whole (a killed `served_python.py`), or one that sends something else, is
    dropped: the server runs on and serves the next launch."""
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    env = processes._rank_variables(True, None)
    server = fork_server.Server(",".join(PRELOAD), env, 120)
    try:
        for partial in (b"", fork_server.HEADER.pack(1000) + b"{", fork_server.HEADER.pack(2) + b"{}"):
            with socket.socket(socket.AF_UNIX) as conn:
                conn.settimeout(60)
                conn.connect(server.path)
                conn.sendall(partial)
                conn.shutdown(socket.SHUT_WR)
                assert conn.recv(1 << 10) == b""  # dropped without an answer
            assert server.process.poll() is None
        result = server.launch(["--nproc=1", "--preload=", str(script)], env, tmp_path, 60)
        assert (result.returncode, result.stdout) == (0, "ran\n"), result.stderr[-3000:]
        server.stop()
        assert server.process.returncode == 0  # it heard its stdin end: not killed after stop's wait
    finally:
        server.stop()


def test_a_killed_server_leaves_no_launcher_and_no_rank(tmp_path):
    """The server killed outright (SIGKILL: the OOM killer's choice, its 0.6 GB of imports): each launcher gets
    SIGTERM from its parent's death and passes it to its ranks."""
    script = tmp_path / "sleep.py"
    script.write_text(RANK_SLEEP)
    env = processes._rank_variables(True, None)
    server = fork_server.Server(",".join(PRELOAD), env, 120)
    client, ranks = None, []
    try:
        client = processes.popen([sys.executable, "-c", SERVED_CLIENT, os.path.dirname(processes.__file__),
                                  server.path, str(script), str(tmp_path)], env=env)  # fmt: skip
        ranks = _wait_for_ranks(tmp_path)
        server.process.kill()
        server.process.wait()
        assert wait_gone([ranks[0]["launcher"], *(seen["pid"] for seen in ranks)], seconds=20) == []
    finally:
        if client is not None:
            processes.kill_tree(client)
        if ranks and alive(ranks[0]["launcher"]):  # left by a failure: out of every tree once the server is gone
            processes.kill_tree(ranks[0]["launcher"], grace=1)
        server.stop()


# A launch through a given server, from a process of its own (the test keeps the server to kill it).
SERVED_CLIENT = """
import sys
sys.path.insert(0, sys.argv[1])
import fork_server, os
server = fork_server.Server.__new__(fork_server.Server)
server.path = sys.argv[2]
server.launch(["--nproc=2", "--preload=torch.distributed", sys.argv[3], sys.argv[4]], dict(os.environ), None, 600)
"""


def test_a_preload_that_prints_still_starts_the_server(tmp_path):
    """Lines a preloaded module prints before the server is ready do not count as a failed start (`this` prints)."""
    script = tmp_path / "ok.py"
    script.write_text("import sys\nprint('this' in sys.modules)\n")
    env = processes._rank_variables(True, None)
    server = fork_server.Server("this", env, 120)
    try:
        result = server.launch(["--nproc=1", "--preload=", str(script)], env, tmp_path, 60)
        assert (result.returncode, result.stdout) == (0, "True\n"), result.stderr[-3000:]
    finally:
        server.stop()


def test_a_launch_sees_the_variables_its_imports_set_served_or_not(tmp_path, monkeypatch):
    """A library that sets a variable when imported (torch's TORCHINDUCTOR_CACHE_DIR, DeepSpeed's accelerator): the
    ranks of a served launch see it as those of a new interpreter do, and a variable set for the launch still wins
    where the library only sets a default."""
    (tmp_path / "sets_at_import.py").write_text(
        "import os\nos.environ['DHPO_SET_AT_IMPORT'] = 'set'\nos.environ.setdefault('DHPO_DEFAULT_AT_IMPORT', 'd')\n"
    )
    script = tmp_path / "report.py"
    script.write_text("import os\nprint(os.environ.get('DHPO_SET_AT_IMPORT'), os.environ.get('DHPO_DEFAULT_AT_IMPORT'))\n")
    seen = {}
    for served in ("1", "0"):
        monkeypatch.setenv("DHPO_FORK_SERVER", served)
        for default in (None, "mine"):
            env = {"PYTHONPATH": str(tmp_path), **({"DHPO_DEFAULT_AT_IMPORT": default} if default else {})}
            result = processes.forked_ranks(script, timeout=120, nproc=1, preload=("sets_at_import",), env=env)
            assert result.returncode == 0, result.stderr[-3000:]
            seen[served, default] = result.stdout
    assert seen == {(served, default): f"set {default or 'd'}\n" for served in "10" for default in (None, "mine")}


def test_a_served_launch_with_a_bad_argument_fails_as_a_new_interpreter_does(tmp_path, monkeypatch):
    script = tmp_path / "ok.py"
    script.write_text("")
    seen = {}
    for served in ("1", "0"):
        monkeypatch.setenv("DHPO_FORK_SERVER", served)
        result = processes.forked_ranks(script, timeout=120, nproc="two", preload=PRELOAD)
        seen[served] = (result.returncode, result.stderr.splitlines()[-1])
    assert seen["1"] == seen["0"] and seen["0"][0] == 2 and "--nproc" in seen["0"][1]
