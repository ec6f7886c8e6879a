"""tests/processes.py: a child that spawned a grandchild and hangs leaves nothing alive after the timeout; torchrun's
helper starts CPU ranks with the shared environment."""

import functools
import json
import os
import signal
import subprocess
import sys
import time

import processes
import pytest

# The child starts a sleeping grandchild in its own process group (inherited), prints the grandchild's pid, hangs.
HANGING_PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(child.pid, flush=True)\n"
    "if len(sys.argv) > 1: open(sys.argv[1], 'w').write(str(child.pid))\n"
    "time.sleep(600)\n"
)


def alive(pid):
    """Whether `pid` is a live process (a zombie counts as gone: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def test_timeout_kills_child_and_grandchild():
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as error:
        processes.run([sys.executable, "-c", HANGING_PARENT], timeout=3)
    assert time.monotonic() - start < 3 + 5
    grandchild = int(error.value.output.split()[0])
    assert wait_gone([grandchild]) == []


def test_a_finished_leader_does_not_leave_its_workers_behind():
    """The leader exits at once; its grandchild would sleep on as an orphan (and hold the output open)."""
    start = time.monotonic()
    result = processes.run([sys.executable, "-c", HANGING_PARENT.rsplit("time.sleep", 1)[0]], timeout=30)
    assert result.returncode == 0 and time.monotonic() - start < 20
    assert wait_gone([int(result.stdout.split()[0])]) == []


def test_an_interrupt_while_waiting_kills_the_group(monkeypatch, tmp_path):
    """A failure while waiting (here: KeyboardInterrupt out of the first wait) still kills the whole group."""
    started = []

    class InterruptedPopen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self.pid)
            self.interrupted = False

        def wait(self, timeout=None):
            if not self.interrupted:  # the caller's wait: interrupted once the grandchild has started
                self.interrupted = True
                time.sleep(1.0)
                raise KeyboardInterrupt
            return super().wait(timeout)

    monkeypatch.setattr(subprocess, "Popen", InterruptedPopen)
    with pytest.raises(KeyboardInterrupt):
        processes.run([sys.executable, "-c", HANGING_PARENT, str(tmp_path / "pid")], timeout=60)
    grandchild = int((tmp_path / "pid").read_text())
    assert wait_gone([started[0], grandchild]) == []


# Each rank writes what torchrun and the helper gave it.
RANK_REPORT = """
import json, os, sys
keys = ("RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "ACCELERATE_USE_CPU", "EXTRA")
os.write(1, (json.dumps({key: os.environ.get(key) for key in keys}) + "\\n").encode())  # one write: see RANK_WORK
"""


def _ranks_seen(result):
    return sorted((json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
                  key=lambda seen: seen["RANK"])  # fmt: skip


# The forked launcher's tests preload only what their scripts import: the package's import (several seconds of CPU a
# launch) is what the other two-process tests exercise.
FORKED = functools.partial(processes.forked_ranks, preload=())


@pytest.mark.parametrize("accelerate_cpu", [True, False])
@pytest.mark.parametrize("launch", [processes.torchrun, FORKED], ids=["torchrun", "forked"])
def test_torchrun_starts_two_cpu_ranks(tmp_path, monkeypatch, accelerate_cpu, launch):
    script = tmp_path / "report.py"
    script.write_text(RANK_REPORT)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")  # an outer value must not leak into a DeepSpeed run
    result = launch(script, timeout=120, accelerate_cpu=accelerate_cpu, env={"EXTRA": "x"})
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = _ranks_seen(result)
    assert [(seen["RANK"], seen["WORLD_SIZE"]) for seen in ranks] == [("0", "2"), ("1", "2")]
    assert {(seen["CUDA_VISIBLE_DEVICES"], seen["OMP_NUM_THREADS"], seen["EXTRA"]) for seen in ranks} == {("", "1", "x")}
    assert {seen["ACCELERATE_USE_CPU"] for seen in ranks} == {"1" if accelerate_cpu else None}


# Each rank joins a gloo group through torchrun's variables, all-reduces its rank, reports its own process, leaves the
# group, waits until every rank has left it (marker files: no rank's exit can break a peer's collective), and exits
# with the status given for it (a rank whose status is "hang" sleeps instead; "kill" kills itself with SIGKILL;
# "raise" raises, which exits 1 with the traceback).
RANK_WORK = """
import json, os, signal, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
seen = {key: os.environ[key] for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
report = {**seen, "sum": total.item(), "pid": os.getpid(), "main": __name__, "argv": sys.argv[1:]}
os.write(1, (json.dumps(report) + "\\n").encode())  # one write: the ranks share the output, a print may take two
rank, world = dist.get_rank(), dist.get_world_size()
dist.destroy_process_group()
folder = os.path.dirname(os.path.abspath(__file__))
open(os.path.join(folder, f"left{rank}"), "w").close()
while not all(os.path.exists(os.path.join(folder, f"left{r}")) for r in range(world)):
    time.sleep(0.01)
status = sys.argv[1 + rank]
if status == "hang":
    time.sleep(600)
if status == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if status == "raise":
    raise RuntimeError("a rank's own error")
sys.exit(int(status))
"""


def test_forked_ranks_are_torchruns_ranks_in_processes_of_their_own(tmp_path):
    """Each rank: its own process, torchrun's variables, `__main__` with its arguments, a working gloo group."""
    script = tmp_path / "work.py"
    script.write_text(RANK_WORK)
    result = processes.forked_ranks(script, "0", "0", timeout=120, preload=("torch.distributed",))
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = _ranks_seen(result)
    assert [(s["RANK"], s["LOCAL_RANK"], s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"]) for s in ranks] == [
        ("0", "0", "2", "2"), ("1", "1", "2", "2")]  # fmt: skip
    assert [s["sum"] for s in ranks] == [1.0, 1.0] and {s["main"] for s in ranks} == {"__main__"}
    assert ranks[0]["argv"] == ["0", "0"] and len({s["pid"] for s in ranks}) == 2


@pytest.mark.parametrize("statuses, expected", [(("0", "3"), 3), (("5", "hang"), 5), (("hang", "kill"), 128 + 9),
                                                (("hang", "raise"), 1)],
                         ids=["exit-3", "exit-5-other-hangs", "killed", "raised"])  # fmt: skip
def test_a_failing_forked_rank_fails_the_launch_and_stops_the_others(tmp_path, statuses, expected):
    """The failing rank's status is the launch's (a signal: 128 + its number, as a shell reports it), and a rank still
    running is stopped by the launcher itself before it exits (started here without `processes.run`, whose cleanup
    would hide a rank left behind)."""
    script = tmp_path / "work.py"
    script.write_text(RANK_WORK)
    command = [sys.executable, processes.FORKED_RANKS, "--preload=torch.distributed", str(script), *statuses]
    launcher = processes.popen(command, env=processes._rank_variables(True, None), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        out, err = launcher.communicate(timeout=100)
        ranks = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert launcher.returncode == expected, err[-3000:]
        assert len(ranks) == 2 and wait_gone([seen["pid"] for seen in ranks], seconds=0.5) == []
    finally:
        processes.kill_tree(launcher)


# Each rank marks that it runs, sleeps, and marks on its way out (a `finally`, as a script's cleanup of the servers
# it started is): what a SIGINT leaves it time to do.
RANK_CLEANUP = """
import os, signal, time
folder, rank = os.path.dirname(os.path.abspath(__file__)), os.environ["RANK"]
try:  # the rank's SIGINT handler and blocked signals, for the failure message
    state = f"{signal.getsignal(signal.SIGINT)} blocked {sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))}"
    with open(os.path.join(folder, f"running{rank}"), "w") as file:
        file.write(state)
    time.sleep(600)
finally:
    open(os.path.join(folder, f"cleaned{rank}"), "w").close()
"""


def as_a_shell_starts_it():
    """A command started from a terminal: SIGINT and SIGTERM at their defaults and not blocked, whatever this test
    process inherited (a pytest worker can run with SIGINT ignored or blocked; its children would inherit that)."""
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))


def test_sigint_reaches_forked_ranks_as_a_keyboard_interrupt(tmp_path):
    """A torchrun rank is a new Python interpreter: SIGINT raises KeyboardInterrupt in it and its `finally` blocks
    run. A forked rank has the same handler, so a SIGINT to the launcher, passed on, lets each rank clean up."""
    script = tmp_path / "work.py"
    script.write_text(RANK_CLEANUP)
    command = [sys.executable, processes.FORKED_RANKS, "--preload=", str(script)]
    launcher = processes.popen(command, env=processes._rank_variables(True, None), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=as_a_shell_starts_it)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"running{rank}").exists() for rank in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # each rank has written its state
        states = [(tmp_path / f"running{rank}").read_text() for rank in (0, 1)]
        launcher.send_signal(signal.SIGINT)
        try:
            _, err = launcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the ranks kept running after SIGINT; their SIGINT handler and blocked signals: {states}")
        assert launcher.returncode != 0, err[-3000:]
        assert [(tmp_path / f"cleaned{rank}").exists() for rank in (0, 1)] == [True, True], err[-3000:]
    finally:
        processes.kill_tree(launcher)


def test_forked_ranks_get_torchruns_one_openmp_thread_by_default(tmp_path):
    """torchrun sets OMP_NUM_THREADS=1 for its ranks when it is unset and more than one rank runs. The forked launcher
    sets it before its imports: the ranks get one thread, and no OpenMP pool of the parent is copied into a fork."""
    script = tmp_path / "report.py"
    threads = "import torch; os.write(1, (json.dumps({'threads': torch.get_num_threads()}) + '\\n').encode())\n"
    script.write_text(RANK_REPORT + threads)
    variables = {key: value for key, value in processes._rank_variables(True, None).items() if key != "OMP_NUM_THREADS"}
    command = [sys.executable, processes.FORKED_RANKS, "--preload=torch", str(script)]
    result = processes.run(command, timeout=120, env=variables)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["OMP_NUM_THREADS"] for line in lines if "RANK" in line] == ["1", "1"]
    assert [line["threads"] for line in lines if "threads" in line] == [1, 1]


