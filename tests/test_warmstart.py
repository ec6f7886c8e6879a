"""The warm start of the embedded tiny model: its teacher-forced batches, its training procedure (against a plain
loop written here), and its on-disk cache. Tiny settings: one layer of width 16, three steps."""

import hashlib
import json
import random

import pytest
import torch

from dhpo_trl import warmstart
from dhpo_trl.arithmetic import Problem
from dhpo_trl.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.warmstart import WarmStartSettings, load_or_warm_start, warm_start

PROBLEMS = [Problem(12, 34), Problem(5, 678), Problem(90, 1), Problem(23, 45), Problem(7, 7)]
TINY = dict(hidden_size=16, num_layers=1, num_heads=2, steps=3, batch_size=3, learning_rate=1e-2, seed=4)


def settings(**overrides):
    return WarmStartSettings(**{**TINY, "problems": PROBLEMS, **overrides})


def test_batch_teaches_only_the_answer_and_pads_on_the_right():
    tokenizer = build_char_tokenizer()
    short, long = Problem(1, 2), Problem(100, 200)
    batch = warmstart._batch(tokenizer, [short, long])

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = [ids(p.prompt) + ids(p.target_completion()) + [eos] for p in (short, long)]
    width = len(rows[1])
    assert len(rows[0]) < width
    assert batch["input_ids"].tolist() == [rows[0] + [pad] * (width - len(rows[0])), rows[1]]
    assert batch["attention_mask"].tolist() == [[1] * len(rows[0]) + [0] * (width - len(rows[0])), [1] * width]
    for row, problem, labels in zip(rows, (short, long), batch["labels"].tolist(), strict=True):
        taught = ids(problem.target_completion()) + [eos]
        prompt = len(ids(problem.prompt))
        assert labels == [-100] * prompt + taught + [-100] * (width - len(row))
    assert tokenizer.decode(ids(long.target_completion())) == " \\boxed{300}"


def test_training_is_adamw_on_teacher_forced_batches_with_clipped_gradients():
    """The warm start equals a plain loop: AdamW (no weight decay), gradient norm clipped at 1, batches sampled
    with random.Random(seed), model seeded with the same seed; it ends in eval mode."""
    model, tokenizer = warm_start(settings())
    assert not model.training
    reference = build_tiny_qwen3(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=4)
    torch.manual_seed(4)
    rng = random.Random(4)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    reference.train()
    for _ in range(3):
        loss = reference(**warmstart._batch(tokenizer, rng.sample(PROBLEMS, 3))).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    trained = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        torch.testing.assert_close(trained[name], param, rtol=0, atol=1e-7, msg=name)
    fresh = dict(build_tiny_qwen3(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=4).named_parameters())
    assert max((fresh[n] - p).abs().max().item() for n, p in trained.items()) > 1e-3  # it did train


def test_batch_size_above_the_problem_count_uses_every_problem_and_seed_matters():
    a, _ = warm_start(settings(batch_size=50, steps=1))
    b, _ = warm_start(settings(batch_size=50, steps=1))
    c, _ = warm_start(settings(batch_size=50, steps=1, seed=5))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(), strict=True))


def test_no_problems_is_an_error():
    with pytest.raises(ValueError) as error:
        warm_start(WarmStartSettings(**TINY))
    assert str(error.value) == "WarmStartSettings.problems is empty: pass the synthetic problems to pre-train on."


def test_cache_key_format_is_stable():
    """The key is the first 16 hex digits of the SHA-256 of the settings as sorted JSON, problems as pairs: an
    existing cache entry is found again by a later version as long as the settings are the same."""
    described = (
        '{"batch_size": 3, "hidden_size": 16, "learning_rate": 0.01, "num_heads": 2, "num_layers": 1, '
        '"problems": [[12, 34], [5, 678], [90, 1], [23, 45], [7, 7]], "seed": 4, "steps": 3}'
    )
    assert settings().cache_key() == hashlib.sha256(described.encode()).hexdigest()[:16]


def test_cache_key_covers_every_setting_and_the_problems():
    base = settings().cache_key()
    assert len(base) == 16 and int(base, 16) >= 0
    assert settings().cache_key() == base  # deterministic
    fields = dict(hidden_size=32, num_layers=2, num_heads=4, steps=4, batch_size=2, learning_rate=2e-2, seed=5)
    changed = [settings(**{field: value}) for field, value in fields.items()]
    changed += [settings(problems=PROBLEMS[:-1]), settings(problems=PROBLEMS[::-1])]
    keys = {s.cache_key() for s in changed}
    assert base not in keys and len(keys) == len(changed)


def test_cache_is_written_once_reused_and_bypassed(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    model, _, from_cache = load_or_warm_start(settings(), cache_dir=cache)
    assert from_cache is False
    entry = cache / f"warmstart-{settings().cache_key()}"
    assert sorted(p.name for p in cache.iterdir()) == [entry.name]  # no partial folder left behind
    assert json.loads((entry / "config.json").read_text())["hidden_size"] == 16

    def no_training(_):
        raise AssertionError("a cached warm start was retrained")

    monkeypatch.setattr(warmstart, "warm_start", no_training)
    cached, tokenizer, from_cache = load_or_warm_start(settings(), cache_dir=cache)
    assert from_cache is True and not cached.training and cached.dtype == torch.float32
    assert tokenizer.pad_token == "<|pad|>"
    for (name, a), b in zip(model.named_parameters(), cached.parameters(), strict=True):
        assert torch.equal(a, b), name
    monkeypatch.undo()

    # use_cache=False trains and writes nothing; the default cache folder is DEFAULT_CACHE_DIR
    monkeypatch.setattr(warmstart, "DEFAULT_CACHE_DIR", tmp_path / "default")
    _, _, from_cache = load_or_warm_start(settings(), use_cache=False)
    assert from_cache is False and not (tmp_path / "default").exists()
    load_or_warm_start(settings(steps=1))
    assert [p.name for p in (tmp_path / "default").iterdir()] == [f"warmstart-{settings(steps=1).cache_key()}"]


def test_an_incomplete_cache_entry_is_replaced(tmp_path):
    entry = tmp_path / f"warmstart-{settings().cache_key()}"
    entry.mkdir(parents=True)
    (entry / "stale.txt").write_text("an interrupted copy")
    _, _, from_cache = load_or_warm_start(settings(), cache_dir=tmp_path)
    assert from_cache is False
    assert (entry / "config.json").is_file() and not (entry / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]


def test_an_entry_written_meanwhile_by_another_process_is_kept(tmp_path, monkeypatch):
    """Two runs warm-starting at once: the one that finishes second keeps the first one's entry and removes its
    own partial copy."""
    entry = tmp_path / f"warmstart-{settings().cache_key()}"
    real_warm_start = warm_start

    def racing_warm_start(s):
        model, tokenizer = real_warm_start(s)
        model.save_pretrained(entry)  # the other process's entry lands while this one trains
        (entry / "written_first.txt").write_text("kept")
        return model, tokenizer

    monkeypatch.setattr(warmstart, "warm_start", racing_warm_start)
    _, _, from_cache = load_or_warm_start(settings(), cache_dir=tmp_path)
    assert from_cache is False
    assert (entry / "written_first.txt").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]  # no partial folder left
