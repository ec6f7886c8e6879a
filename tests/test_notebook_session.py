"""A notebook session: one long-lived process that trains, interrupts, trains again and resumes with the same
trainer. Each `train()` without a checkpoint is a run of its own: it generates its first batch itself, never
trains on what an interrupted run left buffered, logs none of that run's metrics, and trains as a new trainer would
from the same weights (adaptive entropy coefficient, random state, optimizer); an interrupted run resumes exactly.
Compared with `trl.GRPOTrainer` where TRL behaves otherwise (it keeps the buffer and the entropy coefficient).

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



def test_max_steps_0_is_refused_where_trl_trains_one_step(tok, tmp_path):
    """transformers counts `max_steps=0` as steps and checks its stop after each step: TRL trains one. Refused in
    one line naming the setting; -1 (epochs) and 1 are accepted."""
    trl = build(GRPOTrainer, GRPOConfig(output_dir=str(tmp_path / "trl"), **{**SETTINGS, "max_steps": 0}), tok)
    assert trl.train().global_step == 1
    with pytest.raises(ValueError, match=r"DHPOConfig\.max_steps=0 "):
        config_for("GRPO", output_dir=str(tmp_path / "dhpo"), **{**SETTINGS, "max_steps": 0})
    assert [config_for("GRPO", output_dir=str(tmp_path), **{**SETTINGS, "max_steps": n}).max_steps
            for n in (-1, 1)] == [-1, 1]  # fmt: skip


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


# The adaptive entropy controller moves its coefficient at every step (the window's entropy is always under the target)
ADAPTIVE = dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_coef_delta=0.05, entropy_target=10.0)


def logged(trainer) -> list[dict]:
    """The run's log entries without the wall-clock figures (`step_time`, `train_runtime`, the rates)."""
    timed = ("time", "runtime", "per_second")
    return [{key: value for key, value in entry.items() if not any(part in key for part in timed)}
            for entry in trainer.state.log_history]  # fmt: skip


def weights(trainer) -> dict:
    return {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}


class SubstepInterrupt(TrainerCallback):
    """A KeyboardInterrupt after the first micro-step of the window of optimizer step `at` + 1, once."""

    def __init__(self, at):
        self.at = at

    def on_substep_end(self, args, state, control, **kwargs):
        if self.at is not None and state.global_step == self.at:
            self.at = None
            raise KeyboardInterrupt


# A finished first run, one interrupted after step 3 (in the middle of a generation batch), and one interrupted in the
# middle of an accumulation window (two micro-steps a step), its entropy window half summed.
CUTS = {"finished": {}, "after step 3": {}, "mid-window": dict(gradient_accumulation_steps=2, steps_per_generation=4)}


@pytest.mark.parametrize("cut", list(CUTS))
def test_a_second_train_is_the_run_a_new_trainer_does_from_the_same_weights(tok, tmp_path, cut):
    """`train()` again without a checkpoint, adaptive entropy on: every logged value (losses, `entropy_coef`,
    rewards, gradient norms) and the final weights equal a new trainer's single run with the same seed from the
    weights the second run starts from. The coefficient starts again at the configured `entropy_coef`."""
    settings = {**SETTINGS, "save_strategy": "no", **ADAPTIVE, **CUTS[cut]}
    trainer = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "again"), **settings), tok)
    if cut == "finished":
        trainer.train()
    elif cut == "after step 3":
        interrupted(trainer, 3)
    else:
        trainer.add_callback(SubstepInterrupt(2))
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        assert trainer.state.global_step == 2
    start = weights(trainer)
    trainer.train()
    new = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "new"), **settings), tok)
    new.model.load_state_dict(start)
    new.train()
    coefficients = [entry["entropy_coef"] for entry in trainer.state.log_history if "entropy_coef" in entry]
    assert coefficients == pytest.approx([0.05 + 0.05 * step for step in range(1, 7)], rel=1e-9)
    assert len(logged(trainer)) == 7 and logged(trainer) == logged(new)
    for name, tensor in weights(trainer).items():
        torch.testing.assert_close(tensor, new.model.state_dict()[name], rtol=0, atol=0)


