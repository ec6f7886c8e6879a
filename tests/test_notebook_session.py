"""A notebook session: one long-lived process that trains, interrupts, trains again and resumes with the same
trainer. Each `train()` without a checkpoint is a run of its own: it generates its first batch itself, never
trains on what an interrupted run left buffered, and logs none of that run's metrics; an interrupted run resumes
exactly. Compared with `trl.GRPOTrainer` where TRL behaves otherwise (it keeps the buffer).

DHPO-E on the tiny Qwen3, a generation batch every two optimizer steps, each run about a second.
"""

import signal

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from dhpo_trl import DHPOTrainer
from dhpo_trl.core.presets import config_for
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3

SETTINGS = dict(per_device_train_batch_size=4, gradient_accumulation_steps=1, steps_per_generation=2,
                num_generations=4, max_completion_length=6, max_steps=6, logging_steps=1, learning_rate=1e-2,
                beta=0.0, save_strategy="steps", save_steps=1, report_to="none", use_cpu=True, bf16=False,
                seed=0, data_seed=0)  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def digit_share(completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


class Interrupt(TrainerCallback):
    """A KeyboardInterrupt after optimizer step `at`, once (the user pressing "interrupt" in the middle of a cell)."""

    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if self.at is not None and state.global_step == self.at:
            self.at = None
            raise KeyboardInterrupt


def recording(trainer_class):
    class Recording(trainer_class):
        """Records the optimizer step at which every generation batch is made."""

        generated_at: list

        def _generate_and_score_completions(self, inputs):
            self.generated_at.append(self.state.global_step)
            return super()._generate_and_score_completions(inputs)

    return Recording


def build(trainer_class, args, tok):
    data = Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(24)]})
    trainer = recording(trainer_class)(model=build_tiny_qwen3(tok), reward_funcs=digit_share, args=args,
                                       processing_class=tok, train_dataset=data)  # fmt: skip
    trainer.generated_at = []
    return trainer


def interrupted(trainer, at):
    trainer.add_callback(Interrupt(at))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.state.global_step == at
    trainer.generated_at.clear()


@pytest.mark.parametrize("at", [3, 4])  # in the middle of a generation batch, and at its end
def test_a_new_train_after_an_interrupt_generates_its_own_first_batch(tok, tmp_path, at):
    """TRL keeps its micro-step counter and buffered micro-batches across `train()` calls: after an interrupt in the
    middle of a generation batch, its next run trains its first step on the interrupted run's buffered rest and
    generates at steps 1, 3, 5 instead of 0, 2, 4."""
    trainer = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path), **SETTINGS), tok)
    interrupted(trainer, at)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    assert handlers == {signal.SIGTERM: signal.SIG_DFL, signal.SIGUSR1: signal.SIG_DFL}  # the graceful stop's, gone
    trainer._metrics["train"]["left/by_the_interrupt"].append(1.0)  # a metric the interrupted run did not log
    trainer.train()
    assert trainer.generated_at == [0, 2, 4]
    assert trainer.state.global_step == 6
    assert not any("left/by_the_interrupt" in entry for entry in trainer.state.log_history)


def test_trl_keeps_the_interrupted_runs_buffer(tok, tmp_path):
    """What the test above guards against, in `trl.GRPOTrainer` itself (so that test can fail)."""
    trainer = build(GRPOTrainer, GRPOConfig(output_dir=str(tmp_path), **SETTINGS), tok)
    interrupted(trainer, 3)
    trainer.train()
    assert trainer.generated_at == [1, 3, 5]


def test_an_interrupted_run_resumes_exactly_in_the_same_process(tok, tmp_path):
    """Interrupt at step 3 (in the middle of a generation batch), then `train(resume_from_checkpoint=True)` with the
    same trainer: the uninterrupted run's parameters and losses."""
    trainer = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "cut"), **SETTINGS), tok)
    interrupted(trainer, 3)
    trainer.train(resume_from_checkpoint=True)
    whole = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "whole"), **SETTINGS), tok)
    whole.train()
    losses = [[entry["loss"] for entry in run.state.log_history if "loss" in entry] for run in (trainer, whole)]
    assert losses[0] == losses[1] and len(losses[0]) == 6
    for ours, reference in zip(trainer.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)


@pytest.mark.parametrize("second", [dict(), dict(bf16=True)])  # the same settings, and another mixed precision
def test_a_config_built_after_the_trainer_is_refused_at_train_and_a_rebuilt_trainer_trains(tok, tmp_path, second):
    """transformers empties accelerate's process-wide state whenever a config is built: the earlier trainer's next
    `train()` is refused before any step (TRL's fails inside accelerate, below), and a trainer built after the
    config trains, with the earlier trainer's mixed precision where that is what its config asks for."""
    settings = {**SETTINGS, "save_strategy": "no", "max_steps": 2}
    first = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "a"), **settings), tok)
    first.train()
    config_for("GRPO", output_dir=str(tmp_path / "b"), **{**settings, **second})  # the next cell's config
    with pytest.raises(RuntimeError) as refused:
        first.train()
    assert first.state.global_step == 2  # refused before any step
    # One line naming the configs whose construction resets the state.
    named = [name for name in ("DHPOConfig", "GRPOConfig", "TrainingArguments") if name in str(refused.value)]
    assert named == ["DHPOConfig", "GRPOConfig", "TrainingArguments"] and "\n" not in str(refused.value)
    again = build(DHPOTrainer, first.args, tok)
    again.train()
    assert again.state.global_step == 2 and again.accelerator.mixed_precision == "no"


