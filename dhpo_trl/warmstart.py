"""Warm-start of the embedded tiny model: a short, deterministic supervised pre-training on boxed answers.

RL needs a policy that is sometimes right: a random tiny model never writes a `\\boxed{}` answer. A few hundred
teacher-forced steps on the synthetic task give a policy that has learnt the format and part of the arithmetic, and
is deliberately stopped early so that RL has accuracy left to gain. The result is cached on disk, keyed by a hash of
every setting that shapes it, so later runs (and the tests) load it in a second instead of retraining.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .arithmetic import Problem
from .tiny import build_char_tokenizer, build_tiny_qwen3

DEFAULT_CACHE_DIR = Path(os.environ.get("DHPO_TRL_CACHE", Path.home() / ".cache" / "dhpo_trl"))


@dataclass(frozen=True)
class WarmStartSettings:
    """Everything that determines the warm-started weights (the cache key is a hash of these)."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    steps: int = 350
    batch_size: int = 64
    learning_rate: float = 3e-3
    seed: int = 0
    problems: list = field(default_factory=list, compare=False, repr=False)  # the problems taught, in the key

    def cache_key(self) -> str:
        described = {k: v for k, v in asdict(self).items() if k != "problems"}
        described["problems"] = [(p.left, p.right) for p in self.problems]
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def _batch(tokenizer, problems: list[Problem]) -> dict[str, torch.Tensor]:
    """Right-padded prompt + target completion + EOS; labels only on the answer (the prompt is not taught)."""
    rows, labels = [], []
    for problem in problems:
        prompt_ids = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(problem.target_completion(), add_special_tokens=False)["input_ids"]
        ids = prompt_ids + answer_ids + [tokenizer.eos_token_id]
        rows.append(ids)
        labels.append([-100] * len(prompt_ids) + answer_ids + [tokenizer.eos_token_id])
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([r + [-100] * (width - len(r)) for r in labels]),
    }


def warm_start(settings: WarmStartSettings):
    """Build the tiny Qwen3 and teacher-force it on `settings.problems` for `settings.steps` steps."""
    if not settings.problems:
        raise ValueError("WarmStartSettings.problems is empty: pass the synthetic problems to pre-train on.")
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(
        tokenizer, hidden_size=settings.hidden_size, num_layers=settings.num_layers, num_heads=settings.num_heads,
        seed=settings.seed,
    )  # fmt: skip
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    model.train()
    for _ in range(settings.steps):
        batch = _batch(tokenizer, rng.sample(settings.problems, min(settings.batch_size, len(settings.problems))))
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return model, tokenizer


def load_or_warm_start(settings: WarmStartSettings, *, cache_dir: Path | str | None = None, use_cache: bool = True):
    """`(model, tokenizer, from_cache)`: the cached warm start for `settings`, trained and saved if absent."""
    from transformers import AutoModelForCausalLM

    path = Path(cache_dir or DEFAULT_CACHE_DIR) / f"warmstart-{settings.cache_key()}"
    if use_cache and (path / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        return model, build_char_tokenizer(), True
    model, tokenizer = warm_start(settings)
    if use_cache:  # write then rename, so that an interrupted run never leaves a half-written cache entry
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        model.save_pretrained(partial)
        if not (path / "config.json").is_file():
            shutil.rmtree(path, ignore_errors=True)
            partial.rename(path)
        shutil.rmtree(partial, ignore_errors=True)
    return model, tokenizer, False