def test_trl_carries_the_entropy_coefficient_into_a_second_train(tok, tmp_path):
    """What the test above guards against, in `trl.GRPOTrainer` itself: its second run starts from the first run's
    coefficient, not the configured one."""
    settings = {**SETTINGS, "save_strategy": "no", **ADAPTIVE}
    trainer = build(GRPOTrainer, GRPOConfig(output_dir=str(tmp_path), **settings), tok)
    trainer.train()
    trainer.train()
    coefficients = [entry["entropy_coef"] for entry in trainer.state.log_history if "entropy_coef" in entry]
    assert coefficients == pytest.approx([0.05 + 0.05 * step for step in range(7, 13)], rel=1e-9)


def completion_codes(completions, log_metric, **kwargs):
    """Scores nothing; logs a figure of the batch's text (`log_metric`), different for any other batch."""
    log_metric("completion_codes", float(sum(ord(ch) for text in completions for ch in text)))
    return [0.0] * len(completions)


def interrupting_at(step):
    """A reward function after `completion_codes` that raises KeyboardInterrupt in the generation batch of `step`."""
    at = [step]

    def stop_at(completions, trainer_state, **kwargs):
        if trainer_state.global_step == at[0]:
            at[0] = None
            raise KeyboardInterrupt
        return digit_share(completions)

    return stop_at


def test_a_second_train_logs_none_of_the_metrics_an_interrupted_reward_call_left(tok, tmp_path):
    """A KeyboardInterrupt in a reward function after another logged a metric for the batch (`log_metric`): TRL keeps
    that value to log it with the next batch's. The next `train()` logs what a new trainer's run from the same weights
    logs, that metric included."""
    settings = {**SETTINGS, "save_strategy": "no", "max_steps": 4}
    data = Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(24)]})

    def trainer_with(rewards, out):
        args = config_for("DHPO-E", output_dir=str(tmp_path / out), **settings)
        return DHPOTrainer(model=build_tiny_qwen3(tok), reward_funcs=rewards, args=args, processing_class=tok,
                           train_dataset=data)  # fmt: skip

    trainer = trainer_with([completion_codes, interrupting_at(2)], "again")
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.state.global_step == 2
    start = weights(trainer)
    trainer.train()
    new = trainer_with([completion_codes, interrupting_at(None)], "new")
    new.model.load_state_dict(start)
    new.train()
    assert "completion_codes" in logged(trainer)[0] and len(logged(trainer)) == 5
    assert logged(trainer) == logged(new)


def test_a_second_train_logs_none_of_the_metrics_an_interrupted_evaluation_left(tok, tmp_path):
    """A KeyboardInterrupt in the middle of an evaluation inside `train()` (its second batch): the first batch's
    `eval` metrics wait to be logged with the next evaluation's. The next `train()` logs what a new trainer's run
    from the same weights logs, its evaluations included."""
    settings = {**SETTINGS, "save_strategy": "no", "max_steps": 4, "eval_strategy": "steps", "eval_steps": 2,
                "per_device_eval_batch_size": 4}  # fmt: skip
    data = Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(24)]})
    heldout = Dataset.from_dict({"prompt": ["7*7=", "8*8="]})  # two evaluation batches of one prompt each

    def interrupting(completions, prompts, **kwargs):
        if prompts[0] == "8*8=" and not interrupting.done:
            interrupting.done = True
            raise KeyboardInterrupt
        return digit_share(completions)

    interrupting.done = False

    def trainer_with(out):
        args = config_for("DHPO-E", output_dir=str(tmp_path / out), **settings)
        return DHPOTrainer(model=build_tiny_qwen3(tok), reward_funcs=interrupting, args=args, processing_class=tok,
                           train_dataset=data, eval_dataset=heldout)  # fmt: skip

    trainer = trainer_with("again")
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.state.global_step == 2 and interrupting.done
    start = weights(trainer)
    trainer.train()
    new = trainer_with("new")
    new.model.load_state_dict(start)
    new.train()
    evaluations = [entry for entry in logged(trainer) if "eval_reward" in entry]
    assert [entry["step"] for entry in evaluations] == [2, 4]
    assert logged(trainer) == logged(new)


