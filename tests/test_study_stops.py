"""A stop signal to a study with two workers (`benchmarks/staleness.py --workers 2`): the study exits with 128 + the
signal's number, saves no cell in progress and leaves no worker behind, whichever process the signal reaches.

The cells are a stand-in for `run_embedded` that stops on the same signals as `DHPOTrainer.train()` (through
`resume.stop_on_signals`), so a run takes seconds: the script is this test's driver, which the spawned workers
import too (as `__mp_main__`), so they see the stand-in. The study's main process is served by a fork server that
imported the package (`tests/served_python.py`: `python DRIVER ARGS` without the import, 6-8 s of CPU a study); the
signals go to it, the parent of the workers, not to the `served_python.py` client, and its exit status is the
client's. The spawned workers are new interpreters, as in a real study."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import processes
import pytest

REPO = Path(__file__).resolve().parents[1]
DRIVER = """
import json, os, sys, time
from pathlib import Path
sys.path[:0] = [{benchmarks!r}, {repo!r}]
import staleness
from dhpo_trl.demo.embedded import TrainingStopped
from dhpo_trl.training import resume


def cell(objective, seed, output_dir, disable_tqdm, settings, max_steps, eval_every, config_overrides,
         final_heldout=None):
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(os.environ["CELL_LOG"], "a") as log:
        log.write(f"{{os.getpid()}} {{os.getppid()}}\\n")
    time.sleep(float(os.environ["WARM_SECONDS"]))  # the warm start: no graceful stop there, as in run_embedded
    with resume.stop_on_signals() as request:
        for step in range(1, max_steps + 1):
            time.sleep(0.2)
            if request.requested:
                raise TrainingStopped(f"stopped by {{request.name}}", {{"signal": request.name}})
    (out / "summary.json").write_text(json.dumps({{"optimizer_steps": max_steps}}))
    raise AssertionError("a cell outlived the test's signal")


staleness.run_embedded = cell
staleness.load_task = lambda settings: None

if __name__ == "__main__":
    sys.exit(staleness.cli())
"""


def _alive(pid: int) -> bool:
    stat = processes._stat(pid)
    return stat is not None and stat[2] != "Z"


WARM = ("one worker in its warm start", "SIGUSR1 to one worker in its warm start")


@pytest.mark.parametrize("target", ["group", "main", "one worker", *WARM, "a worker killed"])
def test_a_stop_signal_ends_a_two_worker_study_with_nothing_saved_and_no_worker_left(tmp_path, target):
    """"a worker killed": SIGKILL, which no cell can take as a stop, to one worker (an OOM kill): the study ends with
    one line naming it and exit status 1, as the other worker and the pool's replacement for the killed one end.
    A stop signal to one worker in its warm start (outside training, where a cell has no graceful stop and the signal
    ends it) is a stop all the same: 128 + the signal's number, on one line naming the signal and the worker."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(benchmarks=str(REPO / "benchmarks"), repo=str(REPO)))
    log = tmp_path / "cells.log"
    # One OpenMP thread, which a fork server needs (the stand-in cells compute nothing).
    warm = "120" if target in WARM else "0"  # the signal reaches the worker in its warm start, or in training
    variables = processes._rank_variables(False, {"CELL_LOG": str(log), "WARM_SECONDS": warm})
    python, env = processes.served_python(variables, timeout=240)
    command = [*python, str(driver), "--objectives", "GRPO", "--ks", "2", "--seeds", "0", "1", "2",
               "--generation-batches", "500", "--workers", "2", "--out-dir", str(tmp_path / "out"),
               "--docs-dir", str(tmp_path / "docs")]  # fmt: skip
    study = processes.popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while len(log.read_text().splitlines() if log.exists() else []) < 2:  # both workers are in a cell
            assert study.poll() is None and time.monotonic() < deadline, "the study did not start its cells"
            time.sleep(0.2)
        cells = [[int(pid) for pid in line.split()] for line in log.read_text().splitlines()]
        workers = [worker for worker, _ in cells]
        (main,) = {parent for _, parent in cells}  # the study's main process (the served one)
        time.sleep(0.5)
        if target == "group":
            os.killpg(main, signal.SIGTERM)  # a session of its own, as the study started by itself
        elif target == "a worker killed":
            os.kill(workers[0], signal.SIGKILL)
        elif target in WARM:
            os.kill(workers[0], signal.SIGUSR1 if target.startswith("SIGUSR1") else signal.SIGTERM)
        else:
            os.kill(main if target == "main" else workers[0], signal.SIGTERM)
        _, stderr = study.communicate(timeout=60)  # a pool that waits for its stopped workers never returns
        if target == "a worker killed":  # cell_pool.WorkerDied, reported on one line, not a stop nor a traceback
            (line,) = [line for line in stderr.splitlines() if line.startswith("[staleness] ")]
            assert study.returncode == 1 and f"(pid {workers[0]})" in line, stderr
            assert "WorkerDied" not in stderr, stderr
        elif target in WARM:  # cell_pool.worker_end: the worker's death by the signal is the study's stop
            signum = signal.SIGUSR1 if target.startswith("SIGUSR1") else signal.SIGTERM
            (line,) = [line for line in stderr.splitlines() if line.startswith("[staleness] ")]
            assert study.returncode == 128 + signum, stderr
            assert signum.name in line and f"(pid {workers[0]})" in line, line
        else:
            assert study.returncode == 128 + signal.SIGTERM, stderr
        left = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < left:
            time.sleep(0.2)
        assert not [pid for pid in workers if _alive(pid)]  # no worker goes on with its cell as an orphan
        assert not list((tmp_path / "out").rglob("summary.json"))
    finally:
        processes.kill_tree(study, grace=1)  # the client: the server then stops the served study's tree
        for pid in workers if "workers" in locals() else []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


