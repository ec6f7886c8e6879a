"""scripts/gpu_check.sh's pure pieces, which decide what a GPU run does: time boxes, the parts' commands, which wheels
to install (and installing one), pin mismatches, the one-line notes, the benchmark's FLOPs, MFU peak and partial
figures. Its CPU dry run end to end is tests/test_gpu_dry_run.py.
"""

import importlib.util
import io
import json
import math
import os
import sys
import tempfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import fork_server
import processes
import pytest
import torch
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]


def load(path):
    spec = importlib.util.spec_from_file_location(Path(path).stem + "_under_test", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


check = load("scripts/gpu_check.py")
parts = load("scripts/gpu_check_parts.py")
docs = load("scripts/docs_gpu_section.py")


# ----------------------------------------------------------------------------------------------- pure pieces
def test_time_boxes_hold_back_the_later_parts_minimums():
    later = [check.Part("b", [], 100, 30), check.Part("c", [], 100, 40)]
    first = check.Part("a", [], 60, 10)
    assert check.time_box(first, later, deadline=1000, now=0) == 60  # its own box
    assert check.time_box(first, later, deadline=120, now=0) == 50  # 120 - 30 - 40
    assert check.time_box(first, later, deadline=60, now=0) == 0  # nothing left: skipped
    gpu = check.plan(False, "python3", Path("/nonexistent"), ".gpu_wheels")
    # each part's minimum is its time on one H100: together they leave a margin in the whole run's limit
    assert sum(p.minimum for p in gpu) + 30 <= check.GPU_SECONDS and all(p.minimum <= p.box for p in gpu)
    assert check.GPU_SECONDS + check.GRACE_SECONDS + 30 <= 540  # the device command's timeout, Python's start within
    assert [p.name for p in gpu] == ["wheels", "environment", "tests", "train", "bench-qwen3-1.7b", "routing-overhead",
                                     "routing-rollout"]
    tests = next(p for p in gpu if p.name == "tests")
    assert tests.env["CUDA_VISIBLE_DEVICES"]  # tests/conftest.py would hide the GPU otherwise


def test_gpu_parts_ask_for_the_gpu_workload():
    gpu = {p.name: p.command for p in check.plan(False, "python3", Path("/nonexistent"), ".gpu_wheels")}
    for shape in check.BENCH_PLAN:
        command = gpu[f"bench-{shape}"]
        assert command[command.index("--device") + 1] == "cuda" and command[command.index("--shape") + 1] == shape
        assert command[command.index("--dtype") + 1] == "bfloat16"
        value = {flag: command[command.index(flag) + 1] for flag in ("--arms", "--batch-size", "--accumulation")}
        wide = [arm.split("@") for arm in value["--arms"].split(",") if "@" in arm]
        assert {name for name, _ in wide} == {"trl", "packed", "dynamic"}  # the targets' arms at both shapes
        for _, shape_written in wide:  # fewer, larger micro-steps of the same sequences
            rows, steps = map(int, shape_written.split("x"))
            assert rows * steps == int(value["--batch-size"]) * int(value["--accumulation"]) and rows > 4
    assert gpu["train"][gpu["train"].index("--device") + 1] == "cuda" and "--shape" not in gpu["train"]  # 0.6B
    for part, ratios in check.TARGETS.items():  # the arms each target compares run, twice or more
        command = gpu[part]
        needed = {arm for ratio in ratios for arm in ratio.split("/")}
        assert needed <= set(command[command.index("--arms") + 1].split(","))
        for flag in ("--repeats", "--wide-repeats"):
            assert int(command[command.index(flag) + 1]) >= 2
    overhead, rollout = gpu["routing-overhead"], gpu["routing-rollout"]
    assert overhead[overhead.index("--device") + 1] == "cuda" and overhead[overhead.index("--dtype") + 1] == "bfloat16"
    assert overhead[overhead.index("--overhead-shape") + 1] == "qwen3-30b-a3b-4-layers"
    assert rollout[rollout.index("--engine") + 1] == "vllm" and rollout[rollout.index("--device") + 1] == "cuda"


def test_a_benchmark_part_is_held_its_runs_time():
    """A benchmark's minimum is its start and every run its command asks for (warm-up, timed, profiled at 1.5), at
    the measured seconds of a run of its shape: read from the command, so a plan with more runs than time fails."""
    benches = [p for p in check.plan(False, "python3", Path("/nonexistent"), ".gpu_wheels") if p.name.startswith("bench-")]
    for part in benches:
        value = {flag: part.command[part.command.index(flag) + 1]
                 for flag in ("--arms", "--repeats", "--wide-repeats", "--shape")}  # fmt: skip
        profiled = part.command[part.command.index("--profile") + 1].split(",") if "--profile" in part.command else []
        arms = value["--arms"].split(",")
        runs = sum(1 + int(value["--wide-repeats" if "@" in arm else "--repeats"]) for arm in arms)
        runs += 1.5 * len(profiled)
        per_run = check.BENCH_RUN_SECONDS[value["--shape"]]
        assert part.minimum == check.BENCH_START_SECONDS + runs * per_run and part.box >= part.minimum, part.name
    # trl, dynamic, packed at 4 x 8 and at 16 x 2, a warm-up and 2 timed runs each; none profiled
    assert [p.name for p in benches] == ["bench-qwen3-1.7b"]
    assert check.bench_seconds("qwen3-1.7b") == 12 + 6 * 3 * 14


def test_a_benchmark_cut_to_its_least_box_keeps_every_arms_first_timed_run():
    """The least time a benchmark part gets is what is left when every earlier part takes its whole box and every
    later part's minimum is held back. Its start, every arm's warm-up and the first timed round (which come before
    the profiled runs and the other rounds) fit in it at the planned seconds a run."""
    parts = check.plan(False, "python3", Path("/nonexistent"), ".gpu_wheels")
    for index, part in enumerate(parts):
        if not part.name.startswith("bench-"):
            continue
        least = check.time_box(part, parts[index + 1 :], check.GPU_SECONDS, sum(p.box for p in parts[:index]))
        arms = part.command[part.command.index("--arms") + 1].split(",")
        per_run = check.BENCH_RUN_SECONDS[part.command[part.command.index("--shape") + 1]]
        assert check.BENCH_START_SECONDS + 2 * len(arms) * per_run <= least, part.name


def test_the_gpu_overhead_shape_is_qwen3_30b_a3b_layers():
    """The shape `routing-overhead` times on a GPU, built on the meta device: Qwen3-30B-A3B's layer, counted by hand."""
    import torch

    from dhpo_trl.demo.tiny import build_char_tokenizer

    bench = load("benchmarks/routing_replay.py")
    model = bench.build_shape(build_char_tokenizer(), "qwen3-30b-a3b-4-layers", 0, "meta", torch.bfloat16)
    hidden, vocab, heads, kv_heads, head_dim, experts, width = 2048, 151936, 32, 4, 128, 128, 768
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 2 * head_dim  # q, o, k, v; q/k norms
    layer = attention + experts * hidden + experts * 3 * hidden * width + 2 * hidden  # router, experts, two norms
    assert sum(p.numel() for p in model.parameters()) == 2 * vocab * hidden + 4 * layer + hidden  # untied; final norm
    assert model.config.num_experts_per_tok == 8 and next(model.parameters()).dtype == torch.bfloat16


def test_rollout_check_without_vllm_says_so_and_renders(tmp_path):
    """`routing-rollout` on a machine without vllm: one line naming the install, in the JSON and the docs block."""
    rollout = load("benchmarks/routing_replay_rollout.py")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    out = tmp_path / "routing-rollout.json"
    assert rollout.main(["--engine", "vllm", "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["engine"] == "vllm" and "pip install -e .[vllm]" in report["skipped"] and "ok" not in report
    block = docs.routing_lines({"routing-rollout": {"status": "ok", "result": report}})
    assert any("not run: vllm is not installed" in line for line in block)


@pytest.mark.parametrize("argv, named", [
    (["--overhead-only", "--repeats", "0"], "--repeats"),  # nothing timed
    (["--summarise", "runs.json", "--overhead-only"], "--overhead-only"),
    (["--summarise", "runs.json", "--json", "out.json"], "--json"),
    (["--train", "--overhead-only"], "--train"),
    (["--train", "--dtype", "bfloat16"], "--dtype"),  # the training comparison runs no overhead
    (["--repeats", "0", "--overhead-shape", "mini"], "--overhead-shape"),
    (["--overhead-only", "--overhead-shape", "mini", "--overhead-hidden", "128"], "--overhead-hidden"),
    (["--overhead-only", "--overhead-length", "8"], "--overhead-length"),
])  # fmt: skip
def test_routing_overhead_refuses_options_that_would_not_act(argv, named, capsys):
    bench = load("benchmarks/routing_replay.py")
    with pytest.raises(SystemExit) as stopped:
        bench.main(argv)
    assert stopped.value.code == 2 and named in capsys.readouterr().err.splitlines()[-1]


def test_routing_overhead_fails_where_the_replayed_pass_ran_other_experts(tmp_path, monkeypatch):
    """`routing-overhead` checks the replayed pass against the recorded experts: a mismatch fails the part (its
    figures still written), as `routing-rollout` does."""
    bench = load("benchmarks/routing_replay.py")
    figures = {"shape": "mini", "device": "cpu", "dtype": "bfloat16", "arms": {},
               "replay_check": {"decisions": 64, "differing": 0}}  # fmt: skip
    monkeypatch.setattr(bench, "overhead", lambda *args: figures)
    out = tmp_path / "overhead.json"
    argv = ["--overhead-only", "--overhead-shape", "mini", "--repeats", "1", "--json", str(out)]
    bench.main(argv)  # every decision as recorded: the run passes
    figures["replay_check"]["differing"] = 3
    with pytest.raises(SystemExit) as stopped:
        bench.main(argv)
    assert stopped.value.code not in (0, None)
    assert json.loads(out.read_text())["overhead"][0]["replay_check"]["differing"] == 3


def test_rollout_check_leaves_no_saved_model_behind(tmp_path, monkeypatch):
    """`routing-rollout` saves a model for the engine to load (hundreds of MB at the GPU shape): gone once it ends,
    passed or failed."""
    import tempfile

    rollout = load("benchmarks/routing_replay_rollout.py")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "routing-rollout.json"
    assert rollout.main(["--engine", "stand-in", "--device", "cpu", "--dtype", "float32", "--shape", "tiny",
                         "--prompts", "2", "--max-tokens", "4", "--json", str(out)]) == 0  # fmt: skip
    assert json.loads(out.read_text())["ok"] and not list(scratch.iterdir())
    monkeypatch.setattr(rollout, "output_samples", lambda outputs: 1 / 0)  # a check that fails midway
    with pytest.raises(ZeroDivisionError):
        rollout.main(["--engine", "stand-in", "--device", "cpu", "--shape", "tiny", "--prompts", "1",
                      "--max-tokens", "2", "--json", str(out)])  # fmt: skip
    assert not list(scratch.iterdir())


def test_wheel_choice():
    wheels = ["/w/trl-1.16.0-py3-none-any.whl", "/w/datasets-5.2.0-py3-none-any.whl",
              "/w/transformers-5.17.0-py3-none-any.whl", "/w/math_verify-0.9.0-py3-none-any.whl"]  # fmt: skip
    installed = {"trl": None, "datasets": "5.1.0", "transformers": "5.17.0", "math-verify": None}
    install, present = parts.choose_wheels(wheels, installed)
    assert sorted(Path(w).name.split("-")[0] for w in install) == ["datasets", "math_verify", "trl"]
    assert [Path(w).name for w in present] == ["transformers-5.17.0-py3-none-any.whl"]
    with pytest.raises(ValueError, match="two wheels of trl"):
        parts.choose_wheels([*wheels, "/w/trl-1.15.0-py3-none-any.whl"], installed)
    with pytest.raises(ValueError, match="not a wheel"):
        parts.wheel_identity("trl-1.16.0.tar.gz")


def make_wheel(folder: Path, name: str, version: str) -> Path:
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel_file = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        archive.writestr(f"{info}/WHEEL", wheel_file)
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def test_wheels_part_installs_what_is_missing_into_the_site_folder(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "dhpo_probe_package", "1.2.3")
    site, out = tmp_path / "site", tmp_path / "wheels.json"
    processes.run([sys.executable, "scripts/gpu_check_parts.py", "wheels", "--wheels", str(wheels), "--site",
                   str(site), "--json", str(out)], cwd=ROOT, timeout=300, check=True)  # fmt: skip
    report = json.loads(out.read_text())
    assert report["install"] == ["dhpo_probe_package-1.2.3-py3-none-any.whl"] and report["site"] == str(site)
    assert (site / "dhpo_probe_package" / "__init__.py").read_text() == "VERSION = '1.2.3'\n"
    assert report["notes"] == [] and report["unmet_requirements"] == []


def test_missing_wheels_are_one_line_naming_the_fetch_script(tmp_path, monkeypatch):
    monkeypatch.setattr(parts, "installed_version", lambda name: None)  # a machine without trl & co
    options = SimpleNamespace(wheels=str(tmp_path / "none"), site=str(tmp_path / "site"), check_only=False)
    report, code = parts.wheels_part(options)
    assert code == 1 and len(report["notes"]) == 2
    assert all("scripts/fetch_gpu_wheels.sh" in note for note in report["notes"])
    assert report["notes"][0].startswith("trl, datasets, math-verify not installed")


def test_environment_names_pin_mismatches_no_gpu_and_an_old_torch(monkeypatch):
    lines = parts.pin_lines({"torch": "2.11.0", "trl": "1.16.0", "datasets": None},
                            {"torch": ">=2.13.0,<2.14", "trl": ">=1.16.0,<1.17", "datasets": ">=5.2.0,<6"})  # fmt: skip
    assert len(lines) == 2 and lines[0].startswith("torch 2.11.0 is outside the pinned")
    assert lines[1].startswith("datasets is not installed") and "fetch_gpu_wheels.sh" in lines[1]
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # a torch before 2.10
    report, code = parts.environment_part(SimpleNamespace(cpu=False))
    assert code == 0 and report["varlen_attn_parameters"] is None and report["cuda_available"] is False
    assert any(note.startswith("no CUDA device") and "gpu_check.sh --cpu" in note for note in report["notes"])
    assert any("no torch.nn.attention.varlen" in note and "torch>=2.10" in note for note in report["notes"])
    assert report["versions"]["trl"] == "1.16.0"
    assert SpecifierSet(report["pins"]["trl"]) == SpecifierSet(">=1.16.0,<1.17")


def test_a_tests_part_where_nothing_passed_fails(tmp_path):
    """On a machine where torch sees no GPU every GPU test skips: that part must not read as a pass."""
    (tmp_path / "junit.xml").write_text('<testsuite><testcase name="a"><skipped message="needs a CUDA GPU"/>'
                                        '</testcase></testsuite>')  # fmt: skip
    entry = check.summarise(check.Part("tests", [], 1, 1), "ok", 3.0, 1.0, ["1 skipped"], tmp_path)
    assert entry["status"].startswith("failed") and entry["result"]["tests"][0]["message"] == "needs a CUDA GPU"
    (tmp_path / "junit.xml").write_text('<testsuite><testcase name="a"/></testsuite>')
    assert check.summarise(check.Part("tests", [], 1, 1), "ok", 3.0, 1.0, [], tmp_path)["status"] == "ok"


# Burns `BURN` CPU seconds of its own, then writes its parent's pid and its CPU seconds.
BURN = 1.5
BURNER = f"""
import os, sys, time
while time.process_time() < {BURN}:
    pass
open(sys.argv[1], "w").write(f"{{os.getppid()}} {{time.process_time()}}")
"""


def test_a_served_part_records_the_cpu_its_served_process_spent(tmp_path):
    """A part run by `tests/served_python.py` works in a process forked by the fork server, no descendant of the part:
    its `cpu_seconds` holds that process's CPU (measured by the process itself), once. A plain part runs first, so
    the served part's figure also shows that the CPU of the parts before it is not counted again."""
    script = tmp_path / "burn.py"
    script.write_text(BURNER)
    env = processes._rank_variables(True, None)
    server = fork_server.Server("", env, 120)
    commands = {"plain": [sys.executable, str(script), str(tmp_path / "plain")],
                "served": [sys.executable, str(ROOT / "tests" / "served_python.py"), str(script), str(tmp_path / "served")]}
    try:
        runs = {name: check.run_part(check.Part(name, command, 120, 1), 120,
                                     {**env, "DHPO_FORK_SERVER_SOCKET": server.path}, io.StringIO())
                for name, command in commands.items()}  # fmt: skip
        parents = {"plain": os.getpid(), "served": server.process.pid}  # served: not the part's own interpreter
    finally:
        server.stop()
    for name, (status, _, cpu, tail) in runs.items():
        assert status == "ok", tail
        ppid, burned = (tmp_path / name).read_text().split()
        assert int(ppid) == parents[name], name
        assert float(burned) <= cpu < 2 * float(burned), name


def test_junit_summary(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(
        '<testsuites><testsuite><testcase name="a" time="1.5"><properties><property name="e" value="0.1"/>'
        '</properties></testcase><testcase name="b"><skipped message="needs CUDA"/></testcase>'
        '<testcase name="c"><failure message="boom"/></testcase></testsuite></testsuites>'
    )
    summary = check.junit_summary(path)
    assert summary["counts"] == {"passed": 1, "failure": 1, "error": 0, "skipped": 1}
    assert summary["tests"][0]["properties"] == {"e": "0.1"} and summary["tests"][1]["message"] == "needs CUDA"


# ------------------------------------------------------------------------------------------- the docs block
def bench_arm(tokens_per_second, timed, grad_norms=(1.5, 1.25), nonfinite=0, **extra):
    return {"trained_tokens_per_second": tokens_per_second, "real_tokens_per_second": 2 * tokens_per_second,
            "mfu": 0.0567, "peak_step_memory_bytes": 3 * 2**30, "padding_fraction": 0.25, "attention_kernels": {},
            "timed_runs": timed, "warm_up_run": {"losses": [0.5, -0.25], "grad_norms": list(grad_norms),
                                                "nonfinite_update_values": nonfinite}, **extra}  # fmt: skip


def bench_part(status, repeats, arms, ratios, targets=None, profile=""):
    options = {"batch_size": 4, "accumulation": 8, "max_completion": 2048, "median_fraction": 0.125,
               "repeats": repeats, "profile": profile, "algorithm": "DHPO-E"}  # fmt: skip
    result = {"shape": "qwen3-1.7b", "parameters": 1000, "dtype": "bfloat16", "peak_tflops": 989.0, "options": options,
              "arms": arms, "throughput_ratios": ratios}  # fmt: skip
    entry = {"status": status, "seconds": 99.0, "result": result}
    return {**entry, **({"targets": targets} if targets else {})}


def gpu_report(date, commit, parts):
    return {"mode": "gpu", "date": date, "commit": commit, "parts": parts}


def table_row(block, first_cell):
    (row,) = [line for line in block.splitlines() if line.startswith(f"| {first_cell} |")]
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_docs_block_renders_the_benchmark_figures_and_judges_the_targets():
    targets = {"packed/dynamic": {"value": 1.4, "target": 1.3, "met": True},
               "packed/trl": {"value": 2.0, "target": 2.5, "met": False}}  # fmt: skip
    arms = {"trl": bench_arm(6172.8, 2), "packed": bench_arm(12345.6, 2)}
    part = bench_part("ok", 2, arms, {"packed/dynamic": 1.4, "packed/trl": 2.0}, targets)
    block = docs.render([gpu_report("2026-01-01T00:00:00Z", "a" * 40, {"bench-qwen3-1.7b": part})])
    assert table_row(block, "packed") == ["packed", "2", "12,346", "24,691", "5.7%", "3.00 GiB", "25.0%", "{}",
                                          "0.5, -0.25", "1.5, 1.25", "0"]  # fmt: skip
    assert "packed/dynamic 1.40x (target >= 1.3x: met), packed/trl 2.00x (target >= 2.5x: NOT met)" in block
    assert "Not complete" not in block and table_row(block, "bench-qwen3-1.7b")[2] == "ok"


def test_docs_block_marks_a_part_cut_short_and_an_arm_that_is_not_finite():
    """A timed-out benchmark is shown with its status and the timed runs each arm got, never as a whole run; an arm
    whose warm-up gradients are NaN is named next to its figures and ratios."""
    arms = {"dynamic": bench_arm(6000.0, 1, grad_norms=(math.nan, math.nan), nonfinite=1000),
            "packed": bench_arm(5000.0, 1, profile_top_operators=[
                {"name": "aten::mm", "calls": 7, "self_device_ms": 12.34, "self_cpu_ms": 1.5}])}  # fmt: skip
    part = bench_part("timeout", 2, arms, {"packed/dynamic": 5000 / 6000}, profile="packed,dynamic")
    block = docs.render([gpu_report("2026-01-01T00:00:00Z", "a" * 40, {"bench-qwen3-1.7b": part})])
    status = table_row(block, "bench-qwen3-1.7b")[2]
    assert status.startswith("timeout") and "1 of 2 timed runs per arm" in status
    assert "profiles of dynamic not run" in status and "profiles of packed" not in status
    assert "**Not complete**: timeout: 1 of 2" in block and "Throughput ratios (timeout: 1 of 2" in block
    assert table_row(block, "dynamic")[-2:] == ["nan, nan", "1,000 (100%)"] and table_row(block, "packed")[-1] == "0"
    assert "Not finite in the warm-up run: dynamic." in block and "packed/dynamic 0.83x [dynamic not finite]" in block
    assert table_row(block, "`aten::mm`") == ["`aten::mm`", "7", "12.3", "1.5"]
    health = {"losses": [0.5, 0.25], "grad_norms": [1.0, 2.0], "nonfinite_update_values": 0}
    for form in ({"grad_norms": [1.0, math.nan]}, {"losses": [math.inf, 0.0]}, {"nonfinite_update_values": 3}):
        assert docs.unhealthy({"warm_up_run": {**health, **form}}), form  # each sign of divergence alone
    assert not docs.unhealthy({"warm_up_run": {**health, "grad_norms": [None, 1.0]}})  # not logged is not NaN
    assert not docs.unhealthy({}) and not docs.unhealthy({"warm_up_run": health})  # a run before the field existed
    arms["dynamic"]["timed_runs"] = 2  # one arm got its runs, the other not: each arm's count
    assert "timed runs of 2: dynamic 2, packed 1" in table_row(docs.render(gpu_report("d", "c", {
        "bench-qwen3-1.7b": part})), "bench-qwen3-1.7b")[2]  # fmt: skip


def test_docs_block_renders_each_profiled_window_and_the_timed_runs_each_arm_asked():
    """A profiled arm's per micro-step figures are a row of their own (device busy empty on a CPU window); an arm at
    its own shape asks for its own timed runs, so a benchmark whose arms got what each asked is whole, and one cut
    short names each arm's count against its own."""
    summary = {"micro_steps": 2, "wall_seconds_per_micro_step": 0.2504, "aten_ops_per_micro_step": 4321.0,
               "kernel_launches_per_micro_step": 2345.0, "synchronisations_per_micro_step": 3.5,
               "device_busy_fraction": 0.123, "host_waiting_fraction": 0.052, "host_in_operators_fraction": 0.91,
               "attention_host_fraction": 0.456}  # fmt: skip
    arms = {"packed": bench_arm(5000.0, 2, profile_top_operators=[], profile_summary=summary, timed_runs_asked=2),
            "packed@16x2": bench_arm(7000.0, 1, timed_runs_asked=1, profile_top_operators=[],
                                     profile_summary={**summary, "device_busy_fraction": None,
                                                      "host_waiting_fraction": None})}  # fmt: skip
    part = bench_part("ok", 2, arms, {"packed@16x2/packed": 1.4}, profile="packed,packed@16x2")
    block = docs.render([gpu_report("2026-01-01T00:00:00Z", "a" * 40, {"bench-qwen3-1.7b": part})])
    profiled = [[cell.strip() for cell in line.strip("|").split("|")] for line in block.splitlines()
                if line.startswith("| packed") and "| 4,321 |" in line]  # fmt: skip
    figures = ["2", "250.4", "4,321", "2,345", "3.5"]
    assert profiled == [["packed", *figures, "12%", "5%", "91%", "46%"],
                        ["packed@16x2", *figures, "", "", "91%", "46%"]]  # fmt: skip
    assert table_row(block, "bench-qwen3-1.7b")[2] == "ok" and "packed@16x2/packed 1.40x" in block
    assert "**Update benchmark, qwen3-1.7b** (run 1; 0.00B parameters, DHPO-E row, bfloat16" in block  # the row timed
    arms["packed@16x2"]["timed_runs"] = 0
    status = table_row(docs.render(gpu_report("d", "c", {"bench-qwen3-1.7b": part})), "bench-qwen3-1.7b")[2]
    assert status == "ok: timed runs: packed 2 of 2, packed@16x2 0 of 1"


def test_docs_block_takes_each_part_from_the_latest_run_that_holds_it():
    """Reports given newest first: the run order is the recorded dates', each part comes from the latest run that
    has it, and the runs it superseded are listed."""
    train = {"status": "ok", "seconds": 50.0, "result": {"shape": "qwen3-0.6b", "parameters": 6e8, "steps": 4,
             "seconds": 35.0, "losses": [0.25], "metrics_logged": ["loss"], "peak_memory_bytes": 2**30,
             "padding_free": True, "attention_kernels": {}}}  # fmt: skip
    older = gpu_report("2026-01-01T00:00:00Z", "1" * 40, {
        "train": train, "bench-qwen3-1.7b": bench_part("failed (exit 1)", 2, {"packed": bench_arm(1111.0, 1)}, {})})
    newer = gpu_report("2026-01-02T00:00:00Z", "2" * 40, {
        "bench-qwen3-1.7b": bench_part("ok", 2, {"packed": bench_arm(2222.0, 2)}, {})})
    block = docs.render([newer, older])
    assert table_row(block, "run 1")[2] == "`1111111111`" and table_row(block, "run 2")[2] == "`2222222222`"
    assert table_row(block, "packed")[2] == "2,222" and "1,111" not in block
    assert table_row(block, "bench-qwen3-1.7b")[1:3] == ["run 2", "ok"]
    assert table_row(block, "bench-qwen3-1.7b")[4] == "run 1: failed (exit 1)"
    assert table_row(block, "train")[1] == "run 1" and "4 steps in 35.0 s" in block
    assert [name for name in docs.latest_parts([newer, older])] == ["train", "bench-qwen3-1.7b"]


def test_docs_cli_takes_one_commit_per_report(tmp_path, capsys):
    paths = []
    for index, recorded in enumerate(["1" * 40, None]):
        paths.append(tmp_path / f"run{index}.json")
        paths[-1].write_text(json.dumps(gpu_report(f"2026-01-0{index + 1}T00:00:00Z", recorded, {})))
    doc = tmp_path / "doc.md"
    doc.write_text(f"# head\n{docs.BEGIN}\nold\n{docs.END}\ntail\n")
    with pytest.raises(SystemExit) as stopped:
        docs.main([*map(str, paths), "--doc", str(doc), "--commit", "3" * 40])
    assert stopped.value.code == 2 and "--commit" in capsys.readouterr().err.splitlines()[-1]
    with pytest.raises(SystemExit):  # the second run recorded no commit
        docs.main([*map(str, paths), "--doc", str(doc)])
    assert docs.main([*map(str, paths), "--doc", str(doc), "--commit", "4" * 12, "--commit", "5" * 12]) == 0
    text = doc.read_text()
    assert table_row(text, "run 1")[2] == f"`{'4' * 10}` (its JSON records `{'1' * 10}`)"
    assert table_row(text, "run 2")[2] == f"`{'5' * 10}`" and text.endswith("tail\n") and "\nold\n" not in text


def test_the_shipped_block_is_the_rendering_of_the_committed_runs(tmp_path):
    """docs/performance_gpu.md's figures are the script's rendering of the JSONs under docs/gpu_runs, with the
    commits its runs table names: no figure edited by hand."""
    shipped = (ROOT / "docs/performance_gpu.md").read_text()
    runs = sorted((ROOT / "docs/gpu_runs").glob("*/run*.json"), key=lambda path: json.loads(path.read_text())["date"])
    block = shipped.split(docs.BEGIN)[1].split(docs.END)[0]
    commits = [table_row(block, f"run {n}")[2].split("`")[1] for n in range(1, len(runs) + 1)]
    doc = tmp_path / "performance_gpu.md"
    doc.write_text(shipped)
    docs.main([*map(str, runs), "--doc", str(doc), *(f"--commit={c}" for c in commits)])
    assert doc.read_text() == shipped and "H100" in block and len(runs) >= 2


# ------------------------------------------------------------------------------------------------- benchmark
@pytest.fixture(scope="module")
def bench():
    return load("benchmarks/bench_dynamic_batching.py")


def test_update_flops_counted_by_hand(bench):
    """hidden 8, 2 heads of 4, 1 key/value head, MLP 16, 1 layer, vocab 10; one sequence, prompt 2, completion 3."""
    config = SimpleNamespace(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=4, intermediate_size=16, vocab_size=10)  # fmt: skip
    matrices = 5 * 2 * (8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 16)  # q, k, v, o, MLP for 5 tokens
    head = 3 * 2 * 8 * 10  # the completion tokens' LM head
    attention = 15 * 2 * 2 * (4 + 4)  # 15 causal pairs, 2 heads, QK and AV of 4 multiply-adds
    assert bench.update_flops(config, [2], [3]) == 3 * (matrices + head + attention)
    assert bench.update_flops(config, [2, 2], [3, 3]) == 2 * bench.update_flops(config, [2], [3])


def test_peak_tflops_by_device_name(bench):
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and bench.peak_tflops("NVIDIA H200") == 989.0
    assert bench.peak_tflops("NVIDIA H100 PCIe") == 756.0 and bench.peak_tflops("Tesla T4") is None


def test_an_arm_without_a_timed_run_reports_no_speed(bench):
    """A benchmark cut short after its warm-up runs: memory and padding, but no throughput from untimed steps."""
    probe = SimpleNamespace(real=90, forwarded=120, peaks=[5, 7], kernels={"sdpa": 3}, prompts_total=0,
                            trained_tokens=60, step_seconds=2.0, score_seconds=0.5, config=None,
                            prompt_lengths=[], completion_lengths=[], health={}, seconds=3.5,
                            shape={"batch_size": 16, "accumulation": 2}, largest_pass=48, graphs_compiled=0)  # fmt: skip
    figures = bench.arm_figures([probe], None, 2, 989.0)
    assert figures["padding_fraction"] == 0.25 and figures["peak_step_memory_bytes"] == 7
    assert figures["shape"] == {"batch_size": 16, "accumulation": 2} and figures["largest_pass_tokens"] == 48
    assert figures["run_seconds"] == [3.5]
    assert figures["timed_runs"] == 0 and "trained_tokens_per_second" not in figures


TINY_BENCH = ["--hidden-size", "32", "--layers", "1", "--heads", "2", "--batch-size", "2", "--generations", "2",
              "--accumulation", "2", "--max-completion", "16", "--max-prompt", "20", "--steps", "2"]


def test_a_kept_probe_holds_no_trainer(bench, tmp_path, monkeypatch):
    """The benchmark keeps every run's probe; a probe must not keep its trainer (model, gradients, batches) alive, or
    on a GPU each run's model stays in memory until it runs out (the 1.7B shape did by its fifth run on an H100)."""
    import gc

    from trl import GRPOTrainer

    kept = []
    monkeypatch.setattr(bench, "print_report", lambda report: None)
    run_once = bench.run_once
    monkeypatch.setattr(bench, "run_once", lambda *args, **kwargs: kept.append(run_once(*args, **kwargs)) or kept[-1])
    bench.main(["--arms", "packed", "--repeats", "0", *TINY_BENCH])
    gc.collect()
    assert len(kept) == 1 and kept[0][0].trainer is None
    assert not [o for o in gc.get_objects() if isinstance(o, GRPOTrainer)]
    assert kept[0][0].trained_tokens > 0  # the run trained


def test_arms_report_health_and_a_profiled_arm_its_operators(bench, tmp_path, monkeypatch):
    """Each arm reports its warm-up run's losses, gradient norms and non-finite update values (a NaN update gap then
    says whether the run diverged) and each run's seconds; a profiled arm its top operators, the others none. The
    profiled runs come after the first timed round: a benchmark cut short keeps every arm's speed first."""
    out, order = tmp_path / "bench.json", []
    run_once = bench.run_once

    def recorded(name, *args, **kwargs):
        measured = kwargs.get("measure_memory", args[4] if len(args) > 4 else None)
        order.append((name, "profile" if kwargs.get("profiled") else "warm-up" if measured else "timed"))
        return run_once(name, *args, **kwargs)

    monkeypatch.setattr(bench, "run_once", recorded)
    bench.main(["--arms", "trl,packed", "--profile", "packed", "--repeats", "1", "--json", str(out), *TINY_BENCH])
    assert order == [("trl", "warm-up"), ("packed", "warm-up"), ("trl", "timed"), ("packed", "timed"),
                     ("packed", "profile")]  # fmt: skip
    arms = json.loads(out.read_text())["arms"]
    for arm in arms.values():
        health = arm["warm_up_run"]
        assert len(health["losses"]) == 2 and all(math.isfinite(x) for x in health["losses"] + health["grad_norms"])
        assert health["nonfinite_update_values"] == 0
        assert len(arm["run_seconds"]) == 2 and all(seconds > 0 for seconds in arm["run_seconds"])
    operators = arms["packed"]["profile_top_operators"]
    assert "profile_top_operators" not in arms["trl"] and len(operators) == 25
    assert arms["packed"]["timed_runs"] == arms["trl"]["timed_runs"] == 1  # the profiled run is not timed
    assert operators[0]["self_cpu_ms"] >= operators[-1]["self_cpu_ms"] > 0 and operators[0]["calls"] >= 1
    assert arms["packed"]["profile_window"] == {"micro_steps": [2, 3]} and arms["packed"]["profile_run_seconds"] > 0


def test_a_profiled_run_records_only_its_window(bench):
    """The profiler records the window's micro-steps and nothing before or after: a fake trainer whose micro-step k
    runs k + 1 cosines shows 3 + 4 of them for the window of steps 2 and 3 out of 0-5."""
    trainer = SimpleNamespace(training_step=None, _generate_and_score_completions=None)
    calls = []
    trainer.training_step = lambda model, inputs, n=None: calls.append(torch.zeros(1)) or [
        torch.zeros(1).cos() for _ in range(len(calls))]  # fmt: skip
    probe = bench.Probe(trainer, "cpu", set(), "wall", range(2, 4))
    for _ in range(6):
        probe.step(None, None)
    cosines = [row for row in probe.profile if row["name"] == "aten::cos"]
    assert len(calls) == 6 and cosines and cosines[0]["calls"] == 3 + 4 and probe.profiler is None
    # each micro-step of the window one marked range, holding every operator the profiler's own table counts
    summary, table = probe.profile_summary, [row for row in probe.profile if row["name"].startswith("aten::")]
    assert summary["micro_steps"] == 2 and summary["aten_ops_per_micro_step"] == sum(r["calls"] for r in table) / 2
    probe.release()
    assert trainer.training_step is not probe.step


def test_a_profiled_micro_step_starts_synchronised_and_holds_its_closing_synchronisation(bench, monkeypatch):
    """On CUDA a profiled micro-step is marked from an idle device to its closing synchronisation: the summary counts
    the benchmark's closing cudaDeviceSynchronize once a micro-step, never the one before the range. The runtime call
    is stood in for by a host range of its name (no GPU here)."""
    def synchronize():
        with torch.profiler.record_function("cudaDeviceSynchronize"):
            pass

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    def micro_step(model, inputs, n=None):
        return torch.zeros(1).cos()

    trainer = SimpleNamespace(training_step=micro_step, _generate_and_score_completions=None)
    probe = bench.Probe(trainer, "cuda", set(), "wall", range(1, 3))
    with pytest.warns(UserWarning, match="CUDA"):  # a CPU build's profiler drops the CUDA activity
        for _ in range(4):
            probe.step(None, None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as alone:
        micro_step(None, None)
    summary, operators = probe.profile_summary, [e for e in alone.events() if e.name.startswith("aten::")]
    assert summary["micro_steps"] == 2 and summary["synchronisations_per_micro_step"] == 1
    assert summary["aten_ops_per_micro_step"] == len(operators) and summary["kernel_launches_per_micro_step"] == 0
    probe.release()


def test_every_arm_runs_its_steps_in_the_update_attention_context(bench, tmp_path, monkeypatch):
    """TRL's arm too: with the context on (forced here, as on CUDA with torch >= 2.11) every SDPA call of every arm
    runs with cuDNN attention off, so the arms differ in batching only; the report names the context."""
    import torch.nn.functional as functional
    from dhpo_trl.training import cuda_attention

    monkeypatch.setattr(cuda_attention, "for_update", lambda device: (cuda_attention.without_cudnn, "no cuDNN"))
    calls, sdpa = [], functional.scaled_dot_product_attention
    monkeypatch.setattr(functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(torch.backends.cuda.cudnn_sdp_enabled()) or sdpa(*a, **k))
    out = tmp_path / "bench.json"
    bench.main(["--arms", "trl,dynamic", "--repeats", "0", "--json", str(out), *TINY_BENCH])
    assert calls and not any(calls) and torch.backends.cuda.cudnn_sdp_enabled()
    assert json.loads(out.read_text())["update_attention"] == "no cuDNN"


def test_profile_names_only_arms_that_run(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--arms", "trl,packed", "--profile", "dynamic", *TINY_BENCH])
    assert "--profile" in capsys.readouterr().err


def test_health_counts_what_is_not_finite(bench):
    change = [torch.tensor([1.0, float("nan")]), torch.tensor([[float("inf"), 0.0]])]
    health = bench.health([{"loss": 0.5, "grad_norm": 1.0}, {"train_runtime": 3.0}], change)
    assert health == {"losses": [0.5], "grad_norms": [1.0], "nonfinite_update_values": 2}


def test_every_part_runs_with_the_python_command_line():
    """`--python` may be a command line (the dry run's test passes an interpreter and a script): every part's command
    starts with its words and goes on with the same arguments as with a bare interpreter."""
    bare = check.plan(True, "python3", Path("/nonexistent"), "")
    served = check.plan(True, "/venv/python /tests/served python.py", Path("/nonexistent"), "")
    assert [p.command[:2] for p in served] == [["/venv/python", "/tests/served"]] * len(bare)
    assert [p.command[2:] for p in served] == [["python.py", *p.command[1:]] for p in bare]


def test_the_default_python_is_this_interpreter_whatever_its_path(monkeypatch, tmp_path):
    """Without `--python` every part starts with this interpreter as one word, a path with a space included."""
    monkeypatch.setattr(sys, "executable", "/opt/a venv/bin/python")
    planned = []
    monkeypatch.setattr(check, "run_parts", lambda parts, *rest: planned.extend(parts))
    assert check.main([str(tmp_path / "out"), "--cpu"]) == 0
    assert planned and {p.command[0] for p in planned} == {"/opt/a venv/bin/python"}


def test_a_stop_signal_ends_the_benchmark_not_just_its_run(bench, monkeypatch):
    """SIGTERM (a time box's end) stops DHPOTrainer's run gracefully; the benchmark must then exit, not start the next
    run past the box."""
    from dhpo_trl import DHPOTrainer

    started = []

    def stopped(self, *args, **kwargs):
        started.append(self)
        self.graceful_stop = {"signal": "SIGTERM", "step": 1, "checkpoint": "checkpoint-1"}

    monkeypatch.setattr(DHPOTrainer, "train", stopped)
    with pytest.raises(SystemExit, match="SIGTERM at optimizer step 1 of the dynamic run"):
        bench.main(["--arms", "dynamic,packed", "--repeats", "1", *TINY_BENCH])
    assert len(started) == 1


def test_the_targets_are_judged_at_every_shape_both_arms_were_asked_for():
    """`packed/trl` is judged at 4 x 8 and at 16 x 2 when both shapes' arms were asked; a shape missing one of the two
    arms is not judged; an arm asked that did not run leaves the ratio None, not met."""
    bench = {"options": {"arms": "trl,dynamic,packed,trl@16x2,packed@16x2,packed@4x8+compile,dynamic@4x8+compile"},
             "throughput_ratios": {"packed/dynamic": 0.9, "packed@16x2/trl@16x2": 2.5, "dynamic/trl": 2.0}}
    judged = check.judged_targets({"packed/dynamic": 1.3, "packed/trl": 2.5}, bench)
    assert judged == {"packed/dynamic": {"value": 0.9, "target": 1.3, "met": False},
                      "packed/trl": {"value": None, "target": 2.5, "met": False},
                      "packed@16x2/trl@16x2": {"value": 2.5, "target": 2.5, "met": True}}  # a target reached is met


@pytest.mark.parametrize("short", [1, "all"])  # one second short, or none at all (`--total-seconds 0`)
def test_a_total_below_the_parts_planned_time_is_refused_before_any_part_runs(tmp_path, capsys, short):
    """`--total-seconds` under the planned minimums of the parts asked would skip the wheels part for lack of time and
    fail every part after it on a missing import (a lent GPU's minutes spent on nothing): refused in one line naming
    the option and the seconds needed, nothing run, no temporary folder left."""
    before = set(Path(tempfile.gettempdir()).glob("dhpo_gpu_check_*"))
    needed = sum(p.minimum for p in check.plan(False, "python3", Path("/nonexistent"), ".gpu_wheels")
                 if p.name in ("wheels", "bench-qwen3-1.7b"))  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        total = needed - 1 if short == 1 else 0
        check.main([str(tmp_path / "out"), "--parts", "bench-qwen3-1.7b", "--total-seconds", str(total)])
    error = capsys.readouterr().err
    assert stop.value.code == 2 and "--total-seconds" in error and f"give at least {needed:g}" in error
    assert not (tmp_path / "out" / "gpu_check.json").exists()
    assert set(Path(tempfile.gettempdir()).glob("dhpo_gpu_check_*")) == before


def test_an_unknown_part_is_refused_and_leaves_no_temporary_folder(tmp_path, capsys):
    before = set(Path(tempfile.gettempdir()).glob("dhpo_gpu_check_*"))
    with pytest.raises(SystemExit) as stop:
        check.main([str(tmp_path / "out"), "--parts", "bench-qwen3-9b"])
    assert stop.value.code == 2 and "--parts" in capsys.readouterr().err
    assert set(Path(tempfile.gettempdir()).glob("dhpo_gpu_check_*")) == before
