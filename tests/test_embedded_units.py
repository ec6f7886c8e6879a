"""The embedded CPU default's wiring, piece by piece, in well under a second each.

`test_embedded.py` runs the whole job on a tiny task (seconds); here each step is checked against hand-written
expectations with the slow parts (warm start, generation, training) replaced by fakes that record what they are
given: the config the run builds, the printed lines, the summary's every field, the callbacks' logs, the command
line's options.
"""

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerState
from transformers.trainer_callback import PrinterCallback, ProgressCallback

import dhpo_trl
from dhpo_trl.demo import embedded
from dhpo_trl.demo.arithmetic import make_splits
from dhpo_trl.demo.embedded import (
    CompactProgressCallback,
    EmbeddedSettings,
    HeldoutAccuracyCallback,
    greedy_accuracy,
    memoized_reward,
)


# ------------------------------------------------------------------ settings
def test_micro_batch_size_splits_the_generation_batch_into_k_times_ga_micro_batches():
    size = EmbeddedSettings().per_device_train_batch_size()
    assert size == 32 * 8 // 2 and isinstance(size, int)  # a count: TrainingArguments takes no 128.0
    assert EmbeddedSettings(prompts_per_generation=6, num_generations=4, steps_per_generation=2,
                            gradient_accumulation_steps=3).per_device_train_batch_size() == 4  # fmt: skip
    with pytest.raises(ValueError) as error:
        EmbeddedSettings(prompts_per_generation=5, num_generations=2, steps_per_generation=2,
                         gradient_accumulation_steps=2).per_device_train_batch_size()  # fmt: skip
    assert str(error.value) == (
        "EmbeddedSettings: prompts_per_generation x num_generations = 10 completions do not split into "
        "steps_per_generation x gradient_accumulation_steps = 4 equal micro-batches: make the product divide the "
        "generation batch."
    )


# ------------------------------------------------------------------ reward memo
def test_memoized_reward_scores_each_distinct_pair_once_in_order():
    calls = []

    def exact(completions, answer):
        calls.append((list(completions), list(answer)))
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    memo = memoized_reward(exact)
    assert memo.__name__ == "exact"  # TRL logs rewards/<name>/mean
    assert memo([" 3", "4", " 3", "5"], ["3", "3", "3", "5"], prompts=["ignored"] * 4) == [1.0, 0.0, 1.0, 1.0]
    assert calls == [([" 3", "4", "5"], ["3", "3", "5"])]  # the repeated pair is scored once
    assert memo(["4", "6", " 3"], ["3", "6", "3"]) == [0.0, 1.0, 1.0]
    assert calls[1:] == [(["6"], ["6"])]  # only the pair not seen before
    assert memo(["4"], ["4"]) == [1.0]  # the same completion with another answer is another pair
    memo(["5"], ["5"])
    assert len(calls) == 3
    with pytest.raises(ValueError):  # completions and answers of different lengths are a bug, not a truncation
        memo(["1", "2"], ["1"])


# ------------------------------------------------------------------ greedy accuracy
class FakeModel:
    def __init__(self, training):
        self.training = training
        self.modes = []

    def eval(self):
        self.modes.append("eval")
        self.training = False

    def train(self, mode=True):
        self.modes.append(f"train({mode})")
        self.training = mode


def _greedy_fake(monkeypatch, texts_by_prompt):
    calls = []

    def completions(model, tokenizer, prompts, *, max_new_tokens):
        calls.append((model.training, tokenizer, list(prompts), max_new_tokens))
        return [texts_by_prompt[p] for p in prompts]

    monkeypatch.setattr(embedded, "greedy_completions", completions)
    return calls


