"""`bash scripts/gpu_check.sh --cpu OUTPUT_DIR`, the CPU dry run of the GPU evidence, end to end: every part runs, the
JSON it writes holds each part's figures, and the docs block renders from it; so the one command a lent GPU gets
cannot rot. The script's pure pieces are tested in tests/test_gpu_check.py.
"""

import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import fork_server
import forked_ranks
import processes
import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(path):
    spec = importlib.util.spec_from_file_location(Path(path).stem + "_dry_run_under_test", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


check = load("scripts/gpu_check.py")
docs = load("scripts/docs_gpu_section.py")


# ------------------------------------------------------------------------------------------------ the dry run
@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """`bash scripts/gpu_check.sh --cpu OUTPUT_DIR` as the docs print it (with this interpreter), each part's Python
    forked from a fork server that imported the package once (`--python`, `tests/served_python.py`: 6-8 s of CPU
    a part on the 2-core machine), on one torch thread as the suite runs."""
    output = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    server = fork_server.Server(",".join(forked_ranks.PRELOAD), check.part_environment(env, ROOT / "no-site"), 600)
    python = f"{shlex.quote(sys.executable)} {shlex.quote(str(ROOT / 'tests' / 'served_python.py'))}"
    try:
        result = processes.run(["bash", "scripts/gpu_check.sh", "--cpu", str(output), "--python", python], cwd=ROOT,
                               timeout=1500, env={**env, "DHPO_FORK_SERVER_SOCKET": server.path})  # fmt: skip
    finally:
        server.stop()
    assert (output / "gpu_check.json").is_file(), result.stdout + result.stderr
    return result, json.loads((output / "gpu_check.json").read_text()), output


def test_dry_run_runs_every_part(dry_run):
    result, report, output = dry_run
    assert report["mode"] == "cpu" and list(report["parts"]) == [p.name for p in check.plan(True, "python", ROOT, "")]
    failed = {name: entry.get("error") for name, entry in report["parts"].items() if entry["status"] != "ok"}
    assert failed == {} and result.returncode == 0, failed
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert report["commit"] == head
    assert "===== bench-qwen3-1.7b" in (output / "gpu_check.log").read_text()


def test_dry_run_gpu_tests_pass_and_the_varlen_cases_skip_on_cpu(dry_run):
    result = dry_run[1]["parts"]["tests"]["result"]
    assert result["counts"]["failure"] == 0 and result["counts"]["error"] == 0 and result["counts"]["passed"] >= 5
    skipped = [t for t in result["tests"] if t["outcome"] == "skipped"]
    assert len(skipped) == 3 and all("torch_varlen" in t["name"] and "CUDA" in t["message"] for t in skipped)
    float32 = [t for t in result["tests"] if "float32" in t["name"] and t["outcome"] == "passed"]
    assert len(float32) == 3
    for test in float32:  # measured errors reach the JSON
        assert float(test["properties"]["packed_logps_error"]) <= 1e-4
        assert float(test["properties"]["leaking_rows_logits_error"]) > 1e-3


def test_dry_run_trains_off_policy_with_packed_rows(dry_run):
    train = dry_run[1]["parts"]["train"]["result"]
    assert train["ok"] and train["off_policy_seen"] and len(train["losses"]) == train["steps"] == 2
    assert all(math.isfinite(loss) for loss in train["losses"])
    assert train["padding_free"] is True and train["attention_kernels"].get("sdpa", 0) > 0  # CPU: the SDPA loop
    assert {"loss", "dhpo/token_ratio/mean", "batching/padding_fraction"} <= set(train["metrics_logged"])


@pytest.mark.parametrize("part", ["bench-qwen3-1.7b"])
def test_dry_run_benchmarks_every_arm(dry_run, part):
    bench = dry_run[1]["parts"][part]["result"]
    plan = check.BENCH_PLAN[part.removeprefix("bench-")]  # the GPU run's arms and profiles, at the tiny shape
    planned, profiled = check.tiny_arms(plan["arms"], 4), check.tiny_arms(plan["profile"], 4)
    assert list(bench["arms"]) == planned.split(",") and any("@" in arm for arm in bench["arms"])
    arms = bench["arms"]
    assert arms["packed"]["padding_fraction"] == 0 and arms.get("trl", {"padding_fraction": 1})["padding_fraction"] > 0
    assert all(a["timed_runs"] == 1 and a["trained_tokens_per_second"] > 0 and a["update_flops"] > 0
               for a in arms.values())  # fmt: skip
    assert all(a["mfu"] is None for a in arms.values())  # no GPU peak on a CPU
    assert arms["packed"]["attention_kernels"].get("sdpa", 0) > 0
    assert [a for a in arms if arms[a].get("profile_top_operators")] == [a for a in arms if a in profiled.split(",")]
    for name, figures in arms.items():  # an arm at its own shape: the same update as TRL's, in fewer micro-steps
        rows, steps = figures["shape"]["batch_size"], figures["shape"]["accumulation"]
        assert rows * steps == 4 and (rows, steps) == ((4, 1) if "@" in name else (2, 2))
        assert figures["update_gap_to_trl"] < 1e-4, name
        summary = figures.get("profile_summary")
        if summary:  # a CPU window: no launches, no device; every micro-step of the window marked
            assert summary["micro_steps"] == min(2, steps) and summary["kernel_launches_per_micro_step"] == 0
            assert summary["device_busy_fraction"] is None and summary["aten_ops_per_micro_step"] > 0
            assert 0 < summary["host_in_operators_fraction"] <= 1 and summary["wall_seconds_per_micro_step"] > 0
    paths = {"packed/dynamic", "packed/trl", "dynamic/trl", "shared/packed"}
    pairs = paths | {"@4x1/".join(pair.split("/")) + "@4x1" for pair in paths}  # the paths at each shape
    pairs |= {f"{name}/{name.partition('@')[0]}" for name in arms if "@" in name}
    assert set(bench["throughput_ratios"]) == {r for r in pairs if set(r.split("/")) <= set(arms)}
    entry = dry_run[1]["parts"][part]
    if part != "bench-qwen3-1.7b":
        assert "targets" not in entry
        return
    assert set(entry["targets"]) == {"packed/dynamic", "packed/trl", "packed@4x1/dynamic@4x1", "packed@4x1/trl@4x1"}
    for ratio, judged in entry["targets"].items():
        assert judged["value"] == bench["throughput_ratios"][ratio]
        assert judged["met"] == (judged["value"] >= judged["target"])


def test_dry_run_times_routing_replay(dry_run):
    (figures,) = dry_run[1]["parts"]["routing-overhead"]["result"]["overhead"]
    assert (figures["shape"], figures["device"], figures["dtype"]) == ("mini", "cpu", "bfloat16")  # the GPU's dtype
    assert (figures["layers"], figures["top_k"]) == (2, 2)
    assert set(figures["arms"]) == {"update", "pi_old pass"}
    check = figures["replay_check"]  # the routers moved: the live ones flip, the replayed pass runs the recorded
    assert check["decisions"] == figures["rows"] * figures["length"] * figures["layers"] and check["differing"] == 0
    assert check["flipped_fraction"] > 0 and check["replayed_fraction"] == 1.0
    for arm in figures["arms"].values():
        assert arm["timed"] == 2 and arm["plain_s"] > 0 and arm["hooked_s"] > 0
        assert arm["overhead_percent"] == pytest.approx(100 * (arm["hooked_s"] - arm["plain_s"]) / arm["plain_s"])


def test_dry_run_replays_the_engines_routing(dry_run):
    """The stand-in engine (other numerics in its routers) returns routing as vLLM does: the policy's live routing
    flips on some token-layer decisions, the replayed pass runs the engine's experts on every one, and its log-probs
    come closer to the engine's."""
    r = dry_run[1]["parts"]["routing-rollout"]["result"]
    assert r["engine"] == "stand-in" and r["ok"] and r["routing_dtype"] == "int16"
    assert (r["sequences"], r["layers"], r["top_k"]) == (4, 2, 2)
    assert r["replayed_decisions_differing"] == 0 and r["replayed_decisions_checked"] == r["tokens"] * r["layers"]
    assert r["replayed_fraction"] == 1.0 and r["decisions"] == (r["tokens"] - r["sequences"]) * r["layers"]
    assert 0 < r["flipped_decisions"] < r["decisions"]
    assert r["flip_fraction_before_replay"] == pytest.approx(r["flipped_decisions"] / r["decisions"])
    assert r["logp_gap_replayed_mean"] < r["logp_gap_live_mean"]


def test_docs_block_renders_the_run_and_the_cli_refuses_a_dry_run(dry_run, tmp_path):
    report = dry_run[1]
    block = docs.render(report)
    pieces = ("| trl |", "| packed@4x1 |", "| dynamic@4x1 | 1 |", "Training",
              "test_tiny_moe_trains_with_routing_and_aux_loss", "| tests | run 1 | ok |", "**Routing replay overhead** (mini", "| update (replay) |",
              "**R3 against vLLM's engine** (stand-in", "| routing-rollout | run 1 | ok |",
              "(target >= 2.5x: ")  # fmt: skip
    for piece in pieces:
        assert piece in block
    doc = tmp_path / "performance_gpu.md"
    doc.write_text((ROOT / "docs/performance_gpu.md").read_text())
    filled = docs.fill(doc.read_text(), block)
    assert filled.startswith("# Performance on a GPU") and block in filled and "Empty: no run" not in filled
    assert docs.fill(filled, "again").count(docs.BEGIN) == 1  # a second run replaces the first
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(report))
    with pytest.raises(SystemExit) as exit_info:
        docs.main([str(path), "--doc", str(doc)])
    assert exit_info.value.code == 2
    report = {**report, "mode": "gpu", "commit": None}  # a tree copied without .git
    path.write_text(json.dumps(report))
    with pytest.raises(SystemExit):
        docs.main([str(path), "--doc", str(doc)])
    assert docs.main([str(path), "--doc", str(doc), "--commit", "0123456789abc"]) == 0
    assert "| packed |" in doc.read_text() and "| `0123456789` |" in doc.read_text()
