"""Shared fixtures: everything offline, tiny models built locally, CPU only."""

import os
import sys
from types import ModuleType

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models run 15-25x faster on one thread than on two on a shared 2-core machine (intra-op overhead).
torch.set_num_threads(1)

from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3  # noqa: E402


# The test tiers, by file (`pytest -m pure` runs the pure functions alone, in well under a minute). A test of a
# "trainer" file whose name says it launches processes is in the "processes" tier.
PURE = {
    "test_aggregation", "test_entropy_control", "test_batching", "test_plan_optimum", "test_update_path",
    "test_trl_mirror", "test_metric_functions", "test_staleness", "test_boundaries", "test_user_errors",
    "test_memory_estimate", "test_golds", "test_data", "test_vllm_utils", "test_evaluation_metrics", "test_tiny",
    "test_moe_edges", "test_row_contracts", "test_plotting", "test_study_pages", "test_recipes", "test_collectives",
}  # fmt: skip
PROCESSES = {
    "test_distributed", "test_metrics_distributed", "test_evaluation_callback_distributed", "test_resume_processes",
    "test_resume_zero3", "test_processes", "test_scale_out_scripts", "test_notebook", "test_accelerate_configs",
    "test_printed_commands", "test_cli", "test_zero3_forwards",
}  # fmt: skip


def tier(module: str, test: str) -> str:
    if module in PROCESSES or "two_processes" in test or "distributed" in test:
        return "processes"
    return "pure" if module in PURE else "trainer"


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, tier(item.path.stem, item.name)))


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    return build_tiny_qwen3(tokenizer)


@pytest.fixture
def tiny_moe_model(tokenizer):
    return build_tiny_qwen3(tokenizer, moe=True)


@pytest.fixture
def leaf_spy(monkeypatch):
    """Replace `deepspeed.utils.set_z3_leaf_modules` (whether or not deepspeed is installed) and record calls."""
    calls = []
    fake_utils = ModuleType("deepspeed.utils")
    fake_utils.set_z3_leaf_modules = lambda model, classes: calls.append((model, list(classes)))
    fake_deepspeed = ModuleType("deepspeed")
    fake_deepspeed.utils = fake_utils
    monkeypatch.setitem(sys.modules, "deepspeed", fake_deepspeed)
    monkeypatch.setitem(sys.modules, "deepspeed.utils", fake_utils)
    return calls