FAILING = """
import json, os, sys, time
from pathlib import Path
sys.path[:0] = [{benchmarks!r}, {repo!r}]
import {study} as benchmark


def cell(name, seed, output_dir, **settings):
    # (GRPO, seed 0) finishes at once; (GRPO, seed 1) raises once the other worker is in its (long) cell.
    out, log = Path(output_dir), Path(os.environ["CELL_LOG"])
    if out.name == "_warmup":
        return {{}}
    with open(log, "a") as handle:
        handle.write(f"{{name}} {{seed}} {{os.getpid()}}\\n")
    if (name, seed) == ("GRPO", 0):
        out.mkdir(parents=True, exist_ok=True)
        summary = {{"algorithm": name, "seed": seed, "optimizer_steps": settings.get("max_steps"),
                    "summary_path": str(out / "summary.json"), "heldout_accuracy_before": 0.5,
                    "heldout_accuracy_after": 0.75, "train_seconds": 1.0}}
        (out / "summary.json").write_text(json.dumps(summary))
        return summary
    if (name, seed) == ("GRPO", 1):
        while len(log.read_text().splitlines()) < 3:
            time.sleep(0.05)
        raise ValueError("a bug in one cell")
    time.sleep(300)  # waited for by a study that takes its results only once every cell ended


benchmark.run_embedded = cell
benchmark.load_task = lambda settings: None

if __name__ == "__main__":
    sys.exit(benchmark.cli())
"""


@pytest.mark.parametrize("study", ["study", "staleness"])
def test_a_cell_that_raises_ends_the_study_at_once_naming_it_and_keeps_the_finished_cells(tmp_path, study):
    """Two workers, four cells: the first finishes and is saved, the second runs long, the third raises. The study
    ends within seconds, not when the long cell would end (a `Pool.map` waits for every cell first), with one line
    naming the cell that raised (its objective and seed) and what it raised, and exit status 1; the finished cell's
    summary is on disk (the rerun skips it), the long one is stopped unsaved, and no worker is left."""
    driver = tmp_path / "driver.py"
    driver.write_text(FAILING.format(benchmarks=str(REPO / "benchmarks"), repo=str(REPO), study=study))
    log, out = tmp_path / "cells.log", tmp_path / "out"
    python, env = processes.served_python(processes._rank_variables(False, {"CELL_LOG": str(log)}), timeout=240)
    names = ["--algorithms", "GRPO", "GSPO"] if study == "study" else ["--objectives", "GRPO", "GSPO", "--ks", "2",
                                                                       "--generation-batches", "500"]  # fmt: skip
    command = [*python, str(driver), *names, "--seeds", "0", "1", "--workers", "2", "--out-dir", str(out),
               "--docs-dir", str(tmp_path / "docs")]  # fmt: skip
    study_process = processes.popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = study_process.communicate(timeout=90)  # the long cell would take 300 s
        lines = [line for line in stderr.splitlines() if line.startswith(f"[{study}] ")]
        assert study_process.returncode == 1 and len(lines) == 1, stderr
        cell = "('GRPO', 1, " if study == "study" else "('GRPO', 2, 1, "
        assert cell in lines[0] and "ValueError('a bug in one cell')" in lines[0], lines
        ran = [line.split() for line in log.read_text().splitlines()]
        # the last cell may have begun too, on the worker whose cell raised
        assert {("GRPO", "0"), ("GSPO", "0"), ("GRPO", "1")} <= {(name, seed) for name, seed, _ in ran}, ran
        assert [path.parent.name for path in out.rglob("summary.json")] == ["GRPO-seed0"]
        workers = {int(pid) for _, _, pid in ran}
        left = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < left:
            time.sleep(0.2)
        assert not [pid for pid in workers if _alive(pid)]
    finally:
        processes.kill_tree(study_process, grace=1)
