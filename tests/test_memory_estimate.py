"""scripts/memory_estimate.py: the parameter count is Qwen3-30B-A3B's, and the per-GPU figures add up."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "memory_estimate.py"
spec = importlib.util.spec_from_file_location("memory_estimate", SCRIPT)
memory_estimate = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = memory_estimate  # dataclasses look their module up there
spec.loader.exec_module(memory_estimate)
GIB = 2**30


def test_parameter_count_matches_the_published_sizes():
    params = memory_estimate.count_parameters(memory_estimate.QWEN3_30B_A3B)
    assert params.total == pytest.approx(30.5e9, rel=0.01)  # model card: 30.5B total
    assert params.total - params.embeddings - params.lm_head == pytest.approx(29.9e9, rel=0.01)  # 29.9B non-embedding
    assert params.active == pytest.approx(3.3e9, rel=0.03)  # model card: 3.3B activated
    assert params.expert_size == 3 * 2048 * 768 and params.experts_per_layer == 128 * params.expert_size


def test_state_is_sixteen_bytes_per_parameter_sharded():
    e = memory_estimate.estimate(gpus=8)
    assert sum(e.state.values()) == pytest.approx(16 * e.params.total / 8)
    offloaded = memory_estimate.estimate(gpus=8, offload_optimizer=True)
    assert sum(offloaded.state.values()) == pytest.approx(4 * e.params.total / 8)


def test_activations_follow_the_micro_batch_and_the_verdicts():
    small, large = memory_estimate.estimate(micro_batch=4), memory_estimate.estimate(micro_batch=16)
    assert large.checkpoints == 16 * 5120 * 2048 * 2 * 48 == 4 * small.checkpoints
    assert large.layer_recompute == pytest.approx(4 * small.layer_recompute)
    assert small.fits and not large.fits  # the recipe's micro-batch 16 does not fit on 8 GPUs; 4 does
    assert memory_estimate.estimate(gpus=32, micro_batch=16).fits  # the paper's 4 x 8 GPUs


def test_report_prints_the_computed_numbers(capsys):
    result = memory_estimate.main(["--gpus", "8", "--micro-batch", "4"])
    out = capsys.readouterr().out
    assert "30,532,122,624" in out
    assert f"{result.peak / GIB:8.2f} GiB" in out and "fits" in out


def test_offloaded_optimizer_state_lands_in_each_nodes_ram():
    total = memory_estimate.count_parameters(memory_estimate.QWEN3_30B_A3B).total
    one_node = memory_estimate.estimate(gpus=4, micro_batch=4, offload_optimizer=True)
    assert one_node.cpu_bytes_per_node == pytest.approx(16 * total)  # ~490 GB: all of it on the one training node
    assert one_node.fits and one_node.peak / GIB == pytest.approx(43.57, abs=0.01)  # as docs/scale_out.md quotes
    four_nodes = memory_estimate.estimate(gpus=32, offload_optimizer=True)
    assert four_nodes.cpu_bytes_per_node == pytest.approx(16 * total / 4)
    assert memory_estimate.estimate(gpus=4).cpu_bytes_per_node == 0 and not memory_estimate.estimate(gpus=4).fits
