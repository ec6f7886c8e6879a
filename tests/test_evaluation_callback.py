"""BenchmarkEvalCallback inside a short off-policy DHPO run: eval/<benchmark> entries land in the log history, reach
the other callbacks' on_log (the tracker integrations) when attached, and leave the training metrics intact."""


import pytest
from benchmark_fixtures import FIXTURES
from datasets import Dataset
from transformers import TrainerCallback

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.evaluation import BenchmarkEvalCallback


class LogRecorder(TrainerCallback):
    """Stands in for a tracker integration: records what on_log receives."""

    def __init__(self):
        self.logged = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append(dict(logs))


def test_callback_logs_eval_metrics_during_training(tmp_path, tokenizer, tiny_model):
    def length_reward(completions, **kwargs):
        return [float(len(c) % 3) for c in completions]

    args = DHPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=1,
        steps_per_generation=2, max_completion_length=6, max_steps=2, logging_steps=1, report_to="none",
        save_strategy="no", learning_rate=1e-2, use_cpu=True, bf16=False,
    )  # fmt: skip
    recorder = LogRecorder()
    unattached = BenchmarkEvalCallback(
        ["aime25"], data_dir=FIXTURES, every_n_steps=2, limit=1, samples=2, max_new_tokens=3, batch_size=2
    )
    trainer = DHPOTrainer(
        model=tiny_model, reward_funcs=length_reward, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(8)]}), callbacks=[recorder, unattached],
    )  # fmt: skip
    attached = BenchmarkEvalCallback(
        {"gsm8k": FIXTURES / "gsm8k"}, every_n_steps=1, limit=2, max_new_tokens=4, eval_on_start=True
    ).attach(trainer)
    trainer.train()

    history = trainer.state.log_history
    gsm = [entry for entry in history if "eval/gsm8k" in entry]
    assert [entry["step"] for entry in gsm] == [0, 1, 2]
    for entry in gsm:
        assert entry["eval/avg"] == entry["eval/gsm8k"]
        assert entry["eval/gsm8k"] in (0.0, 50.0, 100.0)  # Pass@1 over two problems
        assert not any(key.startswith("dhpo/") or key == "loss" for key in entry)  # training metrics not folded in
    assert [{k: v for k, v in e.items() if k.startswith("eval/") or k == "step"} for e in gsm] == attached.history

    aime = [entry for entry in history if "eval/aime25" in entry]
    assert [entry["step"] for entry in aime] == [2]
    assert aime[0]["eval/aime25"] in (0.0, 50.0, 100.0)  # Avg@2 over one problem
    assert unattached.history == [{"step": 2, "eval/aime25": aime[0]["eval/aime25"], "eval/avg": aime[0]["eval/avg"]}]

    # the attached callback's metrics reach on_log (trackers); the unattached one's only the log history
    assert [logs["eval/gsm8k"] for logs in recorder.logged if "eval/gsm8k" in logs] == [e["eval/gsm8k"] for e in gsm]
    assert not any("eval/aime25" in logs for logs in recorder.logged)

    # training entries still carry their own metrics, once per step
    training = [entry for entry in history if "loss" in entry]
    assert [entry["step"] for entry in training] == [1, 2]
    assert all("dhpo/mixing_weight/mean" in entry and "entropy" in entry for entry in training)
    assert trainer.model.training


def test_callback_rejects_bad_setup():
    with pytest.raises(ValueError, match="Unknown benchmark name"):
        BenchmarkEvalCallback({"gsm9k": FIXTURES / "gsm8k"})
    with pytest.raises(ValueError, match="every_n_steps must be >= 1"):
        BenchmarkEvalCallback(["gsm8k"], data_dir=FIXTURES, every_n_steps=0)
    with pytest.raises(ValueError, match="no data source"):
        BenchmarkEvalCallback(["gsm8k"])


def test_unattached_callback_is_refused_under_zero3(monkeypatch, tmp_path):
    """Without the trainer there is no DeepSpeed engine to gather the weights from: refused at the start, by name."""
    from transformers import TrainerControl, TrainerState

    args = DHPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    callback = BenchmarkEvalCallback(["gsm8k"], data_dir=FIXTURES, limit=1)
    callback.on_train_begin(args, TrainerState(), TrainerControl())  # no ZeRO-3: fine
    monkeypatch.setattr("dhpo_trl.evaluation.callback.is_deepspeed_zero3_enabled", lambda: True)
    with pytest.raises(ValueError, match=r"callback.attach\(trainer\)"):
        callback.on_train_begin(args, TrainerState(), TrainerControl())
