"""Runs the GPU evidence of `scripts/gpu_check.sh` part by part, each in its own process with its own time box, and
writes OUTPUT_DIR/gpu_check.json (every part's status, seconds, figures or error) and OUTPUT_DIR/gpu_check.log.

    python scripts/gpu_check.py OUTPUT_DIR                  # on a GPU machine: 8 minutes at most
    python scripts/gpu_check.py --cpu OUTPUT_DIR            # the CPU dry run: the same parts at tiny shapes
    python scripts/gpu_check.py --parts bench-qwen3-1.7b OUTPUT_DIR

Parts, in order: `wheels` (install the carried wheels), `environment` (versions against the pins, the GPU, the
varlen kernels), `tests` (tests/test_gpu.py, marker `gpu`), `train` (DHPO-E off-policy steps with generation on a
random Qwen3-0.6B), `bench-qwen3-1.7b` (benchmarks/bench_dynamic_batching.py, bf16, the long-tailed workload, the
arms of BENCH_PLAN interleaved, some at their own batch shape, and any profiled arms), `routing-overhead` (the
cost of recording and replaying MoE routing, Qwen3-30B-A3B's layers) and `routing-rollout` (R3 against vLLM's
offline engine: routing returned, flip fraction before replay, replayed exactly). A part that fails or runs
out of time leaves its status, its error (the last lines of its output) and whatever figures it wrote, and the next
part runs. Each part gets its box or less: the whole run keeps inside --total-seconds, with each later part's minimum
held back for it; a part's minimum is the time it takes on one H100, so the planned parts fit in GPU_SECONDS with a
margin and one that overruns takes the margin, not a later part's time. Standard library only: this runs before the
wheels are installed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each benchmark's arms, timed runs per arm (--repeats; --wide-repeats for an arm at its own shape, NAME@BxA) and
# profiled arms. The targets compare packed rows with dynamic batching and TRL at two shapes of the same sequences:
# TRL's 4 x 8, where the H100 and H200 runs found the update bound by the host's work per micro-step, and 16 x 2
# (the same tokens in a quarter of the micro-steps), where it is not; twice each. No profile: the H200 run's
# (docs/performance_gpu.md) said where a micro-step's time goes, and the time is the six arms'.
BENCH_PLAN = {"qwen3-1.7b": {"arms": "trl,dynamic,packed,trl@16x2,dynamic@16x2,packed@16x2", "repeats": 2,
                             "wide_repeats": 2, "profile": ""}}
# One H100, bf16, batch 4 x 8 accumulation of the long-tailed workload: a benchmark process's start (Python, imports,
# tokenizer) and one run of it (model build, trainer, two optimizer steps: 6-10 s of update and scoring at 1.7B, as
# docs/performance_gpu.md's figures give them, TRL's the 10, plus the set-up). A profiled run counts 1.5 runs. An arm
# at 16 x 2 is held the same: it forwards no more tokens than TRL at 4 x 8 in a quarter of the micro-steps (a
# `trl@16x2` run took 9.8-10.1 s on the H200, TRL at 4 x 8 11.0-14.4 s).
BENCH_START_SECONDS = 12
BENCH_RUN_SECONDS = {"qwen3-1.7b": 14}
GPU_SECONDS = 480  # the whole GPU run: inside a 540 s device command with the last part's grace and Python's start
GRACE_SECONDS = 15  # a timed-out part's wait between SIGTERM and SIGKILL
# The padding-free update's throughput ratios, judged at every batch shape whose two arms the benchmark was asked for
TARGETS = {"bench-qwen3-1.7b": {"packed/dynamic": 1.3, "packed/trl": 2.5}}
# A command whose processes are not the part's descendants (`tests/served_python.py`, forked by a fork server) appends
# their CPU seconds to the file this variable names, one number a line; the part's own rusage cannot count them.
SERVED_CPU_FILE = "DHPO_SERVED_CPU_FILE"


@dataclass(frozen=True)
class Part:
    name: str
    command: list[str]
    box: float  # seconds at most
    minimum: float  # seconds held back for it while earlier parts run
    env: dict = field(default_factory=dict)


def bench_runs(arms: str, repeats: int, wide_repeats: int, profile: str) -> float:
    """Runs of a benchmark in units of one run: each arm's warm-up and timed runs, a profiled run 1.5."""
    timed = sum(wide_repeats if "@" in arm else repeats for arm in arms.split(","))
    return len(arms.split(",")) + timed + 1.5 * len(list(filter(None, profile.split(","))))


