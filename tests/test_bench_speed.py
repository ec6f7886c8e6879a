"""benchmarks/bench_speed.py: its three arms still build and train on a tiny model, each on the update path it names
(the second on TRL's own micro-batches), with the same clip range and run settings as GRPO's arm and the same
number of timed steps; the arms' order balances place and predecessor; options it cannot run are refused."""

import importlib.util
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from datasets import Dataset

from dhpo_trl.training import batching

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(device="cpu", steps=6, steps_per_generation=4, batch_size=4, completion_length=16, hidden_size=32,
            layers=1, heads=2, repeats=3)  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_speed_under_test", ROOT / "benchmarks/bench_speed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_each_arm_trains_on_the_path_it_names_with_grpo_arm_settings(bench, tmp_path, monkeypatch):
    planned = []  # the buffered micro-batches the padded path was given, and what it returned
    plan = batching.Padded.plan
    monkeypatch.setattr(batching.Padded, "plan", lambda self, buffered, run: planned.append(
        (buffered, plan(self, buffered, run)[0])) or plan(self, buffered, run))  # fmt: skip
    tok = bench.build_char_tokenizer()
    data = Dataset.from_dict({"prompt": [f"Compute {a}+{a}. Answer:" for a in range(32)]})
    probes = {arm: bench.run_once(arm, SimpleNamespace(**TINY), tok, data, str(tmp_path)) for arm in bench.ARMS}

    assert {arm: probe.path for arm, probe in probes.items()} == {
        "GRPO": "TRL's", "DHPO-E trl-batching": "padded", "DHPO-E auto": "packed"}  # fmt: skip
    assert planned and all(given is returned for given, returned in planned)  # TRL's micro-batches, unchanged
    assert all(len(probe.times) == 3 and probe.peak_bytes > 0 for probe in probes.values())  # steps 1-3; 5 profiled
    grpo = probes["GRPO"].args
    for arm in ("DHPO-E trl-batching", "DHPO-E auto"):
        args = probes[arm].args
        assert args.algorithm == "dhpo" and args.mixing == "entropy"
        assert (args.epsilon_low_token, args.epsilon_high_token) == (grpo.epsilon, grpo.epsilon_high)
        assert (args.epsilon_low_seq, args.epsilon_high_seq) == (grpo.epsilon, grpo.epsilon_high)
        for field in ("loss_type", "beta", "delta", "num_iterations", "max_completion_length", "steps_per_generation",
                      "per_device_train_batch_size", "num_generations", "seed", "max_steps", "learning_rate"):
            assert getattr(args, field) == getattr(grpo, field), field


def test_arm_order_balances_place_and_predecessor(bench):
    orders = [bench.arm_order(repeat) for repeat in range(2 * len(bench.ARMS))]
    assert all(sorted(order) == sorted(bench.ARMS) for order in orders)
    block = orders[: len(bench.ARMS)]
    for place in range(len(bench.ARMS)):
        assert Counter(order[place] for order in block) == Counter(list(bench.ARMS)), place
    pairs = Counter((order[i], order[i + 1]) for order in orders for i in range(len(order) - 1))
    assert len(pairs) == len(bench.ARMS) * (len(bench.ARMS) - 1) and len(set(pairs.values())) == 1


@pytest.mark.parametrize("change, flag", [
    (dict(repeats=4), "--repeats"), (dict(repeats=0), "--repeats"),
    (dict(steps_per_generation=1), "--steps-per-generation"),
    (dict(steps=5), "--steps"), (dict(steps=1, steps_per_generation=2), "--steps"),
])  # fmt: skip
def test_options_it_cannot_run_are_refused_naming_the_flag(bench, change, flag):
    assert bench.options_error(SimpleNamespace(**TINY)) is None
    assert bench.options_error(SimpleNamespace(**{**TINY, **change})).split(" ")[0].rstrip(":") == flag
