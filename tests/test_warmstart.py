"""The warm start of the embedded tiny model: its teacher-forced batches, its training procedure (against a plain
loop written here), and its on-disk cache. Tiny settings: one layer of width 16, three steps."""

import hashlib
import json
import random

import pytest
import torch

from dhpo_trl.demo import arithmetic, warmstart
from dhpo_trl.demo.arithmetic import Problem
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.demo.warmstart import WarmStartSettings, load_or_warm_start, warm_start

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
    """The key is the first 16 hex digits of the SHA-256 of the settings as sorted JSON, each problem as the text
    taught (prompt, completion): an existing cache entry is found again by a later version as long as the settings
    and the texts are the same."""
    taught = ", ".join(
        f'["Q: {a}+{b}\\nA:", " \\\\boxed{{{a + b}}}"]' for a, b in [(12, 34), (5, 678), (90, 1), (23, 45), (7, 7)]
    )
    described = (
        '{"batch_size": 3, "check_every": 10, "hidden_size": 16, "learning_rate": 0.01, "num_heads": 2, '
        f'"num_layers": 1, "probe_size": 100, "problems": [{taught}], "seed": 4, "steps": 3, "target_accuracy": null}}'
    )
    assert settings().cache_key() == hashlib.sha256(described.encode()).hexdigest()[:16]


def test_cache_key_covers_every_setting_and_the_problems():
    base = settings().cache_key()
    assert len(base) == 16 and int(base, 16) >= 0
    assert settings().cache_key() == base  # deterministic
    fields = dict(hidden_size=32, num_layers=2, num_heads=4, steps=4, batch_size=2, learning_rate=2e-2, seed=5,
                  target_accuracy=0.5, check_every=3, probe_size=2, max_position_embeddings=1024)  # fmt: skip
    changed = [settings(**{field: value}) for field, value in fields.items()]
    changed += [settings(problems=PROBLEMS[:-1]), settings(problems=PROBLEMS[::-1])]
    keys = {s.cache_key() for s in changed}
    assert base not in keys and len(keys) == len(changed)


def test_cache_key_changes_with_the_prompt_template(monkeypatch):
    """Weights taught on another prompt are useless: a new template must not find the old cache entry."""
    base = settings().cache_key()
    monkeypatch.setattr(arithmetic, "PROMPT_TEMPLATE", "Question: {question}\nAnswer:")
    assert PROBLEMS[0].prompt == "Question: 12+34\nAnswer:"
    assert settings().cache_key() != base


def test_cache_is_written_once_reused_and_bypassed(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    model, _, from_cache = load_or_warm_start(settings(), cache_dir=cache)
    assert from_cache is False
    entry = cache / f"warmstart-{settings().cache_key()}"
    assert sorted(p.name for p in cache.iterdir()) == [entry.name]  # no partial folder left behind
    assert json.loads((entry / "config.json").read_text())["hidden_size"] == 16

    def no_training(_, log=None):
        raise AssertionError("a cached warm start was retrained")

    monkeypatch.setattr(warmstart, "warm_start", no_training)
    cached, tokenizer, from_cache = load_or_warm_start(settings(), cache_dir=cache)
    assert from_cache is True and not cached.training and cached.dtype == torch.float32
    assert (cached.config.warm_start_steps, cached.config.warm_start_probe_accuracy) == (3, None)  # saved with it
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

    def racing_warm_start(s, log=None):
        model, tokenizer = real_warm_start(s)
        model.save_pretrained(entry)  # the other process's entry lands while this one trains
        (entry / "written_first.txt").write_text("kept")
        return model, tokenizer

    monkeypatch.setattr(warmstart, "warm_start", racing_warm_start)
    _, _, from_cache = load_or_warm_start(settings(), cache_dir=tmp_path)
    assert from_cache is False
    assert (entry / "written_first.txt").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]  # no partial folder left


def _reference_loop(steps: int):
    """The plain training loop of `settings()` for `steps` steps (see the test above)."""
    tokenizer = build_char_tokenizer()
    reference = build_tiny_qwen3(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=4)
    torch.manual_seed(4)
    rng = random.Random(4)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(steps):
        reference(**warmstart._batch(tokenizer, rng.sample(PROBLEMS, 3))).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return reference


