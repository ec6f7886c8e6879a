"""BenchmarkEvalCallback in-process, hook by hook, with no training run: a fake sampling backend answers each
question with completions of known correctness, so every logged number is known in advance.

Covered: when it evaluates (every N steps, at the start, never from the other hooks), what it logs and where (the
callback's history, `state.log_history`, or `Trainer.log` and the other callbacks' `on_log` when attached, with the
training log flag left as it was), the sampling settings and batch size it passes on, the model it samples from (as
given, or unwrapped and gathered through TRL's helpers with the trainer), the split of problems between processes
(a fake process group on threads: each process samples its units with the unit's seed, ZeRO-3/FSDP pad to the same
number of generate calls, and the gathered scores equal one process's), and every setup error, word for word.
"""

import logging
from contextlib import contextmanager
from types import SimpleNamespace

import datasets
import pytest
import torch
from transformers import DefaultFlowCallback, TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler

from dhpo_trl.evaluation import BenchmarkEvalCallback, SamplingSettings
from dhpo_trl.evaluation import callback as callback_module

# In-memory benchmark rows and, for each question, the completions a fake model gives (sample j gets entry j,
# cycling), with the gold and the correctness written next to them.
GSM8K_ROWS = [
    {"question": "Ann has 3 cats and 4 dogs. How many pets?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "Ben buys 1000 pens twice. How many pens?", "answer": "1000 * 2\n#### 2,000"},
    {"question": "Cy has 9 eggs and eats 2. How many are left?", "answer": "#### 7"},
    {"question": "Dee runs 5 km a day for 4 days. How far?", "answer": "#### 20"},
    {"question": "Eve reads 6 pages and 6 more. How many pages?", "answer": "#### 12"},
]
AIME_ROWS = [
    {"problem": "Find $6 \\cdot 7$.", "answer": "42"},
    {"problem": "Find $2^{10}$.", "answer": "1024"},
]
BOOK = {
    "Ann has 3 cats": [r"\boxed{7.0}"],  # 7: right
    "Ben buys 1000 pens": [r"so \boxed{2000}"],  # 2000: right
    "Cy has 9 eggs": [r"\boxed{6}"],  # 7: wrong
    "Dee runs 5 km": [r"\boxed{20.00}"],  # 20: right
    "Eve reads 6 pages": [r"\boxed{\frac{25}{2}}"],  # 12: wrong
    "Find $6 \\cdot 7$": [r"\boxed{42}", r"\boxed{24}", "42, no box", r"\boxed{42.0}"],  # 42: 2 of 4
    "Find $2^{10}$": [r"\boxed{1000}", r"\boxed{2^{10}}", r"\boxed{1024}", r"\boxed{1024}"],  # 1024: 3 of 4
}
# Pass@1 over the first four gsm8k questions: 3/4; over all five: 3/5. AIME25 Avg@4: (2/4 + 3/4) / 2; with one
# sample (the first of each): (1 + 0) / 2.
GSM8K_4, GSM8K_5, AIME_AVG4, AIME_PASS1 = 75.0, 60.0, 62.5, 50.0


class _AtGather(Exception):
    pass


class FakeProcessGroup:
    """Stands in for torch.distributed: `world` ranks run one after another in this thread (the grader runs here
    too, as in training). The only exchange is the final all_gather_object, so each rank runs twice: up to its
    gather, which records what it sends, then to the end, with every rank's recorded object gathered."""

    def __init__(self, world):
        self.world = world
        self.rank = None
        self.sent = {}
        self.gathers = 0
        self.backend = None

    def is_initialized(self):
        return True

    def get_rank(self):
        return self.rank

    def get_world_size(self):
        return self.world

    def all_gather_object(self, out, obj):
        assert len(out) == self.world
        if self.collecting:
            self.sent[self.rank] = obj
            raise _AtGather
        assert obj == self.sent[self.rank]  # the same work as the first time
        self.gathers += 1
        for rank in range(self.world):
            out[rank] = self.sent[rank]

    def run(self, function):
        """function() on every rank; the results in rank order. The backend's calls are those of the second runs."""
        self.collecting = True
        for rank in range(self.world):
            self.rank = rank
            try:
                function()
            except _AtGather:
                pass
        self.backend.calls.clear()
        self.collecting = False
        results = []
        for rank in range(self.world):
            self.rank = rank
            results.append(function())
        return results


class BookBackend:
    """A fake sampling backend. Records how it was built and, per generate call, the rank, the questions (by the
    first words of BOOK), the samples per problem and the settings."""

    def __init__(self, process_group=None):
        self.process_group = process_group
        self.built = []
        self.calls = []

    def __call__(self, model, tokenizer, *, batch_size):  # replaces the TransformersBackend class
        self.built.append((model, tokenizer, batch_size))
        self.tokenizer = tokenizer
        return self

    def rank(self):
        return self.process_group.get_rank() if self.process_group else 0

    def generate(self, prompt_ids, num_samples, settings):
        questions, completions = [], []
        for ids in prompt_ids:
            text = self.tokenizer.decode(ids)
            (key,) = [key for key in BOOK if key in text]
            questions.append(key)
            completions.append([BOOK[key][j % len(BOOK[key])] for j in range(num_samples)])
        self.calls.append((self.rank(), questions, num_samples, settings))
        return completions


@pytest.fixture
def book(monkeypatch):
    backend = BookBackend()
    monkeypatch.setattr(callback_module, "TransformersBackend", backend)
    return backend


@pytest.fixture
def group_of(monkeypatch):
    """A fake process group of `world` ranks, installed as the callback's torch.distributed."""

    def install(world):
        group = FakeProcessGroup(world)
        monkeypatch.setattr(callback_module, "dist", group)
        backend = group.backend = BookBackend(group)
        monkeypatch.setattr(callback_module, "TransformersBackend", backend)
        return group, backend

    return install


def args_like(**overrides):
    """What the callback reads from TrainingArguments."""
    return SimpleNamespace(**{"fsdp": "", "gradient_checkpointing_kwargs": None, **overrides})


def callback_for(rows=None, **kwargs):
    return BenchmarkEvalCallback(rows or {"aime25": AIME_ROWS, "gsm8k": GSM8K_ROWS[:4]}, **kwargs)


MODEL = object()  # the fake backend never touches the model; identity shows which one it was given


def step(callback, tokenizer, global_step, control=None, model=MODEL):
    state = TrainerState(global_step=global_step)
    callback.on_step_end(args_like(), state, control or TrainerControl(), model=model, processing_class=tokenizer)
    return state


# ------------------------------------------------------------------ what it logs


def test_scores_from_known_answers(book, tokenizer):
    callback = callback_for(samples={"aime25": 4}, every_n_steps=3)
    state = step(callback, tokenizer, 3)
    expected = {"eval/aime25": AIME_AVG4, "eval/gsm8k": GSM8K_4, "eval/avg": 68.75}
    assert callback.history == [{"step": 3, **expected}]
    assert list(callback.history[0]) == ["step", "eval/aime25", "eval/gsm8k", "eval/avg"]  # Table-1 order, then avg
    assert state.log_history == [{**expected, "step": 3}]
    assert callback.evaluate(MODEL, tokenizer) == expected  # the public method, for the model as it is


def test_samples_default_and_per_benchmark(book, tokenizer):
    one = callback_for()  # one sample per problem unless told
    assert one.evaluate(MODEL, tokenizer) == {"eval/aime25": AIME_PASS1, "eval/gsm8k": GSM8K_4, "eval/avg": 62.5}
    assert {num_samples for _, _, num_samples, _ in book.calls} == {1}
    book.calls.clear()
    mixed = callback_for(samples={"gsm8k": 2})  # AIME25 not named: the paper's 32
    assert mixed.evaluate(MODEL, tokenizer) == {"eval/aime25": AIME_AVG4, "eval/gsm8k": GSM8K_4, "eval/avg": 68.75}
    assert [(questions, n) for _, questions, n, _ in book.calls] == [
        (["Find $6 \\cdot 7$"], 32),  # 16 // 32 -> units of one problem
        (["Find $2^{10}$"], 32),
        (["Ann has 3 cats", "Ben buys 1000 pens", "Cy has 9 eggs", "Dee runs 5 km"], 2),  # 16 // 2 = 8 a unit
    ]
    book.calls.clear()
    every = callback_for(samples=3)  # one int for every benchmark
    assert {n for _, _, n, _ in book.calls} == set()
    every.evaluate(MODEL, tokenizer)
    assert {n for _, _, n, _ in book.calls} == {3}


def test_units_are_about_one_generate_batch_with_their_own_seed(book, tokenizer):
    callback = BenchmarkEvalCallback(
        {"gsm8k": GSM8K_ROWS, "aime25": AIME_ROWS},
        samples={"gsm8k": 2, "aime25": 4},
        batch_size=5,
        max_new_tokens=7,
        temperature=0.5,
        top_p=0.75,
        seed=10,
    )
    assert callback.evaluate(MODEL, tokenizer) == {"eval/aime25": AIME_AVG4, "eval/gsm8k": GSM8K_5, "eval/avg": 61.25}
    assert book.built == [(MODEL, tokenizer, 5)]
    # gsm8k: 5 // 2 = 2 problems a unit -> units of 2, 2, 1; aime25: 5 // 4 = 1 problem a unit; seeds 10 + unit
    assert [(questions, n, s) for _, questions, n, s in book.calls] == [
        (["Find $6 \\cdot 7$"], 4, SamplingSettings(7, 0.5, 0.75, 10)),
        (["Find $2^{10}$"], 4, SamplingSettings(7, 0.5, 0.75, 11)),
        (["Ann has 3 cats", "Ben buys 1000 pens"], 2, SamplingSettings(7, 0.5, 0.75, 10)),
        (["Cy has 9 eggs", "Dee runs 5 km"], 2, SamplingSettings(7, 0.5, 0.75, 11)),
        (["Eve reads 6 pages"], 2, SamplingSettings(7, 0.5, 0.75, 12)),
    ]


def test_more_samples_than_the_batch_still_make_one_problem_units(book, tokenizer):
    callback = BenchmarkEvalCallback({"gsm8k": GSM8K_ROWS[:3]}, samples=4, batch_size=3)
    assert callback.evaluate(MODEL, tokenizer) == {"eval/gsm8k": 200 / 3, "eval/avg": 200 / 3}
    assert [(questions, n, s.seed) for _, questions, n, s in book.calls] == [
        (["Ann has 3 cats"], 4, 0), (["Ben buys 1000 pens"], 4, 1), (["Cy has 9 eggs"], 4, 2),
    ]  # fmt: skip


def test_default_settings(book, tokenizer):
    rows = [{"question": f"Ann has 3 cats. Copy {i}.", "answer": "#### 3"} for i in range(40)]
    callback = BenchmarkEvalCallback({"gsm8k": rows})
    assert len(callback.problems["gsm8k"]) == 32  # limit 32
    for global_step in (1, 49):
        step(callback, tokenizer, global_step)
    assert book.calls == []
    step(callback, tokenizer, 50)  # every 50 steps
    assert book.built == [(MODEL, tokenizer, 16)]  # batch size 16
    # 16 problems a unit (one sample each), seed 0 + unit; 16K tokens would be the CLI's: here 1024
    assert [(len(questions), n, s) for _, questions, n, s in book.calls] == [
        (16, 1, SamplingSettings(max_new_tokens=1024, temperature=1.0, top_p=1.0, seed=0)),
        (16, 1, SamplingSettings(max_new_tokens=1024, temperature=1.0, top_p=1.0, seed=1)),
    ]
    assert callback.history == [{"step": 50, "eval/gsm8k": 0.0, "eval/avg": 0.0}]  # "Ann has 3 cats": \boxed{7.0}


def test_no_limit_and_a_hub_split(book, tokenizer, monkeypatch):
    calls = []

    def fake_load_dataset(dataset_id, split):
        calls.append((dataset_id, split))
        return datasets.Dataset.from_list(GSM8K_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    everything = BenchmarkEvalCallback({"gsm8k": "org/gsm8k"}, limit=None)
    assert len(everything.problems["gsm8k"]) == 5
    two = BenchmarkEvalCallback({"gsm8k": "org/gsm8k"}, limit=2, split="validation")
    assert [p.answer for p in two.problems["gsm8k"]] == ["7", "2000"]
    assert calls == [("org/gsm8k", "test"), ("org/gsm8k", "validation")]


def test_names_and_data_dir(tmp_path, book, tokenizer):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(
        '{"question": "Ann has 3 cats and 4 dogs. How many pets?", "answer": "#### 7"}\n', encoding="utf-8"
    )
    callback = BenchmarkEvalCallback(["GSM8K"], data_dir=str(tmp_path))
    assert callback.evaluate(MODEL, tokenizer) == {"eval/gsm8k": 100.0, "eval/avg": 100.0}


# ------------------------------------------------------------------ when it evaluates


def test_every_n_steps_and_eval_on_start(book, tokenizer):
    callback = callback_for(every_n_steps=3, eval_on_start=True)
    state = TrainerState(global_step=0)
    callback.on_train_begin(args_like(), state, TrainerControl(), model=MODEL, processing_class=tokenizer)
    for global_step in range(1, 8):
        step(callback, tokenizer, global_step)
    assert [entry["step"] for entry in callback.history] == [0, 3, 6]

    quiet = callback_for(every_n_steps=1)  # eval_on_start off by default; every step when N = 1
    quiet.on_train_begin(args_like(), TrainerState(), TrainerControl(), model=MODEL, processing_class=tokenizer)
    assert quiet.history == []
    for global_step in (1, 2):
        step(quiet, tokenizer, global_step)
    assert [entry["step"] for entry in quiet.history] == [1, 2]


def test_other_hooks_do_not_evaluate(book, tokenizer):
    callback = callback_for(every_n_steps=5)
    state, control = TrainerState(global_step=10), TrainerControl()
    hooks = {"model": MODEL, "processing_class": tokenizer}
    callback.on_evaluate(args_like(), state, control, metrics={"eval_loss": 1.0}, **hooks)
    callback.on_log(args_like(), state, control, logs={"loss": 1.0}, **hooks)
    callback.on_epoch_end(args_like(), state, control, **hooks)
    callback.on_substep_end(args_like(), state, control, **hooks)
    callback.on_train_end(args_like(), state, control, **hooks)  # no extra evaluation at the end: only on_step_end
    assert book.calls == [] and callback.history == [] and state.log_history == []


# ------------------------------------------------------------------ where it logs


def test_unattached_writes_the_log_history_and_warns_once(book, tokenizer, caplog):
    callback = callback_for(every_n_steps=2)
    state, control = TrainerState(), TrainerControl(should_log=True)
    with caplog.at_level(logging.WARNING, logger="dhpo_trl.evaluation.callback"):
        for global_step in (2, 4):
            state.global_step = global_step
            callback.on_step_end(args_like(), state, control, model=MODEL, processing_class=tokenizer)
    scores = {"eval/aime25": AIME_PASS1, "eval/gsm8k": GSM8K_4, "eval/avg": 62.5}
    assert state.log_history == [{**scores, "step": 2}, {**scores, "step": 4}]
    assert callback.history == [{"step": 2, **scores}, {"step": 4, **scores}]
    assert [record.getMessage() for record in caplog.records] == [
        (
            "BenchmarkEvalCallback is not attached to a trainer: eval/* metrics go to trainer.state.log_history only. "
            "Use callback.attach(trainer) to reach the trackers."
        )
    ]
    assert control.should_log is True


class LogRecorder(TrainerCallback):
    def __init__(self, events):
        self.events = events
        self.logged = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append(dict(logs))
        self.events.append("on_log")


class FakeTrainer:
    """What Trainer.log and the callback use of a trainer."""

    def __init__(self, state, control, events):
        self.state, self.control = state, control
        self.args = SimpleNamespace(include_num_input_tokens_seen="no")
        self.recorder = LogRecorder(events)
        self.callback_handler = CallbackHandler([DefaultFlowCallback(), self.recorder], None, None, None, None)
        self.model_wrapped, self.accelerator = "wrapped engine", "accelerator"
        self.added = []

    def add_callback(self, callback):
        self.added.append(callback)


@pytest.fixture
def trl_helpers(monkeypatch):
    """TRL's unwrap/gather helpers, faked: record the calls and yield a stand-in for the unwrapped model."""
    import trl.distributed
    import trl.models

    events, unwrapped = [], object()

    @contextmanager
    def unwrap_model_for_generation(model, accelerator, gather_deepspeed3_params=True, generation_kwargs=None,
                                    gradient_checkpointing_kwargs=None):  # fmt: skip
        events.append(("unwrap", model, accelerator, gather_deepspeed3_params, generation_kwargs,
                       gradient_checkpointing_kwargs))  # fmt: skip
        yield unwrapped
        events.append("unwrapped exit")

    class DistributedBackend:
        def __init__(self, accelerator):
            events.append(("backend", accelerator))

        @contextmanager
        def summon_full_params(self, module, **kwargs):
            events.append(("summon", module, kwargs))
            yield
            events.append("summon exit")

    monkeypatch.setattr(trl.models, "unwrap_model_for_generation", unwrap_model_for_generation)
    monkeypatch.setattr(trl.distributed, "DistributedBackend", DistributedBackend)
    return events, unwrapped


def test_attached_logs_through_the_trainer_with_gathered_weights(book, tokenizer, caplog, trl_helpers):
    events, unwrapped = trl_helpers
    state, control = TrainerState(global_step=4, epoch=0.5), TrainerControl(should_log=True)
    trainer = FakeTrainer(state, control, events)
    callback = callback_for(every_n_steps=4)
    assert callback.attach(trainer) is callback
    assert trainer.added == [callback]
    args = args_like(ds3_gather_for_generation=False, gradient_checkpointing_kwargs={"use_reentrant": False})
    with caplog.at_level(logging.WARNING, logger="dhpo_trl.evaluation.callback"):
        callback.on_step_end(args, state, control, model=MODEL, processing_class=tokenizer)
    scores = {"eval/aime25": AIME_PASS1, "eval/gsm8k": GSM8K_4, "eval/avg": 62.5}
    assert trainer.recorder.logged == [{**scores, "epoch": 0.5}]  # what the trackers get
    assert state.log_history == [{**scores, "epoch": 0.5, "step": 4}]
    assert callback.history == [{"step": 4, **scores}]
    assert control.should_log is True  # the step's own training log still happens
    assert caplog.records == []
    assert book.built == [(unwrapped, tokenizer, 16)]  # sampled from the unwrapped model
    assert events == [
        ("unwrap", "wrapped engine", "accelerator", False, None, {"use_reentrant": False}),
        ("backend", "accelerator"),
        ("summon", "wrapped engine", {"recurse": False}),
        "summon exit",
        "unwrapped exit",
        "on_log",  # weights released before logging
    ]


def test_attached_keeps_a_false_log_flag_and_gathers_by_default(book, tokenizer, trl_helpers):
    events, _ = trl_helpers
    state, control = TrainerState(global_step=2, epoch=1.0), TrainerControl(should_log=False)
    trainer = FakeTrainer(state, control, events)
    callback = callback_for(every_n_steps=2, trainer=trainer)  # `trainer=` attaches for logging, without add_callback
    callback.on_step_end(args_like(), state, control, model=MODEL, processing_class=tokenizer)
    assert control.should_log is False
    assert events[0] == ("unwrap", "wrapped engine", "accelerator", True, None, None)  # ds3 gather unless told
    assert state.log_history == [
        {"eval/aime25": AIME_PASS1, "eval/gsm8k": GSM8K_4, "eval/avg": 62.5, "epoch": 1.0, "step": 2}
    ]
    assert trainer.added == []


def test_unattached_samples_the_model_it_is_given(book, tokenizer):
    callback = callback_for(every_n_steps=1)
    processor = SimpleNamespace(tokenizer=tokenizer)  # a processor wraps its tokenizer
    callback.on_step_end(args_like(), TrainerState(global_step=1), TrainerControl(), model=MODEL,
                         processing_class=processor)  # fmt: skip
    assert book.built == [(MODEL, tokenizer, 16)]


def test_real_model_keeps_train_mode_rng_and_settings(tokenizer, tiny_model, monkeypatch):
    """The real transformers backend: the callback's settings reach generate(), in eval mode, and training resumes
    with the model in train mode and the global RNG where it was."""
    seen = []
    generate = tiny_model.generate

    def spy(**kwargs):
        seen.append((tiny_model.training, kwargs["max_new_tokens"], kwargs["temperature"], kwargs["top_p"],
                     kwargs["input_ids"].shape[0]))  # fmt: skip
        return generate(**kwargs)

    monkeypatch.setattr(tiny_model, "generate", spy)
    callback = BenchmarkEvalCallback(
        {"gsm8k": GSM8K_ROWS[:3]}, every_n_steps=2, max_new_tokens=3, temperature=0.7, top_p=0.9, batch_size=2
    )
    tiny_model.train()
    rng = torch.get_rng_state()
    step(callback, tokenizer, 2, model=tiny_model)
    assert tiny_model.training
    assert torch.equal(torch.get_rng_state(), rng)
    assert seen == [(False, 3, 0.7, 0.9, 2), (False, 3, 0.7, 0.9, 1)]  # units of two problems, then one
    assert callback.history == [{"step": 2, "eval/gsm8k": 0.0, "eval/avg": 0.0}]  # 3 random tokens hold no box


# ------------------------------------------------------------------ several processes


def test_two_processes_split_units_and_log_one_process_scores(group_of, tokenizer):
    group, backend = group_of(2)
    callback = BenchmarkEvalCallback(
        {"gsm8k": GSM8K_ROWS, "aime25": AIME_ROWS}, samples={"gsm8k": 1, "aime25": 4}, batch_size=2, seed=3
    )
    results = group.run(lambda: callback.evaluate(MODEL, tokenizer))
    expected = {"eval/aime25": AIME_AVG4, "eval/gsm8k": GSM8K_5, "eval/avg": 61.25}
    assert results == [expected, expected]
    assert group.gathers == 2  # one gather per evaluation and process
    # gsm8k units (2 problems each): 0 = Ann+Ben, 1 = Cy+Dee, 2 = Eve; aime25 units of one problem
    by_rank = {rank: [(q, s.seed) for r, q, _, s in backend.calls if r == rank] for rank in (0, 1)}
    assert by_rank == {
        0: [(["Find $6 \\cdot 7$"], 3), (["Ann has 3 cats", "Ben buys 1000 pens"], 3), (["Eve reads 6 pages"], 5)],
        1: [(["Find $2^{10}$"], 4), (["Cy has 9 eggs", "Dee runs 5 km"], 4)],
    }


def test_three_processes_one_without_work(group_of, tokenizer):
    group, backend = group_of(3)
    callback = BenchmarkEvalCallback({"aime25": AIME_ROWS}, samples=4, batch_size=4)
    assert (
        group.run(lambda: callback.evaluate(MODEL, tokenizer))
        == [{"eval/aime25": AIME_AVG4, "eval/avg": AIME_AVG4}] * 3
    )
    assert [(rank, q, s.seed) for rank, q, _, s in backend.calls] == [
        (0, ["Find $6 \\cdot 7$"], 0), (1, ["Find $2^{10}$"], 1),
    ]  # fmt: skip


@pytest.mark.parametrize("sharded", ["zero3", "fsdp"])
def test_lockstep_processes_make_the_same_number_of_generate_calls(group_of, tokenizer, monkeypatch, sharded):
    group, backend = group_of(2)
    models_checked = []

    def fsdp_managed(model):
        models_checked.append(model)
        return sharded == "fsdp"

    monkeypatch.setattr(callback_module, "is_deepspeed_zero3_enabled", lambda: sharded == "zero3")
    monkeypatch.setattr(callback_module, "is_fsdp_managed_module", fsdp_managed)
    callback = BenchmarkEvalCallback({"gsm8k": GSM8K_ROWS}, batch_size=2, seed=7)
    expected = {"eval/gsm8k": GSM8K_5, "eval/avg": GSM8K_5}
    assert group.run(lambda: callback.evaluate(MODEL, tokenizer)) == [expected, expected]
    by_rank = {rank: [(q, s.seed) for r, q, _, s in backend.calls if r == rank] for rank in (0, 1)}
    assert by_rank == {
        0: [(["Ann has 3 cats", "Ben buys 1000 pens"], 7), (["Eve reads 6 pages"], 9)],
        # unit 2 has no partner: rank 1 repeats unit 0 (its seed too) and drops the result
        1: [(["Cy has 9 eggs", "Dee runs 5 km"], 8), (["Ann has 3 cats", "Ben buys 1000 pens"], 7)],
    }
    if sharded == "fsdp":
        assert models_checked and all(model is MODEL for model in models_checked)  # the model it samples from


def test_plain_ddp_does_not_pad(group_of, tokenizer, monkeypatch):
    group, backend = group_of(2)
    monkeypatch.setattr(callback_module, "is_deepspeed_zero3_enabled", lambda: False)
    monkeypatch.setattr(callback_module, "is_fsdp_managed_module", lambda model: False)
    callback = BenchmarkEvalCallback({"gsm8k": GSM8K_ROWS}, batch_size=2)
    group.run(lambda: callback.evaluate(MODEL, tokenizer))
    assert [len([call for call in backend.calls if call[0] == rank]) for rank in (0, 1)] == [2, 1]


def test_one_process_does_not_pad_under_zero3(book, tokenizer, monkeypatch):
    monkeypatch.setattr(callback_module, "is_deepspeed_zero3_enabled", lambda: True)
    callback = BenchmarkEvalCallback({"gsm8k": GSM8K_ROWS}, batch_size=2)
    assert callback.evaluate(MODEL, tokenizer) == {"eval/gsm8k": GSM8K_5, "eval/avg": GSM8K_5}
    assert [s.seed for _, _, _, s in book.calls] == [0, 1, 2]


# ------------------------------------------------------------------ setup errors


def error_of(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        call(*args, **kwargs)
    return str(error.value)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"every_n_steps": 0}, "every_n_steps must be >= 1, got 0."),
        ({"every_n_steps": -5}, "every_n_steps must be >= 1, got -5."),
        ({"batch_size": 0}, "batch_size must be >= 1, got 0."),
        ({"limit": 0}, "limit must be a positive number of problems, got 0."),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0."),
        ({"temperature": -0.1}, "temperature must be >= 0 (0 = greedy), got -0.1."),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
    ],
)
def test_bad_settings_are_refused_by_name(setting, message):
    assert error_of(BenchmarkEvalCallback, {"gsm8k": GSM8K_ROWS}, **setting) == message


