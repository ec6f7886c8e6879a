"""Warm-start of the embedded tiny model: a short, deterministic supervised pre-training on boxed answers.

RL needs a policy that is sometimes right: a random tiny model never writes a `\\boxed{}` answer. A few hundred
teacher-forced steps on the synthetic task give a policy that has learnt the format and part of the arithmetic, and
is deliberately stopped early so that RL has accuracy left to gain.

Where to stop is set by accuracy, not by a step count (`target_accuracy`). The tiny model learns carrying in a
sudden jump whose timing is fragile: with the former, longer prompt, 350 steps left it right on 38.5% of the
held-out problems on one machine and 16% on another (float rounding differs between CPUs, and the jump amplifies
it); with the current prompt, 24% with seed 0 and 5.5% with seed 1.
Stopping at the first check where it writes the taught answer for a set share of training problems starts RL
from a comparable policy everywhere (at a 50% target: 61.5% held-out with seed 0, 46% with seed 1). The result is cached on disk, keyed
by a hash of every setting that shapes it, so later runs (and the tests) load it in a second instead of retraining.
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
    steps: int = 350  # the most steps; fewer when target_accuracy is reached first
    batch_size: int = 64
    learning_rate: float = 3e-3
    seed: int = 0
    # Stop at the first check (every `check_every` steps) where greedy decoding writes exactly the taught completion
    # for at least this share of the first `probe_size` problems (training problems: the held-out ones stay unseen).
    # None: train all `steps`.
    target_accuracy: float | None = None
    check_every: int = 10
    probe_size: int = 100
    max_position_embeddings: int = 512  # prompt + completion tokens the model is built for
    # Each batch a run of problems of neighbouring completion lengths (a random window of the problems sorted by
    # length), so that long-tailed lengths do not pad every batch to its longest member.
    group_by_length: bool = False
    problems: list = field(default_factory=list, compare=False, repr=False)  # the problems taught, in the key

    def cache_key(self) -> str:
        described = {k: v for k, v in asdict(self).items() if k != "problems"}
        for name, default in (("max_position_embeddings", 512), ("group_by_length", False)):
            if described[name] == default:  # left out at its default: cached addition warm starts keep their key
                del described[name]
        # What is taught, as text: a changed prompt template must not load weights trained on the old one.
        described["problems"] = [(p.prompt, p.target_completion()) for p in self.problems]
        # Tasks with free choices teach other completions than the targets: a changed set of choices changes the key.
        sampled = [p.sample_completion(random.Random(0)) for p in self.problems[:20]]
        if sampled != [p.target_completion() for p in self.problems[:20]]:
            described["sampled_completions"] = sampled
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def _batch(tokenizer, problems: list[Problem], rng: random.Random | None = None) -> dict[str, torch.Tensor]:
    """Right-padded prompt + taught completion (its free choices drawn from `rng`) + EOS; labels only on the answer
    (the prompt is not taught)."""
    rng = rng or random.Random(0)
    rows, labels = [], []
    for problem in problems:
        prompt_ids = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(problem.sample_completion(rng), add_special_tokens=False)["input_ids"]
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


def greedy_completions(model, tokenizer, prompts: list[str], *, max_new_tokens: int) -> list[str]:
    """The greedy completion of each prompt, decoded without special tokens (one left-padded batch)."""
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        generated = model.generate(
            **encoded, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    return tokenizer.batch_decode(generated[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)


def exact_accuracy(model, tokenizer, problems: list[Problem]) -> float:
    """Share of `problems` whose greedy completion is exactly a taught one (`Problem.accepts`: the target, or on a
    task with free choices any of its taught variants)."""
    texts = greedy_completions(model, tokenizer, [p.prompt for p in problems],
                               max_new_tokens=max(len(p.target_completion()) for p in problems) + 1)  # fmt: skip
    return sum(p.accepts(text) for p, text in zip(problems, texts, strict=True)) / len(problems)


def _sample(problems: list, batch_size: int, rng: random.Random, group_by_length: bool) -> list:
    if not group_by_length:
        return rng.sample(problems, min(batch_size, len(problems)))
    start = rng.randrange(max(1, len(problems) - batch_size + 1))
    return problems[start : start + batch_size]


def warm_start(settings: WarmStartSettings, log=None):
    """Build the tiny Qwen3 and teacher-force it on `settings.problems` for `settings.steps` steps, or until it
    reaches `settings.target_accuracy`. The model's config records the steps taken (`warm_start_steps`) and the
    last probe accuracy (`warm_start_probe_accuracy`, None without a target). `log(text)`, if given, hears every
    probe's accuracy."""
    if not settings.problems:
        raise ValueError("WarmStartSettings.problems is empty: pass the synthetic problems to pre-train on.")
    if settings.target_accuracy is not None and not 0 < settings.target_accuracy <= 1:
        raise ValueError(f"WarmStartSettings.target_accuracy={settings.target_accuracy} must be in (0, 1], or None.")
    for name in ("steps", "check_every", "probe_size"):
        if getattr(settings, name) < 1:
            raise ValueError(f"WarmStartSettings.{name}={getattr(settings, name)} must be a positive integer.")
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(
        tokenizer, hidden_size=settings.hidden_size, num_layers=settings.num_layers, num_heads=settings.num_heads,
        seed=settings.seed, max_position_embeddings=settings.max_position_embeddings,
    )  # fmt: skip
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    probe = settings.problems[: settings.probe_size]
    pool = settings.problems
    if settings.group_by_length:
        pool = sorted(pool, key=lambda p: len(p.prompt) + len(p.target_completion()))
    probe_accuracy = None
    model.train()
    for step in range(1, settings.steps + 1):
        batch = _batch(tokenizer, _sample(pool, settings.batch_size, rng, settings.group_by_length), rng)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if settings.target_accuracy is not None and step % settings.check_every == 0:
            model.eval()
            probe_accuracy = exact_accuracy(model, tokenizer, probe)
            if log is not None:
                log(f"[warm start] step {step}: whole completion right on {probe_accuracy:.0%} of the probe")
            if probe_accuracy >= settings.target_accuracy:
                break
            model.train()
    model.eval()
    # Saved with the weights (config.json), so that a cached warm start still says where it stopped.
    model.config.warm_start_steps, model.config.warm_start_probe_accuracy = step, probe_accuracy
    return model, tokenizer


def load_or_warm_start(settings: WarmStartSettings, *, cache_dir: Path | str | None = None, use_cache: bool = True,
                       log=None):  # fmt: skip
    """`(model, tokenizer, from_cache)`: the cached warm start for `settings`, trained and saved if absent."""
    from transformers import AutoModelForCausalLM

    key = settings.cache_key()
    path = Path(cache_dir or DEFAULT_CACHE_DIR) / f"warmstart-{key}"
    if use_cache and (path / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        model.config.warm_start_key = key  # runs record which warm start they started from
        return model, build_char_tokenizer(), True
    model, tokenizer = warm_start(settings, log)
    model.config.warm_start_key = key
    if use_cache:  # write then rename, so that an interrupted run never leaves a half-written cache entry
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        model.save_pretrained(partial)
        if not (path / "config.json").is_file():
            shutil.rmtree(path, ignore_errors=True)
            partial.rename(path)
        shutil.rmtree(partial, ignore_errors=True)
    return model, tokenizer, False
