"""DHPO across 2 CPU processes (torchrun's environment, gloo): training completes, cross-process reductions are right,
and 2 processes x B sequences give what 1 process x 2B sequences gives.

What matches, on a fixed off-policy batch (tests/dist_scripts/dhpo_distributed.py --fixed-batch):
- the gradient after DDP's all-reduce, to 1e-6 absolute (float32 summation order only);
- every `dhpo/` metric (token-weighted sums and global extremes over processes), to 1e-6 relative;
- the `global` entropy min-max, to 1e-6, so the mixing weights are those of the whole batch;
- the loss: each process reports the mean over its own B responses (eq. 7), so the mean of the 2 processes' losses
  equals the 1-process loss (to 1e-6); the per-process values themselves differ.
What does not: full training runs, since TRL seeds each process differently (`set_seed(seed, device_specific=True)`)
and each process generates its own completions, so the sampled data differ from a 1-process run.
"""

import importlib.util
import json
from pathlib import Path

import processes
import pytest
import torch

SCRIPT = Path(__file__).parent / "dist_scripts" / "dhpo_distributed.py"
B = 3  # sequences per process in the fixed batch


def _two_ranks(out_dir, *flags):
    result = processes.forked_ranks(SCRIPT, out_dir, *flags, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _one_process_fixed_batch(out_dir):
    """The 1-process side in this process: the same function the script runs, on the same 2B sequences. A 1-process
    torchrun would run it undistributed too, after 10-15 s of launcher and imports."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(SCRIPT.parent))  # the script imports from its folder
        spec = importlib.util.spec_from_file_location("dhpo_distributed_in_process", SCRIPT)
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        script.run_fixed_batch(str(out_dir), B)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    two, one = tmp_path_factory.mktemp("two_ranks"), tmp_path_factory.mktemp("one_rank")
    _two_ranks(two, "--train", "--fixed-batch", str(B))
    _one_process_fixed_batch(one)
    return two, one


def _train_dumps(two):
    dumps = [json.loads((two / f"train_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [dump["world_size"] for dump in dumps] == [2, 2]
    return dumps


def test_two_process_training_completes(runs):
    dumps = _train_dumps(runs[0])
    history = [entry for entry in dumps[0]["log_history"] if "dhpo/token_ratio/mean" in entry]
    assert len(history) == 4  # max_steps=4, logging_steps=1
    assert max(entry["dhpo/token_ratio/max"] for entry in history) > 1.0  # off-policy steps happened


def test_global_entropy_scope_gives_every_rank_the_same_range(runs):
    rank0, rank1 = (dump["entropy_range"] for dump in _train_dumps(runs[0]))
    assert len(rank0) == len(rank1) == 4
    for call0, call1 in zip(rank0, rank1, strict=True):
        assert (call0["min"], call0["max"]) == (call1["min"], call1["max"])
        assert call0["min"] == pytest.approx(min(call0["local_min"], call1["local_min"]), abs=1e-6)
        assert call0["max"] == pytest.approx(max(call0["local_max"], call1["local_max"]), abs=1e-6)
    # the local ranges differ, so the reduction did something
    assert any(c0["local_max"] != c1["local_max"] for c0, c1 in zip(rank0, rank1, strict=True))


def test_logged_dhpo_metrics_are_reduced_over_both_ranks(runs):
    dumps = _train_dumps(runs[0])
    rank0, rank1 = (dump["token_ratio"] for dump in dumps)
    history = [entry for entry in dumps[0]["log_history"] if "dhpo/token_ratio/mean" in entry]
    for call0, call1, logged in zip(rank0, rank1, history, strict=True):
        pooled = (call0["local_sum"] + call1["local_sum"]) / (call0["local_tokens"] + call1["local_tokens"])
        assert call0["logged_mean"] == pytest.approx(pooled, rel=1e-6)
        assert call1["logged_mean"] == call0["logged_mean"]
        assert logged["dhpo/token_ratio/mean"] == pytest.approx(pooled, rel=1e-6)


def test_two_processes_match_one_process_with_twice_the_batch(runs):
    two, one = runs
    rank0, rank1 = (torch.load(two / f"fixed_rank{rank}.pt") for rank in (0, 1))
    single = torch.load(one / "fixed_rank0.pt")
    assert (rank0["world_size"], single["world_size"]) == (2, 1)
    torch.testing.assert_close(rank0["gradient"], rank1["gradient"], rtol=0, atol=0)  # DDP: identical on both
    torch.testing.assert_close(rank0["gradient"], single["gradient"], rtol=0, atol=1e-6)
    assert single["gradient"].abs().max() > 1e-3
    assert (rank0["loss"] + rank1["loss"]) / 2 == pytest.approx(single["loss"], rel=1e-6, abs=1e-7)
    assert set(rank0["metrics"]) == set(single["metrics"]) and len(single["metrics"]) >= 13
    for key, value in single["metrics"].items():
        assert rank0["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
        assert rank1["metrics"][key] == rank0["metrics"][key], key
    for bound in ("min", "max"):
        assert rank0["entropy_range"][bound] == pytest.approx(single["entropy_range"][bound], abs=1e-6)
