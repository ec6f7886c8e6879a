"""A NaN gradient stops `DHPOTrainer.train()` before the optimizer step writes it into the weights
(`stop_on_nonfinite_gradients`, `dhpo_trl/training/nonfinite.py`): the step is named, the parameters are the previous
step's, the last checkpoint resumes; with the setting off the run trains on and the weights go NaN."""

import json
import os
from pathlib import Path

import processes
import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from dhpo_trl import DHPOConfig, DHPOTrainer, NonFiniteGradientError
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3

SCRIPT = Path(__file__).parent / "dist_scripts" / "nonfinite_distributed.py"
DEEPSPEED_SCRIPT = Path(__file__).parent / "dist_scripts" / "nonfinite_deepspeed.py"
REPO = Path(__file__).parent.parent
POISONED_STEP = 2  # the optimizer step (1-based, as checkpoint-<step>) whose gradient forwards return NaN


class AfterStep(TrainerCallback):
    """Copies of the parameters before training and at the end of optimizer step 1."""

    def __init__(self, model):
        self.model, self.before, self.after = model, {}, {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.before = {name: p.detach().clone() for name, p in self.model.named_parameters()}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == POISONED_STEP - 1:
            self.after = {name: p.detach().clone() for name, p in self.model.named_parameters()}


def reward(completions, **kwargs):  # differs within a group: non-zero advantages, so every step moves the weights
    return [float(sum(map(ord, completion)) % 7) for completion in completions]


def build(tmp_path, poison: bool, **settings):
    """A tiny trainer taking 3 off-policy steps of 2 micro-steps; with `poison`, the final norm of every forward that
    takes gradients during step 2 is multiplied by NaN (so the logits, the loss and every gradient are NaN), as a
    kernel returning NaN would; the no-grad generation and old log-prob passes are left alone."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer, hidden_size=32, num_layers=2, seed=0)
    trainer_box = []

    def nan_in_step_2(module, inputs, output):
        if poison and torch.is_grad_enabled() and trainer_box[0].state.global_step == POISONED_STEP - 1:
            return output * float("nan")
        return None

    model.model.norm.register_forward_hook(nan_in_step_2)
    settings = {"save_strategy": "no", "max_steps": 3, **settings}
    args = DHPOConfig(
        str(tmp_path), use_cpu=True, bf16=False, report_to="none", logging_steps=1,
        per_device_train_batch_size=2, num_generations=2, gradient_accumulation_steps=2, steps_per_generation=4,
        max_completion_length=6, learning_rate=1e-2, **settings,
    )  # fmt: skip
    trainer = DHPOTrainer(model, reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["1+1=", "2+3=", "4+4=", "9+1="] * 2}),
                          processing_class=tokenizer)  # fmt: skip
    trainer_box.append(trainer)
    return trainer, model


def all_finite(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])  # the norm from clipping, or computed unclipped
def test_a_nan_gradient_stops_before_the_step_and_the_last_checkpoint_resumes(tmp_path, max_grad_norm):
    trainer, model = build(tmp_path, poison=True, save_strategy="steps", save_steps=1, max_grad_norm=max_grad_norm)
    after = AfterStep(model)
    trainer.add_callback(after)
    with pytest.raises(NonFiniteGradientError) as raised:
        trainer.train()
    error = raised.value
    checkpoint = os.path.join(str(tmp_path), f"checkpoint-{POISONED_STEP - 1}")
    assert error.step == POISONED_STEP and error.checkpoint == checkpoint
    assert error.setting in str(error)
    assert trainer.state.global_step == POISONED_STEP - 1
    assert not os.path.exists(os.path.join(str(tmp_path), f"checkpoint-{POISONED_STEP}"))
    assert after.after, "step 1 did not end"
    assert any(not torch.equal(after.before[name], after.after[name]) for name in after.after)  # step 1 moved them
    for name, parameter in model.named_parameters():  # the optimizer step never ran: step 1's weights, bit for bit
        assert torch.equal(parameter.detach(), after.after[name]), name
    if max_grad_norm:
        return  # the resume once
    resumed, resumed_model = build(tmp_path, poison=False)
    resumed.train(resume_from_checkpoint="latest")
    assert resumed.state.global_step == 3 and all_finite(resumed_model)
    moved = [not torch.equal(p.detach(), after.after[name]) for name, p in resumed_model.named_parameters()]
    assert any(moved)  # steps 2 and 3 ran from the checkpoint


def test_with_the_check_off_the_run_trains_on_into_nan(tmp_path):
    """`stop_on_nonfinite_gradients=False`: transformers' behaviour, the step taken and the weights NaN (a third step
    would sample from them: torch refuses NaN probabilities, far from the cause)."""
    trainer, model = build(tmp_path, poison=True, stop_on_nonfinite_gradients=False, max_steps=POISONED_STEP)
    trainer.train()
    assert trainer.state.global_step == POISONED_STEP
    assert not all_finite(model)


def test_two_processes_stop_at_the_same_step_when_one_sees_the_nan(tmp_path):
    """DDP on 2 CPU processes, the NaN in rank 1's forwards only: both ranks raise for step 2, before the step."""
    result = processes.forked_ranks(SCRIPT, tmp_path, timeout=240)
    dumps = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)
             if (tmp_path / f"rank{rank}.json").exists()]  # fmt: skip
    assert [(d["stopped"], d["unchanged"]) for d in dumps] == [(POISONED_STEP, True)] * 2, result.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]


def test_two_processes_under_deepspeed_stop_at_the_skipped_step_and_refuse_true_without_a_norm(tmp_path):
    """DeepSpeed on 2 CPU processes, the NaN in rank 1's forwards at step 2. ZeRO-2: the engine skips the step inside
    backward and reports an inf norm; both ranks raise for step 2, the message naming DeepSpeed, step 1's weights
    kept. No ZeRO in fp32 (no norm): `True` cannot act and is refused naming the setting on both ranks."""
    pytest.importorskip("deepspeed")
    # No PYTHONPATH: the ranks inherit the fork server's path, and a variable the imports read would start a server
    # of its own (`fork_server.IMPORT_PREFIXES`).
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    result = processes.forked_ranks(DEEPSPEED_SCRIPT, tmp_path, timeout=300, accelerate_cpu=False, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    dumps = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for dump in dumps:
        zero2, zero0 = dump["zero2"], dump["zero0_true"]
        assert (zero2["outcome"], zero2["step"], zero2["norm"]) == ("stopped", POISONED_STEP, float("inf")), zero2
        assert zero2["deepspeed_named"] and zero2["unchanged"] and zero2["finite"], zero2
        assert (zero0["outcome"], zero0["refused_setting"]) == ("refused", True), zero0
