"""The seam of the update's forwards: TRL's padded micro-batches, dynamic batching, packed rows, or packed rows with
shared prompts, as four implementations of one small interface (`Path`), chosen once by a pure decision (`choose`).

A path plans a generation batch into forward passes (under the processes' agreement: every process runs the same
number), runs a forward and scatters it back to TRL's (B, T) layout, and reports its padding and sharing metrics.
The trainer holds the chosen `UpdatePath` and calls it, never asking which path it is. Another path is one module
with a class like `packing.Packed` plus one line in `choose`.

`padding_free=True` refuses a model that packed rows would give wrong outputs; `None` (automatic) packs where that
is supported and the faster path known (`packing.automatic_reason`), else keeps dynamic batching and says why;
`share_prompts=True` needs packing to be on and an attention that runs its per-group layout. `dynamic_batching=None`
(automatic) keeps TRL's batching, saying why, for a run whose TRL settings dynamic batching cannot serve
(`core.config.trl_batching_reason`); an explicit request for it is refused by the config instead.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from transformers import ProcessorMixin

from ..core.config import planning_requested
from . import batching, cuda_attention, packing, shared_prompts


@dataclass(frozen=True)
class Run:
    """What every path reads of the run."""

    micro_steps: int  # gradient_accumulation_steps: micro-steps of one accumulation window
    budget: int | None  # max_tokens_per_micro_batch
    agree: Callable[[list[int]], list[int]]  # element-wise maximum over processes (one collective)
    window_of: Callable  # batching.planned_windows(...): the aggregation.Window of a planned window
    pad_to_multiple_of: int | None = None
    autocast: Callable = contextlib.nullcontext  # the accelerator's autocast (packed forwards call the model)


class Path(Protocol):
    name: str
    fallback: str  # the settings that chose it, where a batch it cannot plan keeps TRL's micro-batches

    def plan(self, buffered: list[dict], run: Run) -> tuple[list, dict]:
        """TRL's buffered micro-batches -> planned micro-steps (a dict, or a `batching.Passes` of several) and this
        process's metric sums over their forwards (summed over processes by the caller), counted by the plan."""

    def forward(self, model, trl: Callable, input_ids, attention_mask, logits_to_keep: int, batch_size: int | None,
                compute_entropy: bool, compute_aux_loss: bool, run: Run):  # fmt: skip
        """TRL's `(logps, entropies, aux_loss)` in its (B, logits_to_keep) layout. `trl(ids, mask, keep, batch_size,
        entropy, aux)` is TRL's own forward; `batch_size` None: a policy pass over one planned micro-batch."""

    def sums(self, passes: list[dict]) -> dict:
        """This process's padding sums over forward passes (`metrics.padding_sums`), as the path forwards them."""

    def unplanned(self, buffered: list[dict]) -> dict:
        """The metric sums of TRL's own micro-batches, for a batch the path cannot plan: `plan`'s keys, the path's
        own counts (sharing) at zero."""

    def logged(self, sums: dict) -> dict:
        """The logged metrics from the summed `sums`."""


@dataclass
class UpdatePath:
    """The chosen path, applied: a batch the path cannot regroup (multimodal, non-tensor values) keeps TRL's
    micro-batches and forwards, said once."""

    path: Path
    note: str | None = None  # for the main process: why the automatic choice is not the default path
    warned: bool = False
    attention: Callable = contextlib.nullcontext  # around each training step: CUDA leaves cuDNN out (cuda_attention.py)
    attention_note: str | None = None  # the line saying so

    @property
    def notes(self) -> str | None:
        """The lines the main process prints once: the path's note, then the attention's."""
        return "\n".join(note for note in (self.note, self.attention_note) if note) or None

    @property
    def padding_free(self) -> bool:
        return isinstance(self.path, packing.Packed)

    def plan(self, buffered: list[dict], run: Run) -> tuple[list, dict]:
        """The planned micro-steps and this process's metric sums (the same keys on every process)."""
        reason = batching.unsupported_reason(buffered[0]) if self.path is not batching.PADDED else None
        if reason is None:
            return self.path.plan(buffered, run)
        if not self.warned:
            warnings.warn(f"{self.path.fallback} TRL's micro-batches for this run: {reason}.", stacklevel=3)
            self.warned = True
        return buffered, self.path.unplanned(buffered)

    def forward(self, model, trl: Callable, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, multimodal: dict, run: Run):  # fmt: skip
        if any(value is not None for value in multimodal.values()):
            return trl(input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                       **multimodal)  # fmt: skip
        return self.path.forward(model, trl, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                                 compute_aux_loss, run)  # fmt: skip

    def logged(self, sums: dict) -> dict:
        return self.path.logged(sums)


# The dataset columns TRL reads images from (`GRPOTrainer._generate_and_score_completions`).
IMAGE_COLUMNS = ("image", "images")