def test_greedy_accuracy_scores_every_problem_in_chunks_and_restores_the_mode(monkeypatch):
    problems = make_splits(5, 1, digits=(2, 2), seed=0)[0]
    right = {p.prompt: f" \\boxed{{{p.answer}}}" for p in problems}
    texts = {**right, problems[1].prompt: " \\boxed{0}", problems[4].prompt: " 12"}  # 3 of 5 right
    calls = _greedy_fake(monkeypatch, texts)
    scored = []

    def reward(completions, answers):
        scored.append(list(answers))
        return [float(c == f" \\boxed{{{a}}}") for c, a in zip(completions, answers)]

    model = FakeModel(training=True)
    assert greedy_accuracy(model, "tok", problems, max_new_tokens=7, batch_size=2, reward=reward) == 3 / 5
    assert [prompts for _, _, prompts, _ in calls] == [[p.prompt for p in problems[i : i + 2]] for i in (0, 2, 4)]
    assert {(training, tokenizer, tokens) for training, tokenizer, _, tokens in calls} == {(False, "tok", 7)}
    assert scored == [[p.answer for p in problems[i : i + 2]] for i in (0, 2, 4)]
    assert model.modes == ["eval", "train(True)"] and model.training is True
    evaluating = FakeModel(training=False)
    assert greedy_accuracy(evaluating, "tok", problems[:1], max_new_tokens=7, reward=reward) == 1.0
    assert evaluating.training is False
    assert len(calls) == 4  # the default chunk of 200 takes the one problem at once
    many = make_splits(201, 1, digits=(2, 3), seed=0)[0]
    _greedy_fake(monkeypatch, {p.prompt: " 0" for p in many})
    chunks = []
    greedy_accuracy(evaluating, "tok", many, max_new_tokens=7, reward=lambda c, a: chunks.append(len(c)) or [0.0] * len(c))
    assert chunks == [200, 1]  # the default chunk: the 200 held-out problems in one generate call


# ------------------------------------------------------------------ callbacks
def test_heldout_callback_logs_the_initial_value_then_every_k_steps_and_the_last(monkeypatch, capsys):
    measured = iter([0.5, 0.75, 0.625])
    seen = []

    def accuracy(model, tokenizer, problems, *, max_new_tokens, reward):
        seen.append((model, tokenizer, problems, max_new_tokens, reward))
        return next(measured)

    clock = iter([10.0, 12.5, 20.0, 20.25, 30.0, 31.0])
    monkeypatch.setattr(embedded, "greedy_accuracy", accuracy)
    monkeypatch.setattr(embedded.time, "perf_counter", lambda: next(clock))
    callback = HeldoutAccuracyCallback("tok", ["p"], every=3, max_new_tokens=9, initial=0.25, reward="r")
    state = TrainerState(max_steps=7)
    state.is_world_process_zero = True
    callback.on_train_begin(None, state, None)
    for step in range(1, 8):
        state.global_step = step
        state.is_world_process_zero = step != 6  # a process other than the first measures, but prints nothing
        callback.on_step_end(None, state, None, model="m")
    assert state.log_history == [
        {"eval/heldout_accuracy": 0.25, "step": 0},
        {"eval/heldout_accuracy": 0.5, "step": 3},
        {"eval/heldout_accuracy": 0.75, "step": 6},
        {"eval/heldout_accuracy": 0.625, "step": 7},  # the last step, off the grid
    ]
    assert seen == [("m", "tok", ["p"], 9, "r")] * 3
    assert callback.seconds == 2.5 + 0.25 + 1.0
    assert capsys.readouterr().out == "\n[step 3] held-out accuracy 50.0%\n\n[step 7] held-out accuracy 62.5%\n"


def test_progress_bar_postfix_keeps_the_last_reward_and_entropy(monkeypatch):
    postfixes = []
    bar = SimpleNamespace(set_postfix=lambda shown, refresh: postfixes.append((dict(shown), refresh)))
    callback = CompactProgressCallback()
    callback.on_log(None, None, None, logs={"loss": 1.0})  # no bar yet, nothing to show
    callback.training_bar = bar
    callback.on_log(None, None, None, logs={"loss": 1.0, "learning_rate": 2e-4})
    assert postfixes == []  # nothing to show yet
    callback.on_log(None, None, None, logs={"reward": 0.25, "entropy": 1.23456, "loss": 0.5})
    callback.on_log(None, None, None, logs={"entropy": 0.5, "reward": 7})  # an int reward is not a logged mean
    callback.on_log(None, None, None, logs=None)
    assert postfixes == [
        ({"reward": "0.250", "entropy": "1.235"}, False),
        ({"reward": "0.250", "entropy": "0.500"}, False),
        ({"reward": "0.250", "entropy": "0.500"}, False),
    ]
    assert CompactProgressCallback().shown is None  # each callback keeps its own values


