"""The non-finite gradient check as pure functions (`dhpo_trl/training/nonfinite.py`, `core.config`): which norms stop
a run, for which step, and where the setting acts or is refused."""

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from dhpo_trl import DHPOConfig, NonFiniteGradientError
from dhpo_trl.core.config import NONFINITE_SETTING, nonfinite_check_applies
from dhpo_trl.training import nonfinite, resume

BAD = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("form", [float, torch.tensor, lambda v: torch.tensor(v, dtype=torch.bfloat16)])
@pytest.mark.parametrize("value", BAD)
def test_a_nonfinite_norm_raises_for_the_step_about_to_run(form, value):
    """A float (DeepSpeed) or a tensor (everything else), in any dtype: one error naming the step, the norm and the
    setting that turns the check off, on one line."""
    with pytest.raises(NonFiniteGradientError) as raised:
        nonfinite.checked(form(value), 7, True, lambda: "out/checkpoint-6")
    error = raised.value
    assert error.step == 7 and error.checkpoint == "out/checkpoint-6" and error.setting == NONFINITE_SETTING
    assert (math.isnan(error.norm) and math.isnan(value)) or error.norm == value
    assert NONFINITE_SETTING in str(error) and "checkpoint-6" in str(error) and "\n" not in str(error)


@pytest.mark.parametrize("norm", [0.0, 3.5, 1e30, torch.tensor(2.0), torch.tensor(65504.0, dtype=torch.float16)])
def test_a_finite_norm_is_returned_as_it_came(norm):
    assert nonfinite.checked(norm, 1, True, lambda: pytest.fail("looked for a checkpoint")) is norm


@pytest.mark.parametrize("norm", [float("nan"), torch.tensor(float("inf")), None])
def test_off_or_without_a_norm_nothing_is_checked(norm):
    """`check` False (the setting off, or fp16), or no norm (DeepSpeed without `compute_grad_norm`): unchanged."""
    assert nonfinite.checked(norm, 3, False) is norm
    assert nonfinite.checked(None, 3, True) is None


def test_a_sharded_norm_is_made_whole_before_it_is_read():
    """An FSDP2 norm still a DTensor: `full_tensor()` on every process (a collective), then the value."""

    class Sharded:
        calls = 0

        def full_tensor(self):
            Sharded.calls += 1
            return torch.tensor(float("nan"))

        def __float__(self):
            raise AssertionError("read without full_tensor()")

    with pytest.raises(NonFiniteGradientError):
        nonfinite.checked(Sharded(), 2, True)
    assert Sharded.calls == 1


def test_the_message_says_what_the_parameters_hold():
    first = NonFiniteGradientError(1, float("nan"), None)
    second = NonFiniteGradientError(2, float("nan"), None)
    later = NonFiniteGradientError(5, float("inf"), "o/checkpoint-4")
    deepspeed = NonFiniteGradientError(5, float("inf"), None, stepped=True)
    assert "initial parameters" in str(first) and "no checkpoint" in str(first)
    assert "after step 1" in str(second) and "initial" not in str(second)
    assert "after step 4" in str(later) and "o/checkpoint-4" in str(later)
    assert "DeepSpeed" in str(deepspeed) and "DeepSpeed" not in str(later)


@pytest.mark.parametrize("stepped", [False, True])
def test_the_error_says_whether_deepspeed_stepped_through_every_entry_point(tmp_path, stepped):
    """`stepped` reaches the message from `checked` and from the trainer's `StepCheck`; `checked` without it is a
    check before the optimizer step (every backend but DeepSpeed)."""
    errors = []
    for call in (
        lambda: nonfinite.checked(float("nan"), 3, True, stepped=stepped),
        lambda: nonfinite.StepCheck(True, str(tmp_path), stepped=stepped)(torch.tensor(float("inf")), 3),
    ):
        with pytest.raises(NonFiniteGradientError) as raised:
            call()
        errors.append(str(raised.value))
    with pytest.raises(NonFiniteGradientError) as default:
        nonfinite.checked(float("nan"), 3, True)
    assert ["DeepSpeed" in error for error in errors] == [stepped, stepped]
    assert "DeepSpeed" not in str(default.value) and "before the optimizer step" in str(default.value)