def test_target_accuracy_stops_at_the_first_check_that_reaches_it(monkeypatch):
    """Checked every `check_every` steps on the first `probe_size` problems, in eval mode; training stops after the
    first check at or above the target, with the weights of exactly that many steps."""
    checks = []
    scripted = iter([0.2, 0.49, 0.5, 0.9])

    def fake_accuracy(model, tokenizer, problems):
        checks.append((problems, model.training, tokenizer.pad_token))
        return next(scripted)

    monkeypatch.setattr(warmstart, "exact_accuracy", fake_accuracy)
    model, _ = warm_start(settings(steps=20, target_accuracy=0.5, check_every=2, probe_size=3))
    assert checks == [(PROBLEMS[:3], False, "<|pad|>")] * 3  # steps 2, 4, 6: the third check reaches 0.5
    assert not model.training
    assert (model.config.warm_start_steps, model.config.warm_start_probe_accuracy) == (6, 0.5)
    reference = dict(_reference_loop(6).named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, reference[name], rtol=0, atol=1e-7, msg=name)


def test_an_unreached_target_trains_every_step_and_no_target_never_checks(monkeypatch):
    calls = []
    monkeypatch.setattr(warmstart, "exact_accuracy", lambda *args: calls.append(1) or 0.0)
    model, _ = warm_start(settings(steps=4, target_accuracy=1.0, check_every=2))
    assert len(calls) == 2
    assert (model.config.warm_start_steps, model.config.warm_start_probe_accuracy) == (4, 0.0)
    reference = dict(_reference_loop(4).named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, reference[name], rtol=0, atol=1e-7, msg=name)
    calls.clear()
    model, _ = warm_start(settings(steps=4, check_every=1))
    assert calls == []
    assert (model.config.warm_start_steps, model.config.warm_start_probe_accuracy) == (4, None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"target_accuracy": 0.0}, "WarmStartSettings.target_accuracy=0.0 must be in (0, 1], or None."),
        ({"target_accuracy": 1.5}, "WarmStartSettings.target_accuracy=1.5 must be in (0, 1], or None."),
        ({"check_every": 0}, "WarmStartSettings.check_every=0 must be a positive integer."),
        ({"probe_size": 0}, "WarmStartSettings.probe_size=0 must be a positive integer."),
        ({"steps": 0}, "WarmStartSettings.steps=0 must be a positive integer."),
    ],
)
def test_bad_stop_settings_are_refused(overrides, message):
    with pytest.raises(ValueError) as error:
        warm_start(settings(**overrides))
    assert str(error.value) == message


def test_target_accuracy_of_exactly_one_is_allowed(monkeypatch):
    monkeypatch.setattr(warmstart, "exact_accuracy", lambda *args: 1.0)
    warm_start(settings(steps=2, target_accuracy=1.0, check_every=1))  # no error; stops at the first check


class _ScriptedModel:
    """Greedy 'generation' that appends fixed completions to the prompts, like `generate` does."""

    def __init__(self, tokenizer, completions):
        self.tokenizer, self.completions, self.kwargs = tokenizer, completions, None

    def generate(self, input_ids, attention_mask, **kwargs):
        self.kwargs = kwargs
        rows = [self.tokenizer(c, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                for c in self.completions]  # fmt: skip
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        return torch.cat([input_ids, torch.tensor([r + [pad] * (width - len(r)) for r in rows])], dim=1)


def test_exact_accuracy_counts_only_the_taught_completion():
    tokenizer = build_char_tokenizer()
    problems = [Problem(12, 34), Problem(5, 5), Problem(90, 1), Problem(23, 45)]
    # right; right value in another form; wrong sum; right with a trailing space
    model = _ScriptedModel(tokenizer, [" \\boxed{46}", " \\boxed{10.0}", " \\boxed{92}", " \\boxed{68} "])
    assert warmstart.exact_accuracy(model, tokenizer, problems) == 0.25
    assert model.kwargs["do_sample"] is False
    assert model.kwargs["max_new_tokens"] == len(" \\boxed{46}") + 1  # the longest target and its end token
    assert model.kwargs["eos_token_id"] == tokenizer.eos_token_id
    assert model.kwargs["pad_token_id"] == tokenizer.pad_token_id
