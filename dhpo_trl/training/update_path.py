"""Which forwards the update runs: TRL's padded micro-batches, dynamic batching, packed rows, or packed rows with
shared prompts. A pure decision from the settings, the models and the device; the trainer only applies it.

`padding_free=True` refuses a model that packed rows would give wrong outputs; `None` (automatic) packs where that
is supported and the faster path known (`packing.automatic_reason`), else keeps dynamic batching and says why;
`share_prompts=True` needs packing to be on and an attention that runs its per-group layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from . import batching, packing, shared_prompts


@dataclass(frozen=True)
class UpdatePath:
    padding_free: bool  # every forward of the update runs on packed rows
    forward: ModuleType | None  # the module whose `packed_forward` runs them (None: padded forwards)
    plan: Callable | None  # plans a generation batch into packed rows (None: dynamic batching's plan)
    note: str | None = None  # one line for the main process: why the automatic choice kept dynamic batching


def choose(padding_free: bool | None, share_prompts: bool, dynamic_batching: bool, models: dict,
           device_type: str) -> UpdatePath:  # fmt: skip
    """`models`: name -> model for the policy and the reference model (None where there is none)."""
    models = {name: model for name, model in models.items() if model is not None}
    for name, model in models.items() if padding_free is True else ():
        reason = packing.unsupported_model_reason(model)
        if reason:
            raise ValueError(f"DHPOConfig.padding_free=True cannot run on this {name}: {reason}. Set "
                             "padding_free=False (dynamic batching) or change the model.")  # fmt: skip
    packed, note = padding_free is True, None
    if padding_free is None and dynamic_batching:
        reason = packing.automatic_reason(list(models.values()), device_type)
        packed = reason is None
        if reason and share_prompts:
            raise ValueError(f"DHPOConfig.share_prompts=True needs padding-free packing, which padding_free=None "
                             f"leaves off here ({reason}): set padding_free=True, or share_prompts=False.")
        if reason:
            note = f"DHPOConfig.padding_free=None (automatic): dynamic batching for this run, since {reason}."
    for name, model in models.items() if share_prompts else ():
        reason = shared_prompts.unsupported_model_reason(model)
        if reason:
            raise ValueError(f"DHPOConfig.share_prompts=True cannot run on this {name}: {reason}. Set "
                             "share_prompts=False or change the model.")  # fmt: skip
    if not packed:
        return UpdatePath(False, None, None, note)
    if share_prompts:  # the same rows with each prompt forwarded once
        return UpdatePath(True, shared_prompts, shared_prompts.plan_generation_batch)
    return UpdatePath(True, packing, batching.plan_packed_generation_batch)
