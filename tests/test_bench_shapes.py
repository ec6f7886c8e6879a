"""benchmarks/bench_dynamic_batching.py's per-arm batch shapes (`NAME@BxA`): the shape an arm trains at, refused
where it would change the sequences of an optimizer step, and the same update as TRL's arm at the base shape,
measured by the benchmark's own `update_gap_to_trl`.
"""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_shapes_under_test", ROOT / "benchmarks/bench_dynamic_batching.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# A base shape of 4 x 8 (the GPU run's), tiny otherwise: 64 sequences a generation batch, two optimizer steps.
BASE = ["--hidden-size", "32", "--layers", "1", "--heads", "2", "--batch-size", "4", "--generations", "2",
        "--accumulation", "8", "--max-completion", "16", "--max-prompt", "20", "--steps", "2"]  # fmt: skip


def test_an_arm_shape_keeps_the_generation_batch(bench):
    assert bench.arm_shape("packed", 4, 8) == {"name": "packed", "batch_size": 4, "accumulation": 8,
                                               "steps_per_generation": 16, "torch_compile": False}  # fmt: skip
    assert bench.arm_shape("dynamic@16x2+compile", 4, 8) == {"name": "dynamic", "batch_size": 16, "accumulation": 2,
                                                             "steps_per_generation": 4, "torch_compile": True}  # fmt: skip
    for label, rows, steps in (("packed@16x2", 16, 2), ("dynamic@32x1", 32, 1), ("trl@2x16", 2, 16)):
        shape = bench.arm_shape(label, 4, 8)
        assert (shape["batch_size"], shape["accumulation"]) == (rows, steps)
        assert shape["batch_size"] * shape["steps_per_generation"] == 4 * 2 * 8  # the base generation batch
        assert shape["steps_per_generation"] == 2 * shape["accumulation"]  # two optimizer steps of it


@pytest.mark.parametrize("label", ["packed@16x4", "packed@3x8", "packed@16", "packed@0x32", "packed@16x2x1",
                                   "wide@16x2", "packed@x2", "packed@-16x-2", ""])  # fmt: skip