KNOWN = "['aime24', 'aime25', 'amc23', 'olympiadbench', 'math500', 'minerva_math', 'gsm8k']"


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        (0, "samples must be >= 1, got 0."),
        (-2, "samples must be >= 1, got -2."),
        ({"gsm8k": 0}, "samples['gsm8k'] must be a whole number >= 1, got 0."),
        ({"aime24": 4, "gsm8k": 2.5}, "samples['gsm8k'] must be a whole number >= 1, got 2.5."),
        ({"gsm8k": 2, "gsm9k": 4}, f"samples names unknown benchmark(s) ['gsm9k']: choose from {KNOWN}."),
    ],
)
def test_bad_samples_are_refused_when_built(samples, message):
    """Not at the first evaluation, steps into training (a 0 used to stop the run there with a ZeroDivisionError, and
    a misspelt name silently got the paper's 32 samples)."""
    assert error_of(BenchmarkEvalCallback, {"gsm8k": GSM8K_ROWS}, samples=samples) == message


def test_smallest_settings_are_accepted(book, tokenizer):
    callback = BenchmarkEvalCallback(
        {"gsm8k": GSM8K_ROWS}, every_n_steps=1, batch_size=1, limit=1, temperature=0, samples={"gsm8k": 1, "aime24": 8}
    )  # samples for a benchmark not evaluated here are allowed (one dict for several callbacks)
    step(callback, tokenizer, 1)
    assert [(q, n, s.temperature) for _, q, n, s in book.calls] == [(["Ann has 3 cats"], 1, 0)]
    BenchmarkEvalCallback({"gsm8k": GSM8K_ROWS}, samples=1)