# A launcher like planted_bugs' pytest: it starts, in a session of its own (as `run` and torchrun do), a child that
# starts a sleeping grandchild in yet another session, then hangs. Its group holds only itself. With a third
# argument the grandchild ignores SIGTERM, as a rank blocked in a gloo collective does.
NESTED_SESSIONS = (
    "import subprocess, sys, time\n"
    "ignore = 'signal.signal(signal.SIGTERM, signal.SIG_IGN); ' if len(sys.argv) > 2 else ''\n"
    "grandchild = ('import os, signal, sys, time; ' + ignore +\n"  # writes its pid once its handler is set
    "              'open(sys.argv[1], \"w\").write(str(os.getpid())); time.sleep(600)')\n"
    "inner = ('import subprocess, sys, time\\n'\n"
    "         'subprocess.Popen([sys.executable, \"-c\", sys.argv[2], sys.argv[1]], start_new_session=True)\\n'\n"
    "         'time.sleep(600)\\n')\n"
    "child = subprocess.Popen([sys.executable, '-c', inner, sys.argv[1], grandchild], start_new_session=True)\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def test_timeout_kills_descendants_in_other_sessions(tmp_path):
    """The launcher dies of SIGTERM at once (no cleanup of its own); its child and grandchild, each in a session of
    its own, are outside its process group: the tree walk must still stop them."""
    marker = tmp_path / "grandchild"
    with pytest.raises(subprocess.TimeoutExpired) as error:
        processes.run([sys.executable, "-c", NESTED_SESSIONS, str(marker)], timeout=8)
    child, grandchild = int(error.value.output.split()[0]), int(marker.read_text())
    assert wait_gone([child, grandchild]) == []


def test_kill_tree_reports_what_it_stopped(tmp_path):
    """The grandchild ignores SIGTERM: only the SIGKILL after the grace period stops it."""
    marker = tmp_path / "grandchild"
    launcher = processes.popen([sys.executable, "-c", NESTED_SESSIONS, str(marker), "ignore-sigterm"],
                               stdout=subprocess.PIPE)  # fmt: skip
    try:
        child = int(launcher.stdout.readline())
        deadline = time.monotonic() + 30
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline, "the grandchild never started"
            time.sleep(0.05)
        grandchild = int(marker.read_text())
        assert {child, grandchild} <= set(processes.descendants(launcher.pid))
        assert processes.kill_tree(launcher, grace=2) == []
        assert launcher.returncode == -15  # SIGTERM, the first signal
        assert wait_gone([child, grandchild], seconds=1) == []
    finally:
        processes.kill_tree(launcher)
        launcher.stdout.close()
