"""Exact resume and the graceful stop under DeepSpeed ZeRO-3: 2 forked ranks with torchrun's environment on CPU
(DeepSpeed's CPU accelerator, gloo), DHPO-E with real generation (TRL's model.generate), one launch of
`tests/dist_scripts/resume_distributed.py --zero3` (its docstring lists the runs, a MoE policy's included). A file
of its own so that the suite's per-file workers run it beside the DDP twin in test_resume_processes.py.

Every process is started in its own session and its whole group is killed if the test fails or times out.
"""

import json
import os
from pathlib import Path

import processes
import pytest
from safetensors.torch import load_file

from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.training import resume
from zero3_config import assert_none_resident

TESTS = Path(__file__).parent
REPO = TESTS.parent
# No ACCELERATE_USE_CPU: with it accelerate leaves DeepSpeed out (DHPOConfig refuses the pair, see test_config.py).
# No PYTHONPATH: the ranks inherit the fork server's imports and path (the package is installed from this checkout),
# and a variable the imports read would start a server of its own (`fork_server.IMPORT_PREFIXES`).
ENV = {**{k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}, "CUDA_VISIBLE_DEVICES": "",
       "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}  # fmt: skip


def _max_gap(a: dict, b: dict) -> float:
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


@pytest.fixture(scope="module")
def zero3_ranks(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("resume_zero3")
    result = processes.forked_ranks(TESTS / "dist_scripts" / "resume_distributed.py", out, "--zero3", timeout=450,
                                    accelerate_cpu=False, env=ENV, cwd=REPO)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    runs = ("z3_full", "z3_resumed", "z3_stopped", "z3_after", "z3_sync_full", "z3_sync_resumed", "z3_moe_full",
            "z3_moe_resumed")
    dumps = {(run, rank): json.loads((out / f"{run}_rank{rank}.json").read_text()) for run in runs for rank in (0, 1)}
    return {**dumps, "out": out}


def _relative_gap(a: dict, b: dict) -> float:
    """max |a - b| over max |b|, over all parameters (issue 25's target: 1e-5)."""
    return _max_gap(a, b) / max(abs(x) for name in b for x in b[name])


def test_zero3_resumes_the_synced_reference_model(zero3_ranks):
    """sync_ref_model under ZeRO-3: the reference model, partitioned like the policy, is saved whole (gathered) and
    restored into its partitions; the resumed run's reference model, parameters, KL and data are the uninterrupted
    run's on both ranks."""
    start = {name: p.detach().flatten().tolist()
             for name, p in build_tiny_qwen3(build_char_tokenizer(), hidden_size=32, seed=0).named_parameters()}  # fmt: skip
    for rank in (0, 1):
        full, resumed = zero3_ranks["z3_sync_full", rank], zero3_ranks["z3_sync_resumed", rank]
        assert _max_gap(full["ref_params"], start) > 1e-3  # the reference model moved
        assert _relative_gap(resumed["ref_params"], full["ref_params"]) <= 1e-6
        assert _relative_gap(resumed["params"], full["params"]) <= 1e-6
        assert all(resumed["seen"][step] == full["seen"][step] for step in resumed["seen"])
        assert all(resumed["logs"][step] == pytest.approx(full["logs"][step], rel=1e-6, abs=1e-9)
                   for step in resumed["seen"])  # fmt: skip
        assert "kl" in full["logs"]["2"]
    saved = load_file(zero3_ranks["out"] / "z3_sync_full" / "checkpoint-1" / resume.REFERENCE_MODEL)
    assert {name: tensor.numel() for name, tensor in saved.items()} == {name: len(v) for name, v in start.items()}


@pytest.mark.parametrize("run", ["z3_resumed", "z3_after"])
def test_zero3_resumes_mid_generation_batch_to_the_uninterrupted_run(zero3_ranks, run):
    """ZeRO-3 (CPU, 2 ranks, real generation), k = 2 optimizer steps per generation batch: from the mid-batch
    checkpoint-1, whether saved on schedule or by the SIGTERM stop, both ranks end with the uninterrupted run's
    full (gathered) parameters, its logged metrics and its data at every step, and so do the saved model files."""
    start = {name: p.detach().flatten().tolist()
             for name, p in build_tiny_qwen3(build_char_tokenizer(), hidden_size=32, seed=0).named_parameters()}  # fmt: skip
    for rank in (0, 1):
        full, resumed = zero3_ranks["z3_full", rank], zero3_ranks[run, rank]
        assert full["world_size"] == resumed["world_size"] == 2 and resumed["global_step"] == 4
        assert_none_resident(full["zero3"], resumed["zero3"])  # an unagreed forward blocks the launch
        assert _max_gap(full["params"], start) > 1e-2  # training moved the weights
        assert _relative_gap(resumed["params"], full["params"]) <= 1e-5
        assert sorted(resumed["seen"], key=int) == ["2", "3", "4"]  # step 2 ends the batch generated at step 1
        assert all(resumed["seen"][step] == full["seen"][step] for step in resumed["seen"])
        assert all(resumed["logs"][step] == pytest.approx(full["logs"][step], rel=1e-5, abs=1e-7)
                   for step in resumed["seen"])  # fmt: skip
    assert zero3_ranks["z3_full", 0]["params"] == zero3_ranks["z3_full", 1]["params"]  # the gathered whole
    assert zero3_ranks["z3_full", 0]["seen"]["2"] != zero3_ranks["z3_full", 1]["seen"]["2"]  # each rank its own rows
    folder = {"z3_resumed": "z3_resumed", "z3_after": "z3_stopped"}[run]
    full_file = load_file(zero3_ranks["out"] / "z3_full" / "checkpoint-4" / "model.safetensors")
    resumed_file = load_file(zero3_ranks["out"] / folder / "checkpoint-4" / "model.safetensors")
    assert set(full_file) == set(resumed_file) and set(full_file) <= set(full["params"])  # (tied head: saved once)
    scale = max(tensor.abs().max().item() for tensor in full_file.values())
    for name, tensor in full_file.items():  # the saved files hold the whole tensors, equal to the gathered ones
        assert (resumed_file[name] - tensor).abs().max().item() <= 1e-5 * scale
        assert tensor.flatten().tolist() == pytest.approx(full["params"][name], abs=1e-7)


def test_zero3_sigterm_to_one_rank_stops_both_with_a_checkpoint(zero3_ranks):
    """SIGTERM to rank 0 at the end of step 1 (mid generation batch): both ranks stop after step 1, the checkpoint
    is complete, the handlers are restored; resuming it is the test above (`z3_after`)."""
    stop0, stop1 = zero3_ranks["z3_stopped", 0], zero3_ranks["z3_stopped", 1]
    assert stop0["global_step"] == stop1["global_step"] == 1
    assert stop0["graceful_stop"]["signal"] == "SIGTERM" and stop1["graceful_stop"]["step"] == 1
    assert stop0["graceful_stop"]["checkpoint"].endswith("checkpoint-1")
    assert stop0["checkpoints"] == ["checkpoint-1"]  # save_steps=10: the stop wrote it
    assert resume.incomplete_reason(stop0["graceful_stop"]["checkpoint"]) is None
    assert all(zero3_ranks[run, rank]["handlers_restored"] for run in ("z3_full", "z3_stopped") for rank in (0, 1))


def test_zero3_resumes_a_moe_policy_mid_generation_batch_to_the_uninterrupted_run(zero3_ranks):
    """The tiny Qwen3-MoE under ZeRO-3 (2 ranks), resumed from checkpoint-1 (mid generation batch): DeepSpeed's own
    states hold the fused experts, so both ranks end with the uninterrupted run's gathered parameters (the experts
    moved meanwhile), its logged metrics and its data."""
    model = build_tiny_qwen3(build_char_tokenizer(), hidden_size=32, seed=0, moe=True)
    start = {name: p.detach().flatten().tolist() for name, p in model.named_parameters()}
    experts = [name for name in start if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts
    for rank in (0, 1):
        full, resumed = zero3_ranks["z3_moe_full", rank], zero3_ranks["z3_moe_resumed", rank]
        assert resumed["global_step"] == 4 and sorted(resumed["seen"], key=int) == ["2", "3", "4"]
        assert _max_gap({name: full["params"][name] for name in experts}, start) > 1e-3  # the experts trained
        assert _relative_gap(resumed["params"], full["params"]) <= 1e-6
        assert all(resumed["seen"][step] == full["seen"][step] for step in resumed["seen"])
        assert all(resumed["logs"][step] == pytest.approx(full["logs"][step], rel=1e-6, abs=1e-9)
                   for step in resumed["seen"])  # fmt: skip
