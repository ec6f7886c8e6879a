"""Shared fixtures: everything offline, tiny models built locally, CPU only."""

import os

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

from dhpo_trl.tiny import build_char_tokenizer, build_tiny_qwen3  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    return build_tiny_qwen3(tokenizer)


@pytest.fixture
def tiny_moe_model(tokenizer):
    return build_tiny_qwen3(tokenizer, moe=True)