def refuse_multimodal_planning(args, processing_class, train_dataset) -> None:
    """With a `ProcessorMixin` processing class, TRL forwards image inputs (`batching.UNSUPPORTED_KEYS`) with every
    batch that has an image from the dataset's `image` / `images` column; such batches keep TRL's micro-batches, so an
    explicit request for planned ones could not act and is refused. Text-only rows carry no image input and are
    planned: a vision-language model on a text-only dataset is not refused."""
    if not isinstance(processing_class, ProcessorMixin) or not _may_hold_images(train_dataset):
        return
    asked = [f"{name}={getattr(args, name)!r}" for name, wanted in planning_requested(args).items() if wanted]
    if asked:
        raise ValueError(f"DHPOConfig.{', '.join(asked)} cannot act with the vision-language processor "
                         f"{type(processing_class).__name__}: its batches carry image inputs, which keep TRL's "
                         "micro-batches. Leave these settings at their defaults, or set dynamic_batching=False.")


def refuse_planning_passed(init: Callable, *call_args, **call_kwargs) -> None:
    """`refuse_multimodal_planning` before any model loads, on the `args`, processing class and training dataset of
    the call `init(*call_args, **call_kwargs)` (`GRPOTrainer.__init__`), passed by position or by name. A processing
    class that TRL loads itself (None passed) is checked once it is loaded."""
    passed = inspect.signature(init).bind(*call_args, **call_kwargs).arguments
    refuse_multimodal_planning(passed["args"], passed.get("processing_class"), passed.get("train_dataset"))


def _may_hold_images(dataset) -> bool:
    """Whether TRL may read images from `dataset`'s rows (unknown columns, as a streamed dataset may have: yes)."""
    if dataset is None:
        return False
    columns = getattr(dataset, "column_names", None)
    return columns is None or any(column in columns for column in IMAGE_COLUMNS)


def choose(padding_free: bool | None, share_prompts: bool, dynamic_batching: bool | None, models: dict,
           device_type: str, trl_only: str | None = None, uncompiled: str | None = None) -> UpdatePath:  # fmt: skip
    """`models`: name -> model for the policy and the reference model (None where there is none). `trl_only`: why
    dynamic batching cannot serve this run's TRL settings (`core.config.trl_batching_reason`), or None. `uncompiled`:
    why `torch_compile` would not act on packed rows (`core.config.compiled_packing_reason`), or None: the automatic
    choice then keeps dynamic batching. Every path gets the attention context of `cuda_attention.for_update`."""
    chosen = _choose(padding_free, share_prompts, dynamic_batching, models, device_type, trl_only, uncompiled)
    chosen.attention, chosen.attention_note = cuda_attention.for_update(device_type)
    return chosen


def _choose(padding_free, share_prompts, dynamic_batching, models, device_type, trl_only, uncompiled) -> UpdatePath:
    models = {name: model for name, model in models.items() if model is not None}
    if dynamic_batching is False:
        return UpdatePath(batching.PADDED)
    if trl_only is not None:  # the config refuses an explicit request: only the automatic choice gets here
        return UpdatePath(batching.PADDED, f"DHPOConfig.dynamic_batching=None (automatic): TRL's batching for this "
                                           f"run, since {trl_only}.")  # fmt: skip
    packed, note = _packs(padding_free, share_prompts, models, device_type, uncompiled)
    for name, model in models.items() if share_prompts else ():
        reason = shared_prompts.unsupported_model_reason(model)
        if reason:
            raise ValueError(f"DHPOConfig.share_prompts=True cannot run on this {name}: {reason}. Set "
                             "share_prompts=False or change the model.")  # fmt: skip
    if not packed:
        return UpdatePath(batching.DYNAMIC, note)
    return UpdatePath(shared_prompts.SHARED if share_prompts else packing.PACKED)


def _packs(padding_free: bool | None, share_prompts: bool, models: dict, device_type: str,
           uncompiled: str | None = None) -> tuple[bool, str | None]:  # fmt: skip
    """Whether the forwards run on packed rows, and the line that says why the automatic choice does not pack."""
    for name, model in models.items() if padding_free is True else ():
        reason = packing.unsupported_model_reason(model)
        if reason:
            raise ValueError(f"DHPOConfig.padding_free=True cannot run on this {name}: {reason}. Set "
                             "padding_free=False (dynamic batching) or change the model.")  # fmt: skip
    if padding_free is not None:
        return padding_free, None
    reason = packing.automatic_reason(list(models.values()), device_type) or uncompiled
    if reason and share_prompts:
        raise ValueError(f"DHPOConfig.share_prompts=True needs padding-free packing, which padding_free=None "
                         f"leaves off here ({reason}): set padding_free=True, or share_prompts=False.")
    if reason:
        return False, f"DHPOConfig.padding_free=None (automatic): dynamic batching for this run, since {reason}."
    return True, None