def unwrapped(optimizer):
    """The optimizer accelerate's wrappers hold."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def test_an_optimizer_the_caller_set_or_passed_steps_every_train(tok, tmp_path):
    """An optimizer set on the trainer after it was built (`trainer.optimizer = ...`, as TRL's trainer takes it) or
    passed in `optimizers` is the one every `train()` steps with, first and second, whatever start_fresh makes again:
    the run with one set equals the run with the same one passed (SGD with momentum, not the AdamW transformers
    would make), and the second run goes on with its momentum."""
    settings = {**SETTINGS, "save_strategy": "no", "max_steps": 2}

    def sgd(trainer):
        return torch.optim.SGD(trainer.model.parameters(), lr=0.05, momentum=0.9)

    set_after = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "set"), **settings), tok)
    chosen = set_after.optimizer = sgd(set_after)
    set_after.train()
    args = config_for("DHPO-E", output_dir=str(tmp_path / "passed"), **settings)
    model = build_tiny_qwen3(tok)
    passed = DHPOTrainer(model=model, reward_funcs=digit_share, args=args, processing_class=tok,
                         train_dataset=Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(24)]}),
                         optimizers=(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), None))  # fmt: skip
    given = passed.optimizer
    passed.train()
    assert unwrapped(set_after.optimizer) is chosen and unwrapped(passed.optimizer) is given
    for name, tensor in weights(set_after).items():
        torch.testing.assert_close(tensor, passed.model.state_dict()[name], rtol=0, atol=0)
    for trainer, optimizer in ((set_after, chosen), (passed, given)):
        trainer.train()
        assert unwrapped(trainer.optimizer) is optimizer and len(optimizer.state) > 0  # momentum buffers
    for name, tensor in weights(set_after).items():
        torch.testing.assert_close(tensor, passed.model.state_dict()[name], rtol=0, atol=0)


def test_a_seed_set_after_building_the_trainer_acts_on_its_first_train(tok, tmp_path):
    """The caller seeds after building the trainer (`set_seed(1)`): the first `train()` generates from that seed, as
    `trl.GRPOTrainer` does, not from the configured `seed=0` again."""
    from transformers import set_seed

    settings = {**SETTINGS, "save_strategy": "no", "max_steps": 1}

    def first_completions(trainer_class, reseed=None):
        texts = []

        def recording(completions, **kwargs):
            texts.append(list(completions))
            return digit_share(completions)

        out = str(tmp_path / f"{trainer_class.__name__}-{reseed}")
        args = config_for("DHPO-E", output_dir=out, **settings) if trainer_class is DHPOTrainer else GRPOConfig(
            output_dir=out, **settings)  # fmt: skip
        data = Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(24)]})
        trainer = trainer_class(model=build_tiny_qwen3(tok), reward_funcs=recording, args=args, processing_class=tok,
                                train_dataset=data)  # fmt: skip
        if reseed is not None:
            set_seed(reseed)
        trainer.train()
        return texts[0]

    reseeded = first_completions(DHPOTrainer, reseed=1)
    assert reseeded == first_completions(GRPOTrainer, reseed=1) != first_completions(DHPOTrainer)
    assert first_completions(DHPOTrainer) == first_completions(GRPOTrainer)  # the same generation, seeded alike


def test_a_train_after_a_resumed_run_is_the_run_a_new_trainer_does_from_the_same_weights(tok, tmp_path):
    """Interrupted at step 3, resumed to its end on the same trainer (`resume_from_checkpoint=True`), then `train()`
    again: that run steps from a new optimizer (Adam's step count is its own 6 steps, not 12), as a new trainer's run
    from the same weights does (same logs, same weights)."""
    trainer = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "again"), **SETTINGS), tok)
    interrupted(trainer, 3)
    trainer.train(resume_from_checkpoint=True)
    resumed = unwrapped(trainer.optimizer)
    start = weights(trainer)
    trainer.train()
    new = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "new"), **SETTINGS), tok)
    new.model.load_state_dict(start)
    new.train()
    assert unwrapped(trainer.optimizer) is not resumed
    assert {float(state["step"]) for state in unwrapped(trainer.optimizer).state.values()} == {6.0}
    assert logged(trainer)[-7:] == logged(new)
    for name, tensor in weights(trainer).items():
        torch.testing.assert_close(tensor, new.model.state_dict()[name], rtol=0, atol=0)


class FailsAsTrainingBegins(TrainerCallback):
    """A reporting integration whose setup raises as training begins, once (a tracker not logged in): after
    transformers made and prepared the optimizer, before the trainer's own callbacks see the run begin."""

    def __init__(self):
        self.raised = False

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.raised:
            self.raised = True
            raise RuntimeError("the tracker's setup failed")


def failing_once(method):
    """`method` raising once, as a checkpoint's unreadable scaler state would, then itself."""
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the checkpoint's scaler state could not be read")
        return method(*args, **kwargs)

    return failing


# the failed train(): a new run or a resume (Adam loaded) failing in another callback's on_train_begin, or a resume
# failing as transformers loads the checkpoint, after it made, prepared and loaded the optimizer (before the callbacks
# are handed it)
@pytest.mark.parametrize("attempt", ["fresh", "resumed", "resumed, failing as it loads"])
def test_a_train_after_one_that_failed_as_it_began_is_the_run_a_new_trainer_does(tok, tmp_path, attempt):
    """The first `train()` fails before its run begins; the trainer is used again twice. Each run steps from a new
    optimizer (Adam's step count is its own 2 steps, not the checkpoint's or the last run's added) and the last
    equals a new trainer's run from the same weights (same logs, same weights)."""
    settings = {**SETTINGS, "max_steps": 2}
    if attempt != "fresh":
        build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "saved"), **settings), tok).train()
    trainer = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "again"), **settings), tok)
    if attempt.endswith("loads"):
        trainer._load_scaler = failing_once(trainer._load_scaler)
    else:
        trainer.add_callback(FailsAsTrainingBegins())
    with pytest.raises(RuntimeError):
        trainer.train(resume_from_checkpoint=str(tmp_path / "saved/checkpoint-1") if attempt != "fresh" else None)
    assert trainer.optimizer is not None  # made and prepared before the failure
    for _ in range(2):
        start = weights(trainer)
        trainer.train()
        assert {float(state["step"]) for state in unwrapped(trainer.optimizer).state.values()} == {2.0}
    new = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path / "new"), **settings), tok)
    new.model.load_state_dict(start)
    new.train()
    assert logged(trainer)[-3:] == logged(new)
    for name, tensor in weights(trainer).items():
        torch.testing.assert_close(tensor, new.model.state_dict()[name], rtol=0, atol=0)


def test_an_optimizer_the_caller_sets_after_a_train_that_failed_as_it_began_steps_every_train(tok, tmp_path):
    """The first `train()` fails in another callback's `on_train_begin` (transformers made its optimizer); the caller
    then sets one (SGD with momentum): the next two runs step with it, the second going on with its momentum."""
    settings = {**SETTINGS, "save_strategy": "no", "max_steps": 2}
    trainer = build(DHPOTrainer, config_for("DHPO-E", output_dir=str(tmp_path), **settings), tok)
    trainer.add_callback(FailsAsTrainingBegins())
    with pytest.raises(RuntimeError):
        trainer.train()
    chosen = trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        trainer.train()
        assert unwrapped(trainer.optimizer) is chosen and len(chosen.state) > 0  # momentum buffers