def bench_seconds(shape: str) -> float:
    """The planned seconds of one benchmark part on one H100: its start, then every run BENCH_PLAN asks for."""
    plan = BENCH_PLAN[shape]
    runs = bench_runs(plan["arms"], plan["repeats"], plan["wide_repeats"], plan["profile"])
    return BENCH_START_SECONDS + runs * BENCH_RUN_SECONDS[shape]


def tiny_arms(arms: str, rows_times_steps: int) -> str:
    """The CPU dry run's arms: an arm at its own shape becomes one micro-step an optimizer step of the tiny base's
    rows x steps (the GPU's 16 x 2 is a quarter of 4 x 8's micro-steps; 2 x 2 has two)."""
    return ",".join(f"{arm.partition('@')[0]}@{rows_times_steps}x1" if "@" in arm else arm for arm in arms.split(","))


def bench_command(python: str, cpu: bool, shape: str, batch_size: int, out: str) -> list[str]:
    plan = BENCH_PLAN[shape]
    arms, profile = (tiny_arms(plan["arms"], 4), tiny_arms(plan["profile"], 4)) if cpu else (plan["arms"], plan["profile"])
    command = [python, "benchmarks/bench_dynamic_batching.py", "--arms", arms, "--steps", "2", "--json", out]
    command += ["--profile", profile] if profile else []  # where the update's time goes, after the first timed round
    if cpu:  # tiny: the same arms and code path in seconds
        return [*command, "--device", "cpu", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--repeats",
                "1", "--wide-repeats", "1", "--batch-size", "2", "--generations", "2", "--accumulation", "2",
                "--max-completion", "16", "--max-prompt", "20"]  # fmt: skip
    # the long tail at GPU scale: completions lognormal around 256 tokens, up to 2048; one generation batch per run
    return [*command, "--device", "cuda", "--dtype", "bfloat16", "--shape", shape, "--repeats", str(plan["repeats"]),
            "--wide-repeats", str(plan["wide_repeats"]), "--batch-size", str(batch_size), "--generations", "8",
            "--accumulation", "8", "--max-completion", "2048"]  # fmt: skip


def routing_commands(python: str, cpu: bool, work: Path) -> tuple[list[str], list[str]]:
    """MoE routing replay: the R2 overhead (`benchmarks/routing_replay.py`) and R3 against vLLM's offline engine
    (`benchmarks/routing_replay_rollout.py`; the CPU dry run's engine is its stand-in)."""
    overhead = [python, "benchmarks/routing_replay.py", "--overhead-only", "--json",
                str(work / "routing-overhead.json")]
    rollout = [python, "benchmarks/routing_replay_rollout.py", "--json", str(work / "routing-rollout.json")]
    if cpu:
        return ([*overhead, "--device", "cpu", "--dtype", "bfloat16", "--overhead-shape", "mini", "--repeats", "2",
                 "--overhead-rows", "4", "--overhead-length", "16"],
                [*rollout, "--device", "cpu", "--engine", "stand-in", "--shape", "tiny", "--prompts", "4",
                 "--max-tokens", "12"])  # fmt: skip
    # Qwen3-30B-A3B's MoE layers (128 experts, top-8) cut to 4, bf16, 4 x 1,024 tokens
    return ([*overhead, "--device", "cuda", "--dtype", "bfloat16", "--overhead-shape", "qwen3-30b-a3b-4-layers",
             "--repeats", "8", "--overhead-rows", "4", "--overhead-length", "1024"],
            [*rollout, "--device", "cuda", "--engine", "vllm", "--shape", "small", "--prompts", "16",
             "--max-tokens", "48"])  # fmt: skip