def test_a_shape_that_changes_the_optimizer_step_is_refused(bench, label, capsys):
    with pytest.raises(ValueError, match="^--arms"):
        bench.arm_shape(label, 4, 8)
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--arms", f"trl,{label}", "--repeats", "0", *BASE])
    assert stopped.value.code == 2 and "--arms" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("argv, named", [
    (["--arms", "packed,packed@4x8"], "--arms"),  # the same arm twice
    (["--arms", "trl,packed", "--wide-repeats", "1"], "--wide-repeats"),  # no arm it would act on
    (["--arms", "trl,packed@16x2", "--profile", "packed"], "--profile"),  # a shape is an arm of its own
    (["--arms", "trl,packed@16x2", "--wide-repeats", "-1"], "--wide-repeats"),  # no run, silently
    (["--arms", "trl,packed", "--compile"], "--arms"),  # packed rows are refused compiled (gradient checkpointing)
])  # fmt: skip
def test_arm_options_that_would_not_act_are_refused(bench, argv, named, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench.main([*argv, "--repeats", "0", *BASE])
    assert stopped.value.code == 2 and named in capsys.readouterr().err.splitlines()[-1]


def test_wide_arms_train_the_same_update_as_trl(bench, tmp_path, monkeypatch):
    """`packed@16x2` and `dynamic@16x2` against TRL at 4 x 8: the same sequences per optimizer step, so the same
    summed gradient (plain SGD: the parameter change) up to float32 rounding. The check can fail: an arm whose
    accumulation is applied wrongly (16 rows x 8 steps, generation batch kept) trains another update, far outside
    the tolerance. Each arm reports the shape it ran and its timed runs asked."""
    shape = bench.arm_shape

    def misapplied(label, batch_size, accumulation):
        found = shape(label, batch_size, accumulation)
        return {**found, "accumulation": 8} if label == "packed@8x4" else found  # 8 x 8: twice the sequences

    monkeypatch.setattr(bench, "arm_shape", misapplied)
    monkeypatch.setattr(bench, "print_report", lambda report: None)
    out = tmp_path / "bench.json"
    bench.main(["--arms", "trl,packed@16x2,dynamic@16x2,packed@8x4", "--repeats", "0", "--wide-repeats", "0",
                "--json", str(out), *BASE])  # fmt: skip
    arms = json.loads(out.read_text())["arms"]
    assert arms["trl"]["update_gap_to_trl"] == 0
    for label in ("packed@16x2", "dynamic@16x2"):
        assert arms[label]["update_gap_to_trl"] < 1e-4, label
    assert arms["packed@8x4"]["update_gap_to_trl"] > 1e-2
    assert arms["packed@16x2"]["shape"] == {"name": "packed", "batch_size": 16, "accumulation": 2,
                                            "steps_per_generation": 4, "torch_compile": False,
                                            "max_tokens_per_micro_batch": None}  # fmt: skip
    assert arms["trl"]["shape"]["batch_size"] == 4 and arms["trl"]["timed_runs_asked"] == 0


def test_wide_repeats_time_each_shaped_arm_its_own_runs(bench, tmp_path, monkeypatch):
    """--wide-repeats sets the timed runs of the arms written NAME@BxA, fewer or more than --repeats, interleaved
    with the others; each arm's figures say how many it asked and got. The profiled run comes after the first timed
    round, before the others: a benchmark cut short keeps every arm's speed first. Runs are stand-ins here."""
    config = SimpleNamespace(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=4, intermediate_size=16, vocab_size=10)  # fmt: skip
    order = []

    def stand_in(name, options, *rest, measure_memory=False, profiled=False):
        order.append(name if measure_memory else f"{'profile' if profiled else 'timed'} {name}")
        probe = SimpleNamespace(real=9, forwarded=10, peaks=[1], kernels={}, prompts_total=0, trained_tokens=6,
                                step_seconds=2.0, score_seconds=1.0, config=config, prompt_lengths=[2],
                                completion_lengths=[3], health={}, seconds=1.0, largest_pass=5, graphs_compiled=0,
                                shape=bench.arm_shape(name, options.batch_size, options.accumulation),
                                profile=[], profile_steps=range(2, 4), profile_summary=None)  # fmt: skip
        return probe, [torch.ones(2)] if measure_memory else None, 100

    monkeypatch.setattr(bench, "run_once", stand_in)
    monkeypatch.setattr(bench, "print_report", lambda report: None)
    out = tmp_path / "bench.json"
    for repeats, wide, timed in (
        ("2", "1", ["trl", "packed", "packed@16x2", "profile", "packed", "trl"]),
        ("1", "3", ["trl", "packed", "packed@16x2", "profile", "packed@16x2", "packed@16x2"]),
        ("0", "0", ["profile"]),
    ):
        order.clear()
        bench.main(["--arms", "trl,packed,packed@16x2", "--repeats", repeats, "--wide-repeats", wide, "--json",
                    str(out), "--profile", "packed@16x2", *BASE])  # fmt: skip
        runs = ("profile packed@16x2" if name == "profile" else f"timed {name}" for name in timed)
        assert order == ["trl", "packed", "packed@16x2", *runs]
        arms = json.loads(out.read_text())["arms"]
        for name, figures in arms.items():
            asked = int(wide if "@" in name else repeats)
            assert figures["timed_runs"] == figures["timed_runs_asked"] == asked, name


def test_the_printed_profile_line_says_what_a_cuda_window_could_not_count(bench, capsys):
    """A CUDA window whose launches were not recognised prints `?` launches, never 0, next to its busy and waiting
    shares; a CPU window prints `-` for the device's figures."""
    from dhpo_trl.training import step_profile

    def host(name, start, end):
        return {"name": name, "device": False, "start": start, "end": end, "annotation": False}

    cuda = [host("m", 0, 1000), host("cudaLaunchUnknown", 1, 2), host("cudaStreamSynchronize", 500, 750),
            {"name": "k", "device": True, "start": 10, "end": 260, "annotation": False}]  # fmt: skip
    summaries = {"dynamic@16x2": step_profile.summarise(cuda, "m", cuda=True),
                 "packed": step_profile.summarise(cuda[:1], "m", cuda=False)}  # fmt: skip
    arm = {"padding_fraction": 0.0, "peak_step_memory_bytes": 0, "attention_kernels": {}, "update_gap_to_trl": None}
    options = {key: 0 for key in ("algorithm", "batch_size", "accumulation", "max_prompt", "max_completion",
                                  "median_fraction", "sigma", "max_tokens", "steps", "repeats")}  # fmt: skip
    bench.print_report({"options": options, "device_name": "d", "dtype": "t", "shape": None, "parameters": 0,
                        "trained_tokens_per_run": 0, "throughput_ratios": {},
                        "arms": {name: {**arm, "profile_summary": s} for name, s in summaries.items()}})  # fmt: skip
    lines = {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("profile")}
    assert "? launches" in lines["profile dynamic@16x2"] and "device busy 25%" in lines["profile dynamic@16x2"]
    assert "host waiting 25%" in lines["profile dynamic@16x2"]
    assert "0 launches" in lines["profile packed"] and "device busy -, host waiting -" in lines["profile packed"]


def test_the_paths_are_compared_at_each_shape_they_ran(bench):
    """Throughput ratios pair the paths at the base shape and at every shape written NAME@BxA (the issue's targets
    at 16 x 2 compare packed rows with TRL at 16 x 2, not at 4 x 8), each arm at its own shape against its base, and
    a compiled arm against its eager twin; a pair one of whose arms did not run is left out."""
    rates = {"trl": 1.0, "dynamic": 2.0, "packed": 3.0, "trl@16x2": 5.0, "packed@16x2": 20.0, "dynamic@16x2": 8.0,
             "dynamic+compile": 6.0, "dynamic@16x2+compile": 16.0}  # fmt: skip
    figures = {name: {"trained_tokens_per_second": rate} for name, rate in rates.items()}
    ratios = bench.throughput_ratios(figures, list(rates) + ["shared@16x2"])
    assert ratios == pytest.approx({
        "packed/dynamic": 1.5, "packed/trl": 3.0, "dynamic/trl": 2.0,
        "packed@16x2/dynamic@16x2": 2.5, "packed@16x2/trl@16x2": 4.0, "dynamic@16x2/trl@16x2": 1.6,
        "trl@16x2/trl": 5.0, "packed@16x2/packed": 20 / 3, "dynamic@16x2/dynamic": 4.0,
        "dynamic+compile/dynamic": 3.0, "dynamic@16x2+compile/dynamic@16x2": 2.0})  # fmt: skip