def test_series_takes_the_key_from_entries_that_have_a_step():
    history = [{"reward": 0.5, "step": 1}, {"loss": 1.0, "step": 1}, {"reward": 0.75}, {"reward": 1.0, "step": 3}]
    assert embedded._series(history, "reward") == [[1, 0.5], [3, 1.0]]
    assert embedded._series(history, "entropy") == []


# ------------------------------------------------------------------ the run, with fakes
class FakeTrainer:
    """Records what `_run` builds, then "trains" by writing a fixed log history, as TRL's callbacks would."""

    built = []

    def __init__(self, model, reward_funcs, args, train_dataset, processing_class, callbacks):
        self.model, self.reward_funcs, self.args = model, reward_funcs, args
        self.train_dataset, self.processing_class = train_dataset, processing_class
        self.callbacks = [*callbacks, PrinterCallback, ProgressCallback]
        self.state = TrainerState()
        self.graceful_stop = None  # DHPOTrainer.train() sets it: None for a run that reached max_steps
        FakeTrainer.built.append(self)

    def remove_callback(self, callback):
        self.callbacks.remove(callback)

    def add_callback(self, callback):
        self.callbacks.append(callback)

    def train(self):
        self.state.log_history = [
            {"eval/heldout_accuracy": 0.25, "step": 0},
            {"reward": 0.5, "entropy": 1.5, "step": 1},
            {"eval/heldout_accuracy": 0.5, "step": 1},
            {"reward": 0.75, "entropy": 1.25, "step": 2},
            {"eval/heldout_accuracy": 0.375, "step": 2},
            {"train_runtime": 1.0, "step": 2},
        ]
        self.state.global_step = 2

    def save_model(self, path):
        Path(path).mkdir(parents=True)
        (Path(path) / "model.safetensors").write_bytes(b"weights")

    def create_model_card(self, model_name=None):
        (Path(self.args.output_dir) / "README.md").write_text(f"card of {model_name}")


@pytest.fixture
def fake_run(monkeypatch):
    """`_run` with a fake warm start, evaluation, trainer, plot and clock; returns what they recorded."""
    record = SimpleNamespace(plots=[], configs=[], tasks=[], evaluations=[], from_cache=True)
    model = torch.nn.Linear(3, 2)  # 8 parameters
    model.config = SimpleNamespace(warm_start_steps=390, warm_start_probe_accuracy=0.64)
    train, heldout = make_splits(12, 4, digits=(2, 2), seed=0)

    def load_task(settings, num_heldout, *, cache_dir, use_cache):
        record.tasks.append((settings, num_heldout, cache_dir, use_cache))
        return train, heldout, (model, "tok", record.from_cache)

    def config_for(name, **fields):
        record.configs.append((name, fields))
        return real_config_for(name, **fields)

    real_config_for = embedded.config_for
    FakeTrainer.built = []
    # Each phase gets its own length, with more decimals than the summary keeps: warm start 1.234567 s, accuracy
    # before RL 2.265433 s, RL 4.391234 s, saving 7.113087 s, wall 15.006789 s.
    clock = iter([100.0, 101.234567, 103.5, 103.5, 107.891234, 107.891234, 115.004321, 115.006789])
    monkeypatch.setattr(embedded.time, "perf_counter", lambda: next(clock, 115.0))

    def accuracy(model, tokenizer, problems, *, max_new_tokens, reward):
        record.evaluations.append((model, tokenizer, problems, max_new_tokens, reward))
        return 0.25

    monkeypatch.setattr(embedded, "load_task", load_task)
    monkeypatch.setattr(embedded, "config_for", config_for)
    monkeypatch.setattr(embedded, "greedy_accuracy", accuracy)
    monkeypatch.setattr(embedded, "_plot", lambda history, path, title: record.plots.append((history, path, title)))
    monkeypatch.setattr(dhpo_trl, "DHPOTrainer", FakeTrainer)
    record.model, record.train, record.heldout = model, train, heldout
    return record