def test_trl_fails_inside_accelerate_after_a_config_built_after_its_trainer(tok, tmp_path):
    settings = {**SETTINGS, "save_strategy": "no", "max_steps": 2}
    first = build(GRPOTrainer, GRPOConfig(output_dir=str(tmp_path / "a"), **settings), tok)
    first.train()
    GRPOConfig(output_dir=str(tmp_path / "b"), **settings)
    with pytest.raises(AttributeError):  # accelerate: "`AcceleratorState` object has no attribute ..."
        first.train()


@pytest.mark.parametrize("fresh", [False, True])  # the same trainer's cell run again, and a new trainer's
def test_resuming_a_finished_run_is_refused_and_the_model_is_unchanged(tok, tmp_path, fresh):
    """transformers trains one step past `max_steps` when it resumes a checkpoint at `max_steps` (with a constant
    learning rate the weights move): refused before any step. TRL's own trainer, below, takes that step."""
    settings = {**SETTINGS, "max_steps": 4, "save_steps": 2, "lr_scheduler_type": "constant"}
    trainer = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path), **settings), tok)
    trainer.train()
    finished = [parameter.detach().clone() for parameter in trainer.model.parameters()]
    again = build(DHPOTrainer, trainer.args, tok) if fresh else trainer
    with pytest.raises(ValueError):
        again.train(resume_from_checkpoint=True)
    assert again.state.global_step in (0, 4)
    for parameter, before in zip(trainer.model.parameters(), finished):
        torch.testing.assert_close(parameter, before, rtol=0, atol=0)
    trainer.args.max_steps = 6  # raised: the run goes on from step 4
    assert trainer.train(resume_from_checkpoint=True).global_step == 6


def test_resuming_a_run_finished_by_a_fractional_number_of_epochs_is_refused_naming_num_train_epochs(tok, tmp_path):
    """`max_steps=-1`, `num_train_epochs=1.5`: the run ends inside its second epoch; transformers would resume it one
    step past that end. Refused naming num_train_epochs, the weights unchanged; more epochs resume it."""
    settings = {**SETTINGS, "max_steps": -1, "num_train_epochs": 1.5, "save_steps": 2, "lr_scheduler_type": "constant"}
    trainer = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path), **settings), tok)
    end = trainer.train().global_step
    finished = [parameter.detach().clone() for parameter in trainer.model.parameters()]
    with pytest.raises(ValueError) as refused:
        trainer.train(resume_from_checkpoint=True)
    assert f"num_train_epochs=1.5 ends the run at step {end}" in str(refused.value)
    for parameter, before in zip(trainer.model.parameters(), finished):
        torch.testing.assert_close(parameter, before, rtol=0, atol=0)
    trainer.args.num_train_epochs = 2
    assert trainer.train(resume_from_checkpoint=True).global_step > end


def test_trl_trains_one_step_past_max_steps_when_resuming_a_finished_run(tok, tmp_path):
    settings = {**SETTINGS, "max_steps": 4, "save_steps": 2, "lr_scheduler_type": "constant"}
    trainer = build(GRPOTrainer, GRPOConfig(output_dir=str(tmp_path), **settings), tok)
    trainer.train()
    finished = [parameter.detach().clone() for parameter in trainer.model.parameters()]
    assert trainer.train(resume_from_checkpoint=True).global_step == 5
    moved = [(now - before).abs().max().item() for now, before in zip(trainer.model.parameters(), finished)]
    assert max(moved) > 1e-4  # the finished weights changed



@pytest.mark.parametrize("mine, later", [(False, True), (True, False)])  # bf16 for this trainer or the later one
def test_a_trainer_built_since_with_another_mixed_precision_leaves_this_ones_run_unchanged(tok, tmp_path, mine, later):
    """A config and a trainer built after this trainer refill accelerate's process-wide state with their own mixed
    precision: this trainer is not refused and trains as it does alone (same losses, same weights)."""
    settings = {**SETTINGS, "save_strategy": "no", "max_steps": 2}
    alone = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "a"), **{**settings, "bf16": mine}), tok)
    alone.train()
    first = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "b"), **{**settings, "bf16": mine}), tok)
    build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "c"), **{**settings, "bf16": later}), tok)
    first.train()
    losses = [[entry["loss"] for entry in run.state.log_history if "loss" in entry] for run in (first, alone)]
    assert losses[0] == losses[1] and len(losses[0]) == 2
    for ours, reference in zip(first.model.parameters(), alone.model.parameters()):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_an_interrupted_epoch_based_run_resumes_to_its_end(tok, tmp_path):
    """`max_steps=-1` with `num_train_epochs`: a checkpoint before the end resumes (the finished-run refusal reads
    `max_steps` only where it is set) and the run ends where an uninterrupted one does."""
    settings = {**SETTINGS, "max_steps": -1, "num_train_epochs": 1, "save_steps": 2}
    trainer = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "cut"), **settings), tok)
    interrupted(trainer, 3)
    resumed = trainer.train(resume_from_checkpoint=True).global_step
    whole = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "whole"), **settings), tok)
    assert resumed == whole.train().global_step > 3
