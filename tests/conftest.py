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