def test_bad_benchmarks_and_sources():
    assert error_of(BenchmarkEvalCallback, {"gsm9k": GSM8K_ROWS}) == (
        f"Unknown benchmark name(s) ['gsm9k']: choose from {KNOWN} or 'all'."
    )
    assert error_of(BenchmarkEvalCallback, ["math500"]) == (
        "Benchmark 'math500': no data source. Pass --data-dir DIR (with math500/test.jsonl) "
        "or --data math500=PATH_OR_HUB_ID."
    )
    assert error_of(BenchmarkEvalCallback, {"gsm8k": [{"question": "q", "answer": "7"}]}).startswith(
        "gsm8k row 0: benchmark 'gsm8k' needs field 'answer'"
    )  # data checked when the callback is built, before training


def test_hooks_need_the_model_and_the_tokenizer(book, tokenizer):
    callback = callback_for(every_n_steps=1)
    message = "BenchmarkEvalCallback needs the trainer's model and processing_class (tokenizer)."
    state = TrainerState(global_step=1)
    assert error_of(callback.on_step_end, args_like(), state, TrainerControl(), processing_class=tokenizer) == message
    assert error_of(callback.on_step_end, args_like(), state, TrainerControl(), model=MODEL) == message
    assert book.calls == []


def test_sharded_training_needs_the_trainer(book, tokenizer, monkeypatch, trl_helpers):
    message = (
        "BenchmarkEvalCallback under DeepSpeed ZeRO-3 or FSDP needs the trainer to gather the weights for "
        "generation: register it with callback.attach(trainer) instead of callbacks=[...]."
    )
    callback = callback_for()
    hooks = {"model": MODEL, "processing_class": tokenizer}
    callback.on_train_begin(args_like(), TrainerState(), TrainerControl(), **hooks)  # neither: fine
    assert (
        error_of(callback.on_train_begin, args_like(fsdp="full_shard"), TrainerState(), TrainerControl(), **hooks)
        == message
    )
    monkeypatch.setattr(callback_module, "is_deepspeed_zero3_enabled", lambda: True)
    assert error_of(callback.on_train_begin, args_like(), TrainerState(), TrainerControl(), **hooks) == message
    events, _ = trl_helpers
    attached = callback_for(eval_on_start=True)
    attached.attach(FakeTrainer(TrainerState(), TrainerControl(), events))
    attached.on_train_begin(args_like(fsdp="full_shard"), TrainerState(), TrainerControl(), **hooks)  # attached: fine
    assert [entry["step"] for entry in attached.history] == [0]