@pytest.mark.parametrize(
    ("setting", "loss_scaled", "applies"),
    [(None, False, True), (None, True, False), (True, False, True), (False, False, False), (False, True, False)],
)
def test_where_the_check_applies(setting, loss_scaled, applies):
    assert nonfinite_check_applies(setting, loss_scaled) is applies


@pytest.mark.parametrize(("setting", "loss_scaled"), [(True, True), ("yes", False), (1, False)])
def test_a_setting_that_cannot_act_is_refused_naming_it(setting, loss_scaled):
    with pytest.raises(ValueError, match=NONFINITE_SETTING):
        nonfinite_check_applies(setting, loss_scaled)


def test_the_config_refuses_true_with_fp16(tmp_path):
    """fp16 cannot be built on CPU, so the flag is set after construction: `validate()` (the trainer's) refuses."""
    args = DHPOConfig(str(tmp_path), use_cpu=True, report_to="none", steps_per_generation=2,
                      stop_on_nonfinite_gradients=True)  # fmt: skip
    args.validate()
    args.fp16 = True
    with pytest.raises(ValueError, match=NONFINITE_SETTING):
        args.validate()
    args.stop_on_nonfinite_gradients = None  # automatic: off under fp16, accepted
    args.validate()
    with pytest.raises(ValueError, match=NONFINITE_SETTING):
        DHPOConfig(str(tmp_path), use_cpu=True, report_to="none", steps_per_generation=2,
                   stop_on_nonfinite_gradients="no")  # fmt: skip


def accelerator(kind=DistributedType.NO, scaler=None):
    return SimpleNamespace(distributed_type=kind, scaler=scaler)


@pytest.mark.parametrize(
    ("acc", "fp16", "scaled"),
    [(accelerator(scaler=object()), False, True), (accelerator(DistributedType.MULTI_GPU, object()), True, True),
     (accelerator(DistributedType.DEEPSPEED), True, True), (accelerator(DistributedType.DEEPSPEED), False, False),
     (accelerator(), False, False), (accelerator(DistributedType.FSDP), False, False)],
)  # fmt: skip
def test_loss_scaling_is_read_from_the_accelerator(acc, fp16, scaled):
    """accelerate's GradScaler is on the accelerator; DeepSpeed's scaler is the engine's, on with fp16."""
    assert nonfinite.loss_scaled(acc, fp16) is scaled


def test_the_trainer_check_refuses_true_under_a_scaler_the_config_could_not_see(tmp_path):
    """fp16 from accelerate's own settings (`accelerate launch --mixed_precision fp16`) with `fp16` False in the
    config: the scaler is on the accelerator, and an explicit True is refused when the trainer is built."""
    args = SimpleNamespace(
        stop_on_nonfinite_gradients=True, fp16=False, fp16_full_eval=False, output_dir=str(tmp_path)
    )
    with pytest.raises(ValueError, match=NONFINITE_SETTING):
        nonfinite.StepCheck.of(args, accelerator(scaler=object()))
    args.stop_on_nonfinite_gradients = None
    assert not nonfinite.StepCheck.of(args, accelerator(scaler=object())).check
    check = nonfinite.StepCheck.of(args, accelerator(DistributedType.DEEPSPEED))
    assert check.check and check.stepped


@pytest.mark.parametrize(("fp16", "fp16_full_eval"), [(True, False), (False, True), (True, True)])
def test_under_deepspeed_fp16_or_fp16_full_eval_leaves_inf_steps_to_its_loss_scaler(tmp_path, fp16, fp16_full_eval):
    """transformers turns DeepSpeed's fp16 (and its loss scaler) on for either flag: the automatic check is off and
    an explicit True is refused; without either flag the check is on (the test above)."""
    args = SimpleNamespace(stop_on_nonfinite_gradients=None, fp16=fp16, fp16_full_eval=fp16_full_eval,
                           output_dir=str(tmp_path))  # fmt: skip
    assert not nonfinite.StepCheck.of(args, accelerator(DistributedType.DEEPSPEED)).check
    args.stop_on_nonfinite_gradients = True
    with pytest.raises(ValueError, match=NONFINITE_SETTING):
        nonfinite.StepCheck.of(args, accelerator(DistributedType.DEEPSPEED))