def test_run_builds_the_off_policy_config_and_writes_every_output(fake_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(embedded, "source_commit", lambda: "abc1234567")
    settings = EmbeddedSettings(num_train=12, num_heldout=4, prompts_per_generation=4, num_generations=4,
                                steps_per_generation=2, gradient_accumulation_steps=2, max_completion_length=9,
                                learning_rate=3e-4, max_steps=50, eval_every=7)  # fmt: skip
    out = tmp_path / "run"
    summary = embedded.run_embedded("GSPO", seed=5, max_steps=2, output_dir=out, cache_dir="c", use_cache=False,
                                    settings=settings, disable_tqdm=True, config_overrides={"delta": 3.0})  # fmt: skip
    (name, fields), = fake_run.configs
    assert name == "GSPO"
    assert fields == dict(
        output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,  # 16 / (2 x 2)
        steps_per_generation=4,  # k = 2 optimizer steps of 2 micro-batches each
        num_generations=4, max_completion_length=9, temperature=1.0, top_p=1.0, learning_rate=3e-4,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, beta=0.0, max_steps=2, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=5, data_seed=5, disable_tqdm=True,
        delta=3.0,
    )  # fmt: skip
    assert fake_run.tasks == [(settings, 4, "c", False)]
    trainer, = FakeTrainer.built
    assert trainer.args.algorithm == "gspo" and trainer.args.delta == 3.0 and trainer.model is fake_run.model
    assert trainer.processing_class == "tok"
    assert trainer.train_dataset["answer"] == [p.answer for p in fake_run.train]
    assert trainer.reward_funcs.__name__ == "math_verify_reward"  # memoized, under the reward's own name
    heldout, = [c for c in trainer.callbacks if isinstance(c, HeldoutAccuracyCallback)]
    assert (heldout.problems, heldout.every, heldout.max_new_tokens, heldout.initial) == (fake_run.heldout, 7, 9, 0.25)
    assert heldout.tokenizer == "tok"
    assert heldout.reward is trainer.reward_funcs  # one memo for training and evaluation
    # the accuracy before RL: the warm-started policy, greedy, on the held-out problems, with that same memo
    assert fake_run.evaluations == [(fake_run.model, "tok", fake_run.heldout, 9, trainer.reward_funcs)]
    assert PrinterCallback not in trainer.callbacks and ProgressCallback in trainer.callbacks  # disable_tqdm

    assert capsys.readouterr().out == (
        "Warm start (390 supervised steps, right on 64% of the training probe) loaded from cache in 1.2s; "
        "held-out accuracy before RL: 25.0%\n"
    )
    checkpoint = out / "checkpoint-final"
    assert (checkpoint / "model.safetensors").read_bytes() == b"weights"
    assert (checkpoint / "README.md").read_text() == "card of tiny-qwen3-addition-GSPO"
    assert not (out / "README.md").exists()  # moved into the checkpoint
    assert fake_run.plots == [(trainer.state.log_history, out / "training_curves.png", "GSPO on synthetic addition (seed 5)")]
    saved_history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert saved_history == trainer.state.log_history
    expected = {
        "algorithm": "GSPO",
        "seed": 5,
        "heldout_accuracy_before": 0.25,
        "heldout_accuracy_after": 0.375,
        "heldout_accuracies": [[0, 0.25], [1, 0.5], [2, 0.375]],
        "reward": [[1, 0.5], [2, 0.75]],
        "entropy": [[1, 1.5], [2, 1.25]],
        "optimizer_steps": 2,
        "parameters": 8,
        "num_heldout": 4,
        "warm_start_from_cache": True,
        "warm_start_steps": 390,
        "warm_start_seconds": 1.23,
        "train_seconds": 4.39,
        "wall_seconds": 15.01,
        "phase_seconds": {"warm_start": 1.23, "baseline_evaluation": 2.27, "rl": 4.39, "rl_evaluation": 0.0,
                          "final_evaluation": 0.0, "save": 7.11},
        "final_heldout": None,
        "warm_start_key": None,
        "checkpoint_dir": str(checkpoint),
        "plot_path": str(out / "training_curves.png"),
        "log_history_path": str(out / "trainer_state.json"),
        "summary_path": str(out / "summary.json"),
        "settings": {**json.loads(json.dumps(settings.__dict__)), "max_steps": 2, "eval_every": 7},
        "config_overrides": {"delta": 3.0},
        "commit": "abc1234567",
        "task": "addition",
    }  # fmt: skip
    assert json.loads(json.dumps(summary)) == expected
    text = (out / "summary.json").read_text()
    assert json.loads(text) == expected
    assert text.startswith('{\n  "algorithm": "GSPO",\n  "seed": 5,\n')  # indented for people to read


def test_run_defaults_come_from_the_settings_and_the_bar_shows_reward_and_entropy(fake_run, tmp_path, capsys):
    fake_run.model.config.warm_start_probe_accuracy = None  # a warm start without a stop rule: no probe figure
    fake_run.model.config.warm_start_steps = 20
    fake_run.from_cache = False
    summary = embedded.run_embedded(output_dir=tmp_path / "new" / "run", settings=EmbeddedSettings(num_heldout=4))
    (name, fields), = fake_run.configs
    assert name == "DHPO-E"
    assert (fields["max_steps"], fields["seed"], fields["disable_tqdm"], fields["learning_rate"]) == (120, 0, False, 2e-4)
    assert (fields["per_device_train_batch_size"], fields["steps_per_generation"]) == (128, 2)
    assert fake_run.tasks == [(EmbeddedSettings(num_heldout=4), 4, None, True)]
    assert summary["settings"]["max_steps"] == 120 and summary["settings"]["eval_every"] == 10
    assert summary["config_overrides"] == {}
    trainer, = FakeTrainer.built
    assert PrinterCallback in trainer.callbacks and ProgressCallback not in trainer.callbacks
    assert trainer.callbacks[-1] is CompactProgressCallback
    heldout, = [c for c in trainer.callbacks if isinstance(c, HeldoutAccuracyCallback)]
    assert (heldout.every, heldout.max_new_tokens) == (10, 12)
    assert capsys.readouterr().out.startswith("Warm start (20 supervised steps) trained in 1.2s; ")
    assert summary["warm_start_from_cache"] is False


def test_run_refuses_bad_counts_and_fixed_overrides_before_the_warm_start(fake_run, tmp_path):
    for name, kwargs in (("max_steps", {"max_steps": 0}), ("eval_every", {"eval_every": 0}),
                         ("num_heldout", {"num_heldout": 0})):  # fmt: skip
        with pytest.raises(ValueError) as error:
            embedded.run_embedded(output_dir=tmp_path, **kwargs)
        assert str(error.value) == f"{name}=0 must be a positive integer."
    embedded.run_embedded(output_dir=tmp_path / "one", max_steps=1, eval_every=1, num_heldout=1)  # 1 is allowed
    with pytest.raises(ValueError) as error:
        embedded.run_embedded(output_dir=tmp_path, config_overrides={"seed": 1, "max_steps": 3, "delta": 2.0})
    assert str(error.value) == (
        "config_overrides=['max_steps', 'seed'] are set by the embedded run itself: change EmbeddedSettings instead."
    )
    with pytest.raises(ValueError) as error:
        embedded.run_embedded("PPO", output_dir=tmp_path)
    assert str(error.value) == (
        "algorithm='PPO' is unknown: choose one of ['GRPO', 'GSPO', 'GMPO', 'CISPO', 'DHPO-A', 'DHPO-E', "
        "'DHPO-E-unified']."
    )
    assert len(fake_run.tasks) == 1  # only the good run reached the warm start


def test_run_embedded_sets_and_restores_the_torch_threads(monkeypatch, tmp_path):
    before = torch.get_num_threads()
    seen = []

    def run(*args):
        seen.append((torch.get_num_threads(), args))
        raise RuntimeError("boom")

    monkeypatch.setattr(embedded, "_run", run)
    with pytest.raises(RuntimeError):
        embedded.run_embedded("GRPO", 4, 9, tmp_path, eval_every=3, num_heldout=5, cache_dir="c", use_cache=False,
                              settings="s", disable_tqdm=True, num_threads=2)  # fmt: skip
    assert seen == [(2, ("GRPO", 4, 9, tmp_path, 3, 5, "c", False, "s", True, {}, None))]
    assert torch.get_num_threads() == before
    seen.clear()
    with pytest.raises(RuntimeError):
        embedded.run_embedded()
    # One thread by default; every default of the Python entry point as documented
    assert seen == [(1, ("DHPO-E", 0, None, "outputs/embedded", None, None, None, True, None, False, {}, None))]


# ------------------------------------------------------------------ the command line
def test_command_line_options_reach_the_run_and_the_summary(monkeypatch, tmp_path):
    runs, printed = [], []
    monkeypatch.setattr(embedded, "run_embedded", lambda *args, **kwargs: runs.append((args, kwargs)) or {"s": 1})
    monkeypatch.setattr(embedded, "_print_summary", printed.append)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    out, cache = tmp_path / "o" / "p", tmp_path / "cache"
    assert embedded.main(["--algorithm", "GMPO", "--seed", "3", "--max-steps", "7", "--output-dir", str(out),
                          "--eval-every", "2", "--num-heldout", "9", "--cache-dir", str(cache)]) == 0  # fmt: skip
    assert runs == [(("GMPO", 3, 7, str(out)),
                     dict(eval_every=2, num_heldout=9, cache_dir=str(cache), use_cache=True, settings=None))]  # fmt: skip
    assert printed == [{"s": 1}]
    assert out.is_dir() and cache.is_dir()  # made at start, so a bad path fails before the warm start
    assert os.environ["HF_HUB_OFFLINE"] == "1"

    runs.clear()  # (--no-cache with --cache-dir, which it would leave unused: refused, tests/test_user_errors.py)
    assert embedded.main(["--output-dir", str(tmp_path / "q"), "--no-cache"]) == 0
    assert runs == [(("DHPO-E", 0, None, str(tmp_path / "q")),
                     dict(eval_every=None, num_heldout=None, cache_dir=None, use_cache=False, settings=None))]  # fmt: skip

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the user's own setting is kept
    assert embedded.main(["--output-dir", str(tmp_path / "r")]) == 0
    assert os.environ["HF_HUB_OFFLINE"] == "0"

    runs.clear()
    monkeypatch.chdir(tmp_path)
    assert embedded.main([]) == 0
    assert runs == [(("DHPO-E", 0, None, "outputs/embedded"),
                     dict(eval_every=None, num_heldout=None, cache_dir=None, use_cache=True, settings=None))]  # fmt: skip
    assert (tmp_path / "outputs" / "embedded").is_dir()


def test_command_line_errors_are_one_line_and_debug_shows_their_traceback(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(embedded, "run_embedded", lambda *args, **kwargs: pytest.fail("must not run"))
    (tmp_path / "file").write_text("")
    assert embedded.main(["--output-dir", str(tmp_path / "file" / "x")]) == 2
    assert capsys.readouterr().err.startswith(
        f"python -m dhpo_trl: error: --output-dir: cannot create the folder {tmp_path / 'file' / 'x'} ("
    )
    assert embedded.main(["--output-dir", str(tmp_path / "file" / "x"), "--debug"]) == 2
    assert capsys.readouterr().err.startswith("Traceback (most recent call last):\n")
    for flag in ("--max-steps", "--eval-every", "--num-heldout"):
        with pytest.raises(SystemExit) as exit_:
            embedded.main([flag, "0"])
        assert exit_.value.code == 2
        assert f"argument {flag}: expected a positive whole number, got '0'" in capsys.readouterr().err
    monkeypatch.setenv("COLUMNS", "200")  # one line per option
    with pytest.raises(SystemExit):
        embedded.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for text in (
        "usage: python -m dhpo_trl [-h]",
        "[--debug] Train DHPO (or a paper baseline) on CPU, offline: a warm-started tiny Qwen3 on synthetic addition. "
        "options:",
        "--max-steps MAX_STEPS RL optimizer steps (120)",
        "--eval-every EVAL_EVERY (10)",
        "--num-heldout NUM_HELDOUT (200)",
        "--cache-dir CACHE_DIR warm-start cache (default ~/.cache/dhpo_trl)",
        "--no-cache always retrain the warm start, save nothing",
        "--debug show the Python traceback of an error instead of its one-line message",
    ):
        assert text in help_text, text


def test_source_commit_is_git_head_of_the_package_with_its_dirty_state(monkeypatch):
    root = Path(embedded.__file__).resolve().parents[2]
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain", "--", "dhpo_trl"], capture_output=True, text=True,
                             check=True).stdout.strip()  # fmt: skip
    commit = embedded.source_commit()
    assert head.startswith(commit.removesuffix("-dirty")) and len(commit.removesuffix("-dirty")) >= 7
    assert commit.endswith("-dirty") == bool(changed)

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(embedded.subprocess, "run", no_git)
    assert embedded.source_commit() is None