def plan(cpu: bool, python: str, work: Path, wheels: str) -> list[Part]:
    def out(name):
        return str(work / f"{name}.json")

    device = "cpu" if cpu else "cuda"
    tests_env = {"DHPO_GPU_CHECK_DEVICE": "cpu"} if cpu else {
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES") or "0"}  # tests/conftest.py hides GPUs otherwise
    train = [python, "scripts/gpu_check_parts.py", "train", "--device", device, "--json", out("train"),
             "--output-dir", str(work / "train_run")]  # fmt: skip
    train += ["--shape", "tiny", "--steps", "2", "--batch-size", "4", "--max-completion", "8"] if cpu else []
    routing = routing_commands(python, cpu, work)
    large = bench_seconds("qwen3-1.7b")
    # box: the most a part may take; minimum: what it takes on one H100 (measured: wheels 2 s, environment 12, tests
    # 37, train 58, routing-overhead 23, routing-rollout 18 without vllm), a little over
    parts = [
        Part("wheels", [python, "scripts/gpu_check_parts.py", "wheels", "--wheels", wheels, "--site",
                        str(work / "site"), "--json", out("wheels"), *(["--check-only"] if cpu else [])], 30, 5),
        Part("environment", [python, "scripts/gpu_check_parts.py", "environment", "--json", out("environment"),
                             *(["--cpu"] if cpu else [])], 40, 15),
        Part("tests", [python, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider",
                       "-o", "addopts=", "--junitxml", str(work / "junit.xml")], 80, 45, tests_env),
        Part("train", train, 90, 65),
        Part("bench-qwen3-1.7b", bench_command(python, cpu, "qwen3-1.7b", 4, out("bench-qwen3-1.7b")),
             1.25 * large, large),
        Part("routing-overhead", routing[0], 50, 30),
        Part("routing-rollout", routing[1], 100, 20),
    ]  # fmt: skip
    if cpu:  # the dry run's few CPU seconds can take minutes of wall time on a loaded machine: wide boxes
        parts = [Part(p.name, p.command, 600, 30, p.env) for p in parts]
    # `python` may be a command line (`--python`): every part starts with it
    return [Part(p.name, [*shlex.split(python), *p.command[1:]], p.box, p.minimum, p.env) for p in parts]


def time_box(part: Part, later: list[Part], deadline: float, now: float) -> float:
    """The part's seconds: its box, or what is left once every later part's minimum is held back (0: skip it)."""
    return max(0.0, min(part.box, deadline - now - sum(p.minimum for p in later)))


def junit_summary(path: Path) -> dict:
    """Counts, and each test's outcome, message and recorded properties, from pytest's JUnit XML."""
    tests = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome, message = kind, (element.get("message") or "")[:500]
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        tests.append({"name": case.get("name"), "outcome": outcome, "message": message, "properties": properties,
                      "seconds": float(case.get("time") or 0)})  # fmt: skip
    counts = {kind: sum(t["outcome"] == kind for t in tests) for kind in ("passed", "failure", "error", "skipped")}
    return {"counts": counts, "tests": tests}


def run_part(part: Part, seconds: float, env: dict, log) -> tuple[str, float, float, list[str]]:
    """(status, seconds taken, CPU seconds of its processes, last lines of output). The part runs in its own process
    group, ended whole on time-out."""
    log.write(f"\n===== {part.name} (at most {seconds:.0f} s): {' '.join(part.command)}\n")
    log.flush()
    start, cpu = time.monotonic(), children_cpu_seconds()
    with tempfile.TemporaryFile("w+") as output, tempfile.NamedTemporaryFile("r") as served:
        process = subprocess.Popen(part.command, cwd=ROOT, env={**env, **part.env, SERVED_CPU_FILE: served.name},
                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                                   text=True)  # fmt: skip
        try:
            code = process.wait(timeout=seconds)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            status = "timeout"
        output.seek(0)
        text = output.read()
        cpu = children_cpu_seconds() - cpu + sum(float(line) for line in served.read().split())
    log.write(text)
    log.flush()
    return status, time.monotonic() - start, cpu, text.strip().splitlines()[-25:]


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def summarise(part: Part, status: str, seconds: float, cpu: float, tail: list[str], work: Path) -> dict:
    entry = {"status": status, "seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1)}
    result = work / f"{part.name}.json"
    if result.is_file():  # written by the part, whole or (benchmarks) after every run
        entry["result"] = json.loads(result.read_text())
    if part.name in TARGETS and entry.get("result", {}).get("throughput_ratios"):  # judged where the figures are
        entry["targets"] = judged_targets(TARGETS[part.name], entry["result"])
    if part.name == "tests" and (work / "junit.xml").is_file():
        entry["result"] = junit_summary(work / "junit.xml")
        if status == "ok" and not entry["result"]["counts"]["passed"]:  # all skipped: no GPU, or no test collected
            entry["status"] = status = "failed (no test passed; the skip reasons say why)"
    if status != "ok":
        entry["error"] = tail
    return entry


def judged_targets(targets: dict, bench: dict) -> dict:
    """`top@S/bottom@S` -> its value, target and whether it is met, for each target `top/bottom` at each batch shape S
    (none, or `@BxA`) whose two eager arms the benchmark was asked for (the benchmark pairs a compiled arm with its
    eager twin only); an arm that did not run leaves its value None."""
    asked = bench.get("options", {}).get("arms", "").split(",")
    shapes = dict.fromkeys(arm.partition("@")[1] + arm.partition("@")[2] for arm in asked if "+compile" not in arm)
    judged = {}
    for at in shapes:
        for pair, target in targets.items():
            top, bottom = (name + at for name in pair.split("/"))
            if top in asked and bottom in asked:
                value = bench["throughput_ratios"].get(f"{top}/{bottom}")
                judged[f"{top}/{bottom}"] = {"value": value, "target": target,
                                             "met": value is not None and value >= target}  # fmt: skip
    return judged


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir")
    parser.add_argument("--cpu", action="store_true", help="the CPU dry run: tiny shapes, no GPU, nothing installed")
    parser.add_argument("--parts", default=None, help="comma-separated part names to run (default: all, in order)")
    parser.add_argument("--total-seconds", type=float, default=None, help="the whole run's limit (GPU 480, CPU 1800)")
    parser.add_argument("--wheels", default=str(ROOT / ".gpu_wheels"), help="the carried wheels' folder")
    parser.add_argument("--python", default=shlex.quote(sys.executable), help="the command line each part's Python "
                        "runs with, words as a shell splits them (default: this interpreter)")  # fmt: skip
    options = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dhpo_gpu_check_"))
    try:  # a refused command leaves no temporary folder
        parts, total = chosen_parts(parser, options, plan(options.cpu, options.python, work, options.wheels))
    except SystemExit:
        shutil.rmtree(work, ignore_errors=True)
        raise
    output = Path(options.output_dir).resolve()
    output.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + total
    env = part_environment(os.environ, work / "site")
    report = {"mode": "cpu" if options.cpu else "gpu", "commit": git_commit(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "parts": {}}  # fmt: skip
    try:
        run_parts(parts, report, env, work, output, deadline)
    finally:  # the installed wheels, the parts' own files: all merged into gpu_check.json by now
        shutil.rmtree(work, ignore_errors=True)
    failed = [name for name, entry in report["parts"].items() if entry["status"] != "ok"]
    print(f"gpu_check: {len(parts) - len(failed)}/{len(parts)} parts ok; figures in {output / 'gpu_check.json'}")
    return 1 if failed else 0


def chosen_parts(parser, options, parts: list[Part]) -> tuple[list[Part], float]:
    """The parts `--parts` asks for (with `wheels`: the later parts import what it installs) and the whole run's
    seconds, refused (`parser.error`) where a part is unknown or the seconds are less than the parts' planned time:
    the wheels part would get none and every part after it fail on a missing import."""
    if options.parts:
        wanted = options.parts.split(",")
        unknown = set(wanted) - {p.name for p in parts}
        if unknown:
            parser.error(f"--parts: unknown {sorted(unknown)}; the parts are {[p.name for p in parts]}")
        parts = [p for p in parts if p.name in wanted or p.name == "wheels"]
    total = options.total_seconds if options.total_seconds is not None else 1800 if options.cpu else GPU_SECONDS
    needed = sum(p.minimum for p in parts)
    if total < needed:
        parser.error(f"--total-seconds {total:g} is less than the {needed:g} s the parts asked are planned to take "
                     f"({', '.join(f'{p.name} {p.minimum:g} s' for p in parts)}): give at least {needed:g}, or fewer "
                     "--parts")  # fmt: skip
    return parts, total


def part_environment(base, site: Path) -> dict:
    """The environment a part runs in: offline, no telemetry, unbuffered; the wheels installed in `site` (when the
    folder exists) first on the module path, then the repository, importable uninstalled."""
    return {**base, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRL_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([*([str(site)] if site.is_dir() else []), str(ROOT)])}  # fmt: skip


def run_parts(parts: list[Part], report: dict, env: dict, work: Path, output: Path, deadline: float) -> None:
    with open(output / "gpu_check.log", "w") as log:
        for index, part in enumerate(parts):
            env = part_environment(env, work / "site")  # the wheels part creates the site
            seconds = time_box(part, parts[index + 1 :], deadline, time.monotonic())
            if seconds < 5:
                report["parts"][part.name] = {"status": "skipped (no time left)", "seconds": 0}
            else:
                report["parts"][part.name] = summarise(part, *run_part(part, seconds, env, log), work)
            line = f"{part.name}: {report['parts'][part.name]['status']} ({report['parts'][part.name]['seconds']} s)"
            print(line, flush=True)
            (output / "gpu_check.json").write_text(json.dumps(report, indent=1))
        for name in ("wheels", "environment"):
            for note in report["parts"].get(name, {}).get("result", {}).get("notes", []):
                print(f"NOTE: {note}")


if __name__ == "__main__":
    sys.exit(main())