def test_an_accelerator_without_a_scaler_or_a_process_rank_is_unscaled_and_speaks(tmp_path, capsys):
    """A stand-in accelerator holding only its `distributed_type` (no `scaler`, no `is_main_process`): no loss
    scaler, and it is the main process, so the automatic check's line is printed."""
    bare = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED)
    assert nonfinite.loss_scaled(bare, False) is False
    args = SimpleNamespace(
        stop_on_nonfinite_gradients=None, fp16=False, fp16_full_eval=False, output_dir=str(tmp_path)
    )
    check = nonfinite.StepCheck.of(args, bare)
    assert check.check and check(None, 1) is None
    assert NONFINITE_SETTING in capsys.readouterr().out


def test_the_last_checkpoint_is_the_one_latest_resumes(tmp_path):
    check = nonfinite.StepCheck(True, str(tmp_path), stepped=False)
    assert check.last_checkpoint() is None  # no checkpoint
    (tmp_path / "checkpoint-3").mkdir()  # half-written: not resumable, and `latest` refuses the folder
    assert check.last_checkpoint() is None
    with warnings.catch_warnings():  # the half-written folder is skipped silently: the error names what resumes
        warnings.simplefilter("error")
        assert check.last_checkpoint() is None
    complete = tmp_path / "checkpoint-2"
    complete.mkdir()
    (complete / "optimizer.pt").write_bytes(b"x")
    resume.mark_complete(str(complete), {}, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check.last_checkpoint() == str(complete)
    assert resume.newest_complete_checkpoint(str(tmp_path), lambda _: None) == str(complete)
    with pytest.raises(NonFiniteGradientError) as raised:
        check(torch.tensor(float("nan")), 4)
    assert raised.value.checkpoint == str(complete) and raised.value.step == 4


def test_without_a_norm_an_explicit_true_is_refused_and_automatic_says_once_that_it_is_off(capsys):
    """DeepSpeed without a norm (ZeRO stage 0 in fp32, or `compute_grad_norm` false) hands over None at every step:
    the check cannot act, so `True` is refused naming the setting, and `None` prints one line that the check is off."""
    explicit = nonfinite.StepCheck(True, "out", stepped=True, explicit=True)
    with pytest.raises(ValueError, match=NONFINITE_SETTING):
        explicit(None, 1)
    lines = []
    automatic = nonfinite.StepCheck(True, "out", stepped=True, say=lines.append)
    assert automatic(None, 1) is None and automatic(None, 2) is None
    assert len(lines) == 1 and NONFINITE_SETTING in lines[0] and not automatic.check
    assert "zero_optimization.compute_grad_norm" in lines[0]
    with pytest.raises(NonFiniteGradientError):  # a norm, when there is one, is still checked by an active check
        nonfinite.StepCheck(True, "out", stepped=True, say=lines.append)(float("inf"), 1)
    off = nonfinite.StepCheck(False, "out", stepped=True, explicit=False, say=lines.append)
    assert off(None, 1) is None and len(lines) == 1  # off (False, or fp16): nothing to say


def test_the_trainer_check_knows_an_explicit_true_and_speaks_on_the_main_process_only(tmp_path, capsys):
    args = SimpleNamespace(
        stop_on_nonfinite_gradients=True, fp16=False, fp16_full_eval=False, output_dir=str(tmp_path)
    )
    with pytest.raises(ValueError, match=NONFINITE_SETTING):
        nonfinite.StepCheck.of(args, accelerator(DistributedType.DEEPSPEED))(None, 1)
    args.stop_on_nonfinite_gradients = None
    for main, printed in ((True, 1), (False, 0)):
        acc = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, scaler=None, is_main_process=main)
        nonfinite.StepCheck.of(args, acc)(None, 1)
        assert len([line for line in capsys.readouterr().out.splitlines() if NONFINITE_SETTING in line]) == printed
