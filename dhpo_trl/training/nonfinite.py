"""Stop a run at the first non-finite gradient norm, before the optimizer step writes NaN into the weights.

transformers' Trainer computes the gradient norm of every optimizer step (`Trainer._get_grad_norm`: the norm before
clipping, handed over after clipping and before `optimizer.step()`) and steps whatever it is: one NaN gradient makes
every parameter NaN and the run goes on training nothing. `DHPOTrainer._get_grad_norm` hands the norm to
`StepCheck`, which returns it or raises `NonFiniteGradientError` naming the step, the norm, the state of the
parameters and the last checkpoint, which `resume_from_checkpoint="latest"` continues from.

Every process takes the same decision without a collective of its own: the norm transformers returns is the global
one on each. Under DDP every process holds the same all-reduced gradients and computes the same norm from them;
FSDP1's `clip_grad_norm_` all-reduces the shards' norms; FSDP2 and expert parallelism combine the shards' norms
over the mesh (accelerate's `_clip_grad_norm_dtensor_aware`, transformers' `_mixed_mesh_grad_norm`; a norm still a
`DTensor` is made whole here, on every process); DeepSpeed returns its engine's global norm, a float (inf when its
overflow check found a non-finite gradient). Reading a tensor norm synchronises with the device once per optimizer
step.

fp16 runs are left to their loss scaler: accelerate's `GradScaler` (DDP, FSDP, one device) and DeepSpeed's loss
scaler skip a step with inf gradients by design and lower the scale, so there an inf norm is routine.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from accelerate.utils import DistributedType

from ..core.config import NONFINITE_SETTING as SETTING, nonfinite_check_applies
from .resume import newest_complete_checkpoint


class NonFiniteGradientError(RuntimeError):
    """The gradient norm of optimizer `step` is not finite; `checkpoint` is the newest complete one, or None."""

    def __init__(self, step: int, norm: float, checkpoint: str | None, stepped: bool = False):
        self.step, self.norm, self.checkpoint, self.setting = step, norm, checkpoint, SETTING
        before = "the initial parameters" if step <= 1 else f"the parameters after step {step - 1}"
        if stepped:  # DeepSpeed's engine steps inside backward, before transformers reads its norm
            state = (f"stopped after DeepSpeed's step, taken inside backward: the model holds {before} only if its "
                     "overflow check skipped the step (ZeRO's default, inf norm)")  # fmt: skip
        else:
            state = f"stopped before the optimizer step: the model holds {before}"
        where = (f"the last checkpoint is {checkpoint} (resume_from_checkpoint='latest' continues from it)"
                 if checkpoint else "no checkpoint has been saved")  # fmt: skip
        super().__init__(f"Non-finite gradient norm {norm} at optimizer step {step}, {state}; {where}. "
                         f"Set {SETTING}=False to train on regardless.")  # fmt: skip


def checked(norm, step: int, check: bool, last_checkpoint: Callable[[], str | None] = lambda: None,
            stepped: bool = False):  # fmt: skip
    """`norm` (a tensor, a float or None) unchanged when finite, missing or `check` is False; else raise
    `NonFiniteGradientError` for optimizer `step`, the step about to run (1-based, as `checkpoint-<step>`)."""
    if not check or norm is None:
        return norm
    whole = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor: the same value on every process
    value = float(whole)
    if math.isfinite(value):
        return norm
    raise NonFiniteGradientError(step, value, last_checkpoint(), stepped)


def loss_scaled(accelerator, fp16: bool) -> bool:
    """Whether an fp16 loss scaler owns inf steps: accelerate's `GradScaler`, or DeepSpeed's with fp16 (which
    transformers makes match `fp16`: `HfTrainerDeepSpeedConfig` refuses a mismatch)."""
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    return getattr(accelerator, "scaler", None) is not None or (deepspeed and bool(fp16))


def without_norm(explicit: bool) -> str:
    """The line saying that no step can be checked, when transformers hands over no norm: DeepSpeed's engine computes
    none in ZeRO stage 0 with fp32 (a plain torch optimizer) or with `zero_optimization.compute_grad_norm` false. An
    explicit `True` cannot act there and is refused, naming the setting."""
    reason = (f"{SETTING}: DeepSpeed reports no gradient norm (ZeRO stage 0 in fp32, or "
              "zero_optimization.compute_grad_norm=false), so no optimizer step can be checked")  # fmt: skip
    if explicit:
        raise ValueError(f"DHPOConfig.{reason}. Train in bf16 or with ZeRO stage 1-3, the norm computed, or leave "
                         f"{SETTING}=None (automatic: off here).")  # fmt: skip
    return f"{reason}; the check is off."


class StepCheck:
    """The trainer's check: what `applies` decided once, whether the setting asked for it explicitly (`True`), and
    where the last checkpoint is looked for. `say` prints (the main process's) one line."""

    def __init__(self, check: bool, output_dir: str, stepped: bool, explicit: bool = False, say=print):
        self.check, self.output_dir, self.stepped, self.explicit, self.say = check, output_dir, stepped, explicit, say

    @classmethod
    def of(cls, args, accelerator) -> StepCheck:
        # transformers turns DeepSpeed's fp16 on for fp16_full_eval too (`HfTrainerDeepSpeedConfig`)
        fp16 = args.fp16 or args.fp16_full_eval
        setting = getattr(args, SETTING)
        check = nonfinite_check_applies(setting, loss_scaled(accelerator, fp16))
        say = print if getattr(accelerator, "is_main_process", True) else (lambda line: None)
        return cls(check, args.output_dir, accelerator.distributed_type == DistributedType.DEEPSPEED,
                   explicit=setting is True, say=say)  # fmt: skip

    def __call__(self, norm, step: int):
        if norm is None and self.check:  # the engine's configuration decides it: the same on every process, every step
            self.say(without_norm(self.explicit))
            self.check = False
        return checked(norm, step, self.check, self.last_checkpoint, self.stepped)

    def last_checkpoint(self) -> str | None:
        """The checkpoint `resume_from_checkpoint="latest"` would take (None: none, or none complete)."""
        try:
            return newest_complete_checkpoint(self.output_dir, warn=lambda message: None)
        except ValueError:  # checkpoints, none complete
            return None
