"""Exact resume from any checkpoint, and a graceful stop on SIGTERM / SIGUSR1.

TRL keeps the rest of the current generation batch (`_buffered_inputs`) and its micro-step counter (`_step`) only in
memory, so a run resumed from a checkpoint in the middle of a generation batch regenerates at the wrong phase and
sees other data from then on. Here:

* **generation state**: every process writes `dhpo_generation_state_rank{r}.pt` into the checkpoint: TRL's `_step`,
  the not-yet-consumed micro-batches (whatever `_buffered_inputs` holds, recursively: dicts, lists,
  `batching.Passes`, tensors with their device, numbers), the adaptive entropy controller and the metrics not yet
  logged. `restore_generation_state` puts them back before training resumes.
* **loss accumulators**: transformers' `_tr_loss`, `_total_loss_scalar` and `_globalstep_last_logged` (reset when
  training starts, after the restore) are in the same file and put back when training begins, so the logged `loss`
  between logging steps and the final `train_loss` are the uninterrupted run's.
* **reference model**: with `sync_ref_model`, the reference model TRL mixes with the policy is saved whole
  (`dhpo_reference_model.safetensors`, gathered under ZeRO-3) and loaded back.
* **policy weights**: `save_pretrained` writes an MoE model's fused experts one by one; `load_policy_weights`
  converts a checkpoint's weights back to the model's layout with transformers' own conversion (the Trainer's load
  would leave the experts unloaded), on resume and for `load_best_model_at_end`.
* **completeness**: the main process writes `dhpo_checkpoint_complete.json` last, after every process wrote its
  files; it records the run's settings and the size of every file. A folder holding our files but not the marker
  was left half-written, and one whose files differ from the recorded sizes was damaged since: neither is loaded.
  A checkpoint from before the marker (no file of ours) counts as complete when transformers' `trainer_state.json`
  (written after weights, optimizer and RNG states) is there.
* **settings**: a resume whose objective, batch geometry, world size, data order, generation-buffer content
  (reference log-probs, vLLM correction, reward shaping, batching layout) or TRL loss terms and masks (KL weight,
  off-policy and top-entropy masks, entropy bonus, router loss) differs from the checkpoint's is refused,
  before any model loads when `resolve_for_run` is called first (as `dhpo-train` does).
* **writing**: `write_checkpoint` is transformers' checkpoint sequence with our files, the marker last and the
  rotation of old checkpoints after it, deciding `save_only_model` per checkpoint without touching `args`.
* **graceful stop**: `stop_on_signals` installs handlers for the duration of `train()` only; the first signal sets
  a flag, a second one stops at once. `GracefulStopCallback` agrees on the flag across processes once per optimizer
  step (one all-reduce of one number, on every process) and asks the Trainer to save and stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import set_seed
from transformers import TrainerCallback

from ..core import aggregation, entropy_control
from ..core.objectives import OBJECTIVE_SETTINGS, get_objective
from . import batching

GENERATION_STATE = "dhpo_generation_state_rank{rank}.pt"
COMPLETE_MARKER = "dhpo_checkpoint_complete.json"
REFERENCE_MODEL = "dhpo_reference_model.safetensors"
TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME, written after weights, optimizer and RNG
FORMAT = 1  # of the generation-state files (keys added later are optional)
MARKER_FORMAT = 4  # 2: the marker records BUFFER_SETTINGS and the files' sizes; 3: padding_free as resolved;
# 4: LOSS_SETTINGS. A setting is compared only with a marker of the format that records it, so an older checkpoint
# still resumes without it (RECORDED_FROM).
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_STATE_FILE = re.compile(r"^dhpo_generation_state_rank\d+\.pt$")

# Settings that must be equal to resume: the objective (and its own settings, added per algorithm), the batch
# geometry that decides how a generation batch is cut into micro-batches, and the number of processes (one
# generation-state file each). Anything else (learning rate, logging, ...) may change on resume.
RESUME_SETTINGS = (
    "algorithm", "loss_type", "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
    "num_generations", "num_iterations", "dynamic_batching", "max_tokens_per_micro_batch",
)  # fmt: skip
WORLD_SIZE = "world_size"
# Settings that decide what the buffered generation batch holds, or the data order, recorded from MARKER_FORMAT 2:
# the reference log-probs and the synced reference model (`beta`, `sync_ref_model`), the temperature the buffered
# log-probs were computed at, the vLLM importance-sampling ratios, the advantages and masks (reward shaping), the
# planned layout of the micro-batches, the sampler's order.
BUFFER_SETTINGS = (
    "beta", "sync_ref_model", "temperature", "use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max", "scale_rewards", "reward_weights",
    "multi_objective_aggregation", "mask_truncated_completions", "padding_free", "share_prompts", "shuffle_dataset",
    "seed",
)  # fmt: skip
# TRL settings outside the objective's that change the loss of the same buffered batch, recorded from MARKER_FORMAT 4
# where they act (`loss_settings`): the KL's importance weight (with beta != 0), the off-policy sequence mask, the
# top-entropy token mask, the entropy bonus (its coefficient, which the generation state restores over the value
# passed, and whether a controller moves it), the MoE router's auxiliary loss and dr_grpo's normaliser. The adaptive
# controller's target, step and bounds steer the coefficient from the resumed step on, as a schedule does, and the
# reference model's mix and sync interval act from its next sync: those may change.
LOSS_SETTINGS = (
    "use_bias_correction_kl", "off_policy_mask_threshold", "top_entropy_quantile", "entropy_coef",
    "use_adaptive_entropy", "router_aux_loss_coef", "max_completion_length",
)  # fmt: skip
# The first marker format recording each group: an older marker is checked without that group.
RECORDED_FROM = ((2, BUFFER_SETTINGS), (4, LOSS_SETTINGS))
# Recorded, not compared: they change no buffered batch themselves, but with gradient checkpointing torch_compile keeps
# an automatic padding_free on dynamic batching (`core.config.compiled_packing_reason`). Where the resolved update
# path differs, the refusal names the one of them that changed it.
PATH_CAUSES = ("torch_compile", "gradient_checkpointing")
AUX_LOSS = "router_aux_loss_coef"

# Trainer attributes that change during training and decide what later steps do. `_last_loaded_step` (vLLM) is
# deliberately not here: after a resume the server must receive the resumed weights before it generates.
TRAINER_ATTRIBUTES = ("_step", "_buffered_inputs", "entropy_coef", "_last_world_entropy", "_entropy_window_stats")
# transformers' loss accumulators: set when the training loop starts (after any restore), so put back at train begin.
LOSS_ACCUMULATORS = ("_tr_loss", "_total_loss_scalar", "_globalstep_last_logged")


# ----------------------------------------------------------------------------------------------- settings
def run_settings(args, world_size: int, packed: bool | None = None, aux_default: float | None = None) -> dict:
    """The settings a resume must agree with (see `RESUME_SETTINGS`), with the objective's own settings, and
    `PATH_CAUSES` (not compared).

    `dynamic_batching` and `padding_free` are the update path that runs, not the values passed: the buffered
    micro-batches are laid out for it. `packed`: whether the trainer's chosen path packs; None before the models
    load, when an automatic `padding_free=None` is still undecided (recorded as None, compared once decided), unless
    torch_compile with gradient checkpointing decides it: dynamic batching whatever the models (`update_path._packs`).
    `router_aux_loss_coef` is the coefficient that acts: None stands for `aux_default` (`aux_loss_default` of the
    policy), and stays None (undecided) before the models load."""
    from ..core.config import compiled_packing_reason, uses_dynamic_batching
    from ..core.objectives import get_objective

    packed = False if packed is None and compiled_packing_reason(args) else packed
    names = (*RESUME_SETTINGS, *get_objective(args.algorithm).settings(args), *BUFFER_SETTINGS, *loss_settings(args),
             *PATH_CAUSES)  # fmt: skip
    settings = {name: _plain(getattr(args, name, None)) for name in dict.fromkeys(names)}
    settings["dynamic_batching"] = uses_dynamic_batching(args)
    settings["padding_free"] = resolved_padding_free(args.padding_free, settings["dynamic_batching"], packed)
    settings[AUX_LOSS] = acting_aux_loss(settings[AUX_LOSS], aux_default)
    settings[WORLD_SIZE] = int(world_size)
    return settings


def decided(trainer) -> dict:
    """What `trainer` decided of the settings left automatic, as `run_settings` and `resolve_for_run` take it."""
    return {"packed": trainer._update.padding_free, "aux_default": aux_loss_default(trainer.model)}


def aux_loss_default(model) -> float:
    """The coefficient `router_aux_loss_coef=None` stands for with `model`, as TRL's `GRPOTrainer` resolves it: the
    coefficient its config declares where it returns router logits (a Mixture-of-Experts model), else 0.0 (no
    auxiliary loss: TRL adds none, whatever the config declares, and refuses another value)."""
    config = model.config.get_text_config()
    if not hasattr(config, "output_router_logits"):
        return 0.0
    return float(getattr(config, AUX_LOSS, None) or 0.0)


def acting_aux_loss(value, default: float | None):
    """`router_aux_loss_coef` as it acts: None is `default` (None: not known yet, before the models load)."""
    if value is None:
        return default
    return float(value)


def loss_settings(args) -> tuple[str, ...]:
    """The `LOSS_SETTINGS` that act for `args`: `use_bias_correction_kl` weighs the KL term only (beta != 0),
    `max_completion_length` divides the loss only under loss_type='dr_grpo' (elsewhere it bounds what is generated
    next, and may change)."""
    kl = ("use_bias_correction_kl",) if args.beta != 0.0 else ()
    normaliser = ("max_completion_length",) if args.loss_type == "dr_grpo" else ()
    return (*kl, "off_policy_mask_threshold", "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy",
            "router_aux_loss_coef", *normaliser)  # fmt: skip


def loss_settings_read(settings: dict) -> tuple[str, ...]:
    """`loss_settings` of the run whose `run_settings` are `settings`; all of `LOSS_SETTINGS` where they do not
    hold what decides it (beta, loss_type)."""
    if "beta" not in settings or "loss_type" not in settings:
        return LOSS_SETTINGS
    return loss_settings(SimpleNamespace(beta=settings["beta"], loss_type=settings["loss_type"]))


def resolved_padding_free(padding_free: bool | None, dynamic: bool, packed: bool | None) -> bool | None:
    """Whether the forwards run on packed rows: never without dynamic batching; `packed` (the chosen path) where
    known; else the value passed, None (automatic) staying undecided."""
    if not dynamic:
        return False
    return padding_free if packed is None else bool(packed)


def _defaults() -> dict:
    from ..core.config import DHPOConfig

    fields = dataclasses.fields(DHPOConfig)
    return {field.name: field.default for field in fields if field.init and field.default is not dataclasses.MISSING}


def _plain(value):
    """A setting as JSON writes and reads it back (a tuple of reward weights compares as the list it becomes)."""
    return list(value) if isinstance(value, tuple) else value


def settings_difference(saved: dict, current: dict) -> list[str]:
    """Names of the settings whose values differ (a setting missing on one side differs)."""
    return [name for name in dict.fromkeys([*saved, *current]) if saved.get(name) != current.get(name)]


# ------------------------------------------------------------------------------------ checkpoint discovery
def checkpoint_step(path: str) -> int | None:
    match = _CHECKPOINT.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def incomplete_reason(path: str) -> str | None:
    """Why the checkpoint folder `path` cannot be resumed (None: complete)."""
    if not os.path.isdir(path):
        return "it is not a folder"
    names = set(os.listdir(path))
    if COMPLETE_MARKER in names:
        marker = read_marker(path) or {}
        damaged = file_mismatch(path, marker.get("files") or {})
        if damaged is not None:
            return damaged
        weights_only = bool(marker.get("save_only_model"))
    elif any(_STATE_FILE.match(name) for name in names):  # written by this version, the marker never came
        return f"it has no {COMPLETE_MARKER} (the save was interrupted)"
    elif TRAINER_STATE not in names:
        return f"it has no {TRAINER_STATE} (not a checkpoint, or its save was interrupted)"
    else:  # written before the marker existed: transformers' last file is there
        weights_only = not any(name.startswith(("optimizer", "global_step")) for name in names)
    if weights_only:
        return ("it holds the weights only (save_only_model: true), without the optimizer and RNG states a resume "
                "needs; save with --save_only_model false to resume")  # fmt: skip
    return None


def file_sizes(path: str) -> dict[str, int]:
    """Every file under the checkpoint folder `path` (relative path -> bytes), the marker and temporaries left out."""
    sizes = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            relative = os.path.relpath(full, path).replace(os.sep, "/")
            if relative != COMPLETE_MARKER and not name.endswith(".tmp"):
                sizes[relative] = os.path.getsize(full)
    return dict(sorted(sizes.items()))


def file_mismatch(path: str, recorded: dict[str, int]) -> str | None:
    """Why the files of `path` differ from the sizes the marker `recorded` (None: they match). A truncated weights
    or state file under an intact marker is caught here, before anything loads it."""
    for relative, size in recorded.items():
        full = os.path.join(path, *relative.split("/"))
        if not os.path.isfile(full):
            return f"its file {relative} is missing (the marker records {size} bytes)"
        actual = os.path.getsize(full)
        if actual != size:
            return f"its file {relative} has {actual} bytes, the marker records {size} (truncated or overwritten)"
    return None


def read_marker(path: str) -> dict | None:
    """The completeness marker's content (the run's settings and step), or None for an older checkpoint."""
    marker = os.path.join(path, COMPLETE_MARKER)
    if not os.path.isfile(marker):
        return None
    with open(marker, encoding="utf-8") as handle:
        return json.load(handle)


def newest_complete_checkpoint(output_dir: str, warn: Callable[[str], None] | None = None) -> str | None:
    """The resumable `checkpoint-<step>` folder of `output_dir` with the highest step; half-written and weights-only
    ones are skipped with a warning (`warn`, default `warnings.warn`). None when `output_dir` holds no checkpoint
    folder; a ValueError when it holds some but none can be resumed (a fresh start would overwrite them)."""
    warn = warn or (lambda message: warnings.warn(message, stacklevel=3))
    if not os.path.isdir(output_dir):
        return None
    found = sorted(
        ((checkpoint_step(name), os.path.join(output_dir, name)) for name in os.listdir(output_dir)
         if checkpoint_step(name) is not None and os.path.isdir(os.path.join(output_dir, name))),
        reverse=True,
    )  # fmt: skip
    for _, path in found:
        reason = incomplete_reason(path)
        if reason is None:
            return path
        warn(f"Skipping {path}: {reason}.")
    if found:  # starting again from step 0 would overwrite them: refuse instead
        raise ValueError(
            f"output_dir {output_dir} holds checkpoints but none can be resumed (the newest: {found[0][1]}: "
            f"{incomplete_reason(found[0][1])}). Pass one with --resume_from_checkpoint, or a new output_dir."
        )
    return None


def resolve_checkpoint(value, output_dir: str, warn: Callable[[str], None] | None = None) -> str | None:
    """What `resume_from_checkpoint` names: None/False/"false" -> None (a fresh run); True/"true" -> the newest
    complete checkpoint in `output_dir` (an error if none, as transformers); "latest" -> the same, or None when
    `output_dir` holds none yet (a requeued job and its first launch run the same command); a path -> that path,
    which must be a complete checkpoint."""
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("", "false", "no")):
        return None
    wanted = value if isinstance(value, bool) else value.strip()
    if wanted is True or str(wanted).lower() in ("true", "yes", "latest"):
        path = newest_complete_checkpoint(output_dir, warn)
        if path is None and str(wanted).lower() != "latest":
            raise ValueError(
                f"--resume_from_checkpoint {value}: no complete checkpoint-<step> folder in output_dir {output_dir}; "
                "pass `latest` to start from scratch when there is none."
            )
        return path
    if not os.path.isdir(wanted):
        raise ValueError(f"--resume_from_checkpoint {wanted} is not a folder: pass a checkpoint-<step> directory, or "
                         "`latest` for the newest complete one in output_dir.")  # fmt: skip
    reason = incomplete_reason(wanted)
    if reason is not None:
        raise ValueError(
            f"--resume_from_checkpoint {wanted} cannot be resumed: {reason}. Pass a complete checkpoint-<step> "
            "folder, or `latest` for the newest complete one in output_dir."
        )
    return wanted


DEFAULTS = _defaults()


def check_resumable(path: str, current: dict, requested_padding_free: bool | None = None,
                    aux_default: float | None = None) -> None:  # fmt: skip
    """Refuse to resume `path` under other settings (`current`: `run_settings` of this run), naming them.
    `requested_padding_free`: `padding_free` as this run passes it, which reads a marker of format 2. `aux_default`:
    what `router_aux_loss_coef=None` stands for here (`aux_loss_default`; None before the models load)."""
    marker = read_marker(path)
    if marker is None:  # older checkpoint: no settings recorded (restore_generation_state warns once)
        return
    saved, current = update_path_settings(marker, current, requested_padding_free)
    saved, current = aux_loss_settings(saved, current, aux_default)
    causes = [{name: side.pop(name) for name in PATH_CAUSES if name in side} for side in (saved, current)]
    # A setting first recorded by a later marker format is compared on neither side (RECORDED_FROM).
    unrecorded = {name for since, names in RECORDED_FROM if marker.get("format", 1) < since for name in names}
    # A loss setting one side does not read follows a beta or loss_type that differs, which is named instead.
    unrecorded |= set(loss_settings_read(saved)) ^ set(loss_settings_read(current))
    saved, current = ({name: value for name, value in side.items() if name not in unrecorded}
                      for side in (saved, current))  # fmt: skip
    # An objective setting the checkpoint's settings did not record (read by that objective in a later version, e.g.
    # CISPO's importance_sampling_level) ran at its default: compared as that. One this run's objective does not read
    # is at its default (the config refuses any other value); the checkpoint's is compared as that, unless the
    # checkpoint's own objective does not read it either (it had no effect there). A marker with no settings refuses
    # all.
    if saved:
        unread = unread_by_recorded_objective(saved)
        saved = {name: value for name, value in saved.items() if name not in unread or name in current}
        saved = {**{name: _plain(DEFAULTS[name]) for name in current
                 if name in OBJECTIVE_SETTINGS and name in DEFAULTS}, **saved}
        current = {**{name: _plain(DEFAULTS[name]) for name in saved
                      if name in OBJECTIVE_SETTINGS and name in DEFAULTS}, **current}
    differ = settings_difference(saved, current)
    if differ:
        listed = ", ".join(f"{name}={saved.get(name)!r} in the checkpoint but {current.get(name)!r} now" for name in differ)
        resolved = {"padding_free", "dynamic_batching"} & set(differ)
        automatic = "padding_free" in resolved and requested_padding_free is None  # else the value passed decided
        cause, changed = path_cause(*causes) if automatic else (None, {})
        path_ran = f"{' and '.join(sorted(resolved))}: the update path that ran, as resolved{cause or ''}"
        hint = f" ({path_ran})" if resolved else ""
        ran = ", ".join(f"{name}={value!r}" for name, value in changed.items())
        advice = f"Resume with {ran}, as the checkpoint ran" if changed else "Resume with the checkpoint's settings"
        raise ValueError(f"--resume_from_checkpoint {path}: {listed}{hint}. {advice}, or train into a new output_dir.")


def path_cause(saved: dict, current: dict) -> tuple[str | None, dict]:
    """Whether the automatic padding_free resolved otherwise because `PATH_CAUSES` changed (`saved`, `current`: their
    values on each side): the clause naming the changed ones and how they decide the path, and their checkpoint
    values; (None, {}) where they did not change it, or the marker did not record them."""
    from ..core.config import compiled_packing_reason

    if set(saved) != set(PATH_CAUSES) or set(current) != set(PATH_CAUSES):
        return None, {}
    reasons = [compiled_packing_reason(SimpleNamespace(**side)) for side in (saved, current)]
    if (reasons[0] is None) == (reasons[1] is None):
        return None, {}
    changed = {name: saved[name] for name in PATH_CAUSES if saved[name] != current[name]}
    named = " and ".join(f"{name}={saved[name]!r} in the checkpoint but {current[name]!r} now" for name in changed)
    kept = "keeps" if reasons[1] else "kept, in the checkpoint,"
    return f"; {named} changed it: {reasons[1] or reasons[0]}, so padding_free=None {kept} dynamic batching", changed


def aux_loss_settings(saved: dict, current: dict, default: float | None) -> tuple[dict, dict]:
    """`router_aux_loss_coef` made comparable as it acts (`acting_aux_loss`): None, as an older marker recorded it
    passed, is `default`. Where that is not known yet (before the models load), a None on either side takes the
    other side's value here; the trainer compares again once it knows."""
    if AUX_LOSS not in saved or AUX_LOSS not in current:
        return saved, current
    saved, current = dict(saved), dict(current)
    saved[AUX_LOSS], current[AUX_LOSS] = (acting_aux_loss(side[AUX_LOSS], default) for side in (saved, current))
    if saved[AUX_LOSS] is None or current[AUX_LOSS] is None:
        current[AUX_LOSS] = saved[AUX_LOSS]
    return saved, current


class _Unrecorded(Exception):
    """The objective's reading depends on a setting the marker does not hold."""


def unread_by_recorded_objective(saved: dict) -> set[str]:
    """The objective settings a marker's `saved` settings hold that their own objective, as those settings define it,
    does not read: they could not act (versions that listed DHPO-A's sequence epsilons at token_weight=1 recorded
    them). Empty where the reading depends on a setting the marker does not hold (VESPO's use_bias_correction_kl,
    recorded from MARKER_FORMAT 4)."""

    class Recorded:
        def __getattr__(self, name):
            if name not in saved:
                raise _Unrecorded(name)
            return saved[name]

    try:
        read = set(get_objective(saved.get("algorithm")).settings(Recorded()))
    except (_Unrecorded, ValueError):
        return set()
    return {name for name in saved if name in OBJECTIVE_SETTINGS and name not in read}


def update_path_settings(marker: dict, current: dict, requested: bool | None) -> tuple[dict, dict]:
    """The marker's settings and `current`, `padding_free` made comparable. A marker of format 2 recorded it as
    passed: True or False resolve as they ran; None (automatic), whose choice it did not record, resumes under
    `requested` None and is refused otherwise. An undecided `current` (None: `run_settings` before the models load)
    takes the checkpoint's value here; the trainer compares the choice it makes."""
    saved, current = dict(marker.get("settings", {})), dict(current)
    if "padding_free" in saved and marker.get("format", 1) < 3:
        saved["padding_free"] = resolved_padding_free(saved["padding_free"], saved.get("dynamic_batching") is not False,
                                                      None)  # fmt: skip
        if saved["padding_free"] is None:
            current["padding_free"] = requested
    if current.get("padding_free", False) is None and saved.get("padding_free") is not None:
        current["padding_free"] = saved["padding_free"]
    return saved, current


def resolve_for_run(value, args, world_size: int, main: bool = True, packed: bool | None = None,
                    aux_default: float | None = None) -> str | None:  # fmt: skip
    """The one place `resume_from_checkpoint` is resolved (the command, before any model loads, and `train()`):
    the checkpoint `value` names (see `resolve_checkpoint`), refused when saved under other settings than `args`
    with `world_size` processes (`packed`, `aux_default`: see `run_settings`; `decided`). Skipped folders are warned
    about and the outcome printed on the main process."""
    fsdp = bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")
    if args.sync_ref_model and fsdp and (args.save_strategy != "no" or value not in (None, False)):
        raise ValueError("sync_ref_model under FSDP: the synced reference model cannot be saved in or restored from a "
                         "checkpoint; use DeepSpeed ZeRO-3 or DDP, or save_strategy='no'.")  # fmt: skip
    warn = (lambda message: warnings.warn(message, stacklevel=4)) if main else (lambda message: None)
    checkpoint = resolve_checkpoint(value, args.output_dir, warn)
    if checkpoint is None:
        if main and str(value).strip().lower() == "latest":
            print(f"resume_from_checkpoint=latest: no checkpoint in {args.output_dir} yet, training from step 0.")
        return None
    check_resumable(checkpoint, run_settings(args, world_size, packed, aux_default), args.padding_free, aux_default)
    check_unfinished(checkpoint, args.max_steps)
    return checkpoint


def check_unfinished(checkpoint: str, max_steps: int, setting: str | None = None) -> None:
    """Refuse to resume a checkpoint at or past `max_steps`: transformers would train one optimizer step more
    (its loop skips the checkpoint's batches, then takes the next step before it checks `max_steps`), changing the
    finished model, as a notebook cell run again after the run ended would. `max_steps < 0` (epochs; 0 is refused
    by the config): nothing to check before the data loader exists; `restore` checks the steps the epochs make
    (`setting`: the setting that set them, named in the refusal; default `max_steps=N`)."""
    step = saved_global_step(checkpoint)
    if 0 < max_steps <= step:
        setting = setting or f"max_steps={max_steps}"
        name = setting.split("=")[0]
        raise ValueError(f"{checkpoint} is at step {step} and {setting} ends the run at step {max_steps}: that run is "
                         f"finished; raise {name} to train it further.")  # fmt: skip


def saved_global_step(checkpoint: str) -> int:
    """The optimizer steps `checkpoint` was saved after: transformers' `global_step` in its trainer state (the folder's
    name says the same, `checkpoint_step`, but a renamed folder keeps its state)."""
    with open(os.path.join(checkpoint, TRAINER_STATE), encoding="utf-8") as handle:
        return json.load(handle)["global_step"]


def check_epochs_unfinished(trainer, checkpoint: str) -> None:
    """`check_unfinished` for a run that `num_train_epochs` bounds (`max_steps < 0`), with the step count
    transformers derives from the data loader (a fractional number of epochs ends inside an epoch)."""
    args = trainer.args
    if args.max_steps > 0:  # checked with the settings, before the models load
        return
    steps = trainer.set_initial_training_values(args, trainer.get_train_dataloader())[-1]
    check_unfinished(checkpoint, steps, f"num_train_epochs={args.num_train_epochs}")


# ---------------------------------------------------------------------------------------- generation state
def encode(value, path: str = "state"):
    """`value` as nested tuples of plain types and CPU tensors (loadable with `torch.load(weights_only=True)`).

    Each node is tagged, so a `batching.Passes` comes back as one, a tensor on its original kind of device (the
    window normalisers stay on the CPU on purpose) and a dict in its key order. Raises TypeError naming the path
    of a value of another type.
    """
    if isinstance(value, torch.Tensor):
        return ("tensor", value.detach().cpu().clone(), value.device.type != "cpu")
    if isinstance(value, batching.Passes):
        return ("passes", [encode(item, f"{path}[{i}]") for i, item in enumerate(value)])
    if isinstance(value, aggregation.Window):  # the accumulation window's normalisers, attached to every pass
        fields = dataclasses.fields(value)
        return ("window", [(f.name, encode(getattr(value, f.name), f"{path}.{f.name}")) for f in fields])
    if isinstance(value, dict):
        return ("dict", [(key, encode(item, f"{path}[{key!r}]")) for key, item in value.items()])
    if isinstance(value, list):
        return ("list", [encode(item, f"{path}[{i}]") for i, item in enumerate(value)])
    if isinstance(value, tuple):
        return ("tuple", [encode(item, f"{path}[{i}]") for i, item in enumerate(value)])
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    raise TypeError(f"{path} is a {type(value).__name__}, which the generation state cannot save")


def decode(node, device: torch.device | str = "cpu"):
    """The value `encode` saved; tensors that were on an accelerator go to `device`."""
    kind, *payload = node
    if kind == "tensor":
        tensor, on_device = payload
        return tensor.to(device) if on_device else tensor
    if kind == "passes":
        return batching.Passes(decode(item, device) for item in payload[0])
    if kind == "dict":
        return {key: decode(item, device) for key, item in payload[0]}
    if kind == "window":
        return aggregation.Window(**{name: decode(item, device) for name, item in payload[0]})
    if kind == "list":
        return [decode(item, device) for item in payload[0]]
    if kind == "tuple":
        return tuple(decode(item, device) for item in payload[0])
    if kind == "value":
        return payload[0]
    raise ValueError(f"unknown node {kind!r} in a generation-state file: written by a newer dhpo_trl?")


def capture(trainer) -> dict:
    """The trainer's between-step state (`TRAINER_ATTRIBUTES` and the train metrics not yet logged), encoded.

    A value `encode` cannot save is dropped with a warning: the checkpoint then resumes by regenerating at its step
    (a resume, not an exact one), rather than the run dying at a save.
    """
    state = {"format": FORMAT, "global_step": trainer.state.global_step}
    names = (*TRAINER_ATTRIBUTES, *LOSS_ACCUMULATORS)
    values = {name: getattr(trainer, name) for name in names if hasattr(trainer, name)}
    values["_metrics_train"] = dict(trainer._metrics["train"])
    for name, value in values.items():
        try:
            state[name] = encode(value, name)
        except TypeError as error:
            warnings.warn(f"The checkpoint at step {trainer.state.global_step} resumes inexactly: {error}.", stacklevel=2)
            state["_buffered_inputs"] = encode(None)
            state["_step"] = encode(trainer.state.global_step * trainer.args.gradient_accumulation_steps)
    return state


def save_generation_state(checkpoint: str, rank: int, state: dict) -> str:
    """Write this process's generation state into `checkpoint` (created if needed); return the file's path."""
    os.makedirs(checkpoint, exist_ok=True)
    path = os.path.join(checkpoint, GENERATION_STATE.format(rank=rank))
    temporary = f"{path}.tmp"
    torch.save(state, temporary)
    os.replace(temporary, path)  # a crash mid-write never leaves a truncated file under the final name
    return path


def unmark(checkpoint: str) -> None:
    """Remove the marker before a checkpoint folder is (re)written: it is incomplete until marked again."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(checkpoint, COMPLETE_MARKER))


def mark_complete(checkpoint: str, settings: dict, global_step: int, save_only_model: bool = False) -> None:
    """Write the completeness marker (last, by the main process, after every process saved), with the size of
    every file the folder holds. A weights-only checkpoint (`save_only_model`) is complete but cannot be resumed;
    the marker says so."""
    path = os.path.join(checkpoint, COMPLETE_MARKER)
    record = {"format": MARKER_FORMAT, "global_step": global_step, "save_only_model": bool(save_only_model),
              "settings": settings, "files": file_sizes(checkpoint)}  # fmt: skip
    with open(f"{path}.tmp", "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1)
    os.replace(f"{path}.tmp", path)


def restore_generation_state(trainer, checkpoint: str, rank: int, device, warn: bool = True) -> dict | None:
    """Put the generation state saved in `checkpoint` for `rank` back on `trainer`; return the saved loss
    accumulators (`LOSS_ACCUMULATORS`, to set when training begins: `RestoreAtTrainBegin`), None without a state.

    An older checkpoint without it: `_step` is set to the micro-steps done (global_step x accumulation steps), so
    the run regenerates at this step and later generation batches start where the uninterrupted run's do; one
    warning (`warn`: the main process) says so.
    """
    path = os.path.join(checkpoint, GENERATION_STATE.format(rank=rank))
    if not os.path.isfile(path):
        if read_marker(checkpoint) is not None:
            raise FileNotFoundError(f"{path} is missing from a checkpoint marked complete: was it saved with "
                                    "another number of processes, or a file deleted?")  # fmt: skip
        global_step = saved_global_step(checkpoint)
        if warn:
            warnings.warn(
                f"{checkpoint} has no generation state (saved before dhpo_trl kept it): the run regenerates at step "
                f"{global_step}, so it continues from other data than the uninterrupted run, and its settings are not "
                "checked.", stacklevel=2,
            )  # fmt: skip
        trainer._step = global_step * trainer.args.gradient_accumulation_steps
        trainer._buffered_inputs = None
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path} has format {state.get('format')}, this dhpo_trl reads {FORMAT}.")
    for name in TRAINER_ATTRIBUTES:
        if name in state:
            setattr(trainer, name, decode(state[name], device))
    metrics = defaultdict(list)
    metrics.update(decode(state.get("_metrics_train", encode({}))))
    trainer._metrics["train"] = metrics
    return {name: decode(state[name], device) for name in LOSS_ACCUMULATORS if name in state}


class RestoreAtTrainBegin(TrainerCallback):
    """Sets `values` on `target` when training begins: transformers resets its loss accumulators there, after the
    checkpoint's other states were loaded."""

    def __init__(self, target, values: dict):
        self.target, self.values = target, dict(values)

    def on_train_begin(self, args, state, control, **kwargs):
        for name, value in self.values.items():
            current = getattr(self.target, name, None)
            if torch.is_tensor(value) and torch.is_tensor(current):  # where transformers put it ("cuda:0", not "cuda")
                value = value.to(current.device)
            setattr(self.target, name, value)
        self.values = {}


# ------------------------------------------------------------------------------------------- policy weights
SAFE_WEIGHTS, SAFE_WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"  # transformers' names


def weight_conversions(model) -> list:
    """The weight conversions `save_pretrained` reverses when it writes `model`, chosen as transformers'
    `revert_weight_conversion` chooses them: those `from_pretrained` used, else the ones registered for the model's
    type, without prefix changes. Qwen3-MoE: the experts, fused in the model, are written one by one. Empty when the
    model is written in its own layout (a dense model)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [conversion for conversion in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(conversion, PrefixChange)]  # fmt: skip
    return list(conversions)


def saved_weights(checkpoint: str) -> dict | None:
    """The state dict `save_pretrained` wrote into `checkpoint` (one safetensors file or its shards), on the CPU;
    None when the folder holds neither."""
    from safetensors.torch import load_file

    single, index = os.path.join(checkpoint, SAFE_WEIGHTS), os.path.join(checkpoint, SAFE_WEIGHTS_INDEX)
    if os.path.isfile(single):
        return load_file(single, device="cpu")
    if not os.path.isfile(index):
        return None
    with open(index, encoding="utf-8") as handle:
        shards = sorted(set(json.load(handle)["weight_map"].values()))
    return {name: tensor for shard in shards for name, tensor in load_file(os.path.join(checkpoint, shard)).items()}


def load_policy_weights(trainer, model, checkpoint: str) -> bool:
    """Load the weights of `checkpoint` into `model` converted back to the model's layout, as `from_pretrained`
    converts them; transformers' Trainer loads the file's state dict as written, so experts written one by one
    would miss their fused parameters and keep their current values. True when loaded (transformers' warning about
    missing keys issued; the conversion drops keys the model lacks); False, having loaded nothing, where
    transformers' own load is right: a model written in its own layout, a PEFT model (its adapters), DeepSpeed or
    FSDP (their own states, in the model's layout), a checkpoint without safetensors weights."""
    from transformers import PreTrainedModel
    from transformers.integrations.deepspeed import _apply_weight_conversions_to_state_dict

    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled or not isinstance(model, PreTrainedModel):
        return False
    conversions = weight_conversions(model)
    state = saved_weights(checkpoint) if conversions else None
    if state is None:
        return False
    # transformers' own conversion of a checkpoint's state dict, the one `from_pretrained` applies under ZeRO-3
    state = _apply_weight_conversions_to_state_dict(model, state, conversions)
    trainer._issue_warnings_after_load(model.load_state_dict(state, strict=False))
    return True


# ------------------------------------------------------------------------------------------ reference model
def _gathered(parameters: list, modifier_rank: int | None = None):
    """Every parameter whole inside the block: under ZeRO-3 a collective on every process (`modifier_rank`: the
    process whose changes are kept); elsewhere the parameters are whole already."""
    if not any(hasattr(parameter, "ds_id") for parameter in parameters):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(parameters, modifier_rank=modifier_rank)


def save_reference_model(model, checkpoint: str, main: bool) -> None:
    """Write the reference model's parameters whole into `checkpoint` (call on every process: ZeRO-3 gathers)."""
    from safetensors.torch import save_file

    named = list(model.named_parameters())
    with _gathered([parameter for _, parameter in named]):
        if main:
            tensors = {name: parameter.detach().to("cpu").contiguous().clone() for name, parameter in named}
            path = os.path.join(checkpoint, REFERENCE_MODEL)
            save_file(tensors, f"{path}.tmp")
            os.replace(f"{path}.tmp", path)


def restore_reference_model(model, checkpoint: str, main: bool, warn: bool = True) -> bool:
    """Load the reference model `checkpoint` saved back into `model` (every process; under ZeRO-3 the main one
    loads, the others receive). A checkpoint without the file (written before it was saved) keeps the initial
    reference model, with one warning (`warn`). True if restored."""
    path = os.path.join(checkpoint, REFERENCE_MODEL)
    if not os.path.isfile(path):
        if warn:
            warnings.warn(f"{checkpoint} holds no reference model ({REFERENCE_MODEL}): with sync_ref_model the run "
                          "continues from the initial reference model, not the synced one.", stacklevel=3)  # fmt: skip
        return False
    from safetensors.torch import load_file

    named = list(model.named_parameters())
    zero3 = any(hasattr(parameter, "ds_id") for _, parameter in named)
    tensors = load_file(path) if main or not zero3 else None
    if tensors is not None and set(tensors) != {name for name, _ in named}:
        differ = sorted(set(tensors) ^ {name for name, _ in named})
        raise ValueError(f"{path} does not fit the reference model (parameters {differ[:3]}): another model?")
    with torch.no_grad(), _gathered([parameter for _, parameter in named], modifier_rank=0):
        if tensors is not None:
            for name, parameter in named:
                parameter.data.copy_(tensors[name].to(device=parameter.device, dtype=parameter.dtype))
    return True


# ------------------------------------------------------------------------------------------------ writing
def write_checkpoint(trainer, model, trial, full: bool = False) -> str:
    """Write `checkpoint-<global_step>` of `trainer`: transformers' `Trainer._save_checkpoint` sequence (mirrored in
    `trl_mirror.MIRRORED`), with our files first and the marker last. Differences: weights only when
    `save_only_model` unless `full` (a stop's checkpoint is the run's only way back), and older checkpoints are
    rotated out only after this one is marked complete. `args` is read, never changed. Returns the folder."""
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import SaveStrategy, rotate_checkpoints

    args, state = trainer.args, trainer.state
    run_dir = trainer._get_output_dir(trial=trial)
    checkpoint = os.path.join(run_dir, f"checkpoint-{state.global_step}")
    main = args.should_save
    if main:
        unmark(checkpoint)  # our file first: a folder holding it without the marker is recognisably half-written
    save_generation_state(checkpoint, trainer.accelerator.process_index, capture(trainer))
    if args.sync_ref_model and trainer.ref_model is not None:
        save_reference_model(trainer.accelerator.unwrap_model(trainer.ref_model), checkpoint, main)
    weights_only = bool(args.save_only_model) and not full
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    trainer.save_model(checkpoint, _internal_call=True)
    if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and state.best_global_step:
        trainer.accelerator.wait_for_everyone()  # process 0 has saved the model before the best folder is looked up
        best = os.path.join(run_dir, f"checkpoint-{state.best_global_step}")
        if os.path.exists(best):
            state.best_model_checkpoint = best
    if not weights_only:
        trainer._save_optimizer_and_scheduler(checkpoint)
        trainer._save_scaler(checkpoint)
        trainer._save_rng_state(checkpoint)
    if main:
        for callback in [*trainer.callback_handler.callbacks, trainer.control]:
            if isinstance(callback, ExportableState):
                name, callback_state = type(callback).__name__, callback.state()
                if isinstance(state.stateful_callbacks[name], list):
                    state.stateful_callbacks[name].append(callback_state)
                else:
                    state.stateful_callbacks[name] = callback_state
        state.save_to_json(os.path.join(checkpoint, TRAINER_STATE))
        # TRL writes the card to output_dir only; copy it so every checkpoint (and every Hub push of one) carries it.
        card = os.path.join(args.output_dir, "README.md")
        if os.path.isfile(card) and os.path.isdir(checkpoint):
            shutil.copyfile(card, os.path.join(checkpoint, "README.md"))
    trainer.accelerator.wait_for_everyone()  # every process's files are written
    if main:
        mark_complete(checkpoint, run_settings(args, trainer.accelerator.num_processes, **decided(trainer)),
                      state.global_step, weights_only)  # fmt: skip
    if args.push_to_hub:
        trainer._push_from_checkpoint(checkpoint)
    if main:
        rotate_checkpoints(output_dir=run_dir, save_total_limit=args.save_total_limit,
                           best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)  # fmt: skip
    return checkpoint


# -------------------------------------------------------------------------------------------- graceful stop
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclass
class StopRequest:
    """Set by the first stop signal; read once per optimizer step."""

    signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


@contextlib.contextmanager
def stop_on_signals(signals=STOP_SIGNALS) -> Iterator[StopRequest | None]:
    """Handlers for `signals` inside the block, the previous ones restored after it (also on error).

    The first signal only sets the request; a second one restores the previous handlers and re-delivers itself
    (a previous Python handler is called; the default one ends the process). Signal handlers can only be set in
    the main thread: elsewhere nothing is installed, a warning says so, and the block gets None.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        warnings.warn("train() runs outside the main thread: SIGTERM/SIGUSR1 cannot stop it gracefully.", stacklevel=3)
        yield None
        return
    request = StopRequest()
    previous = {signum: signal.getsignal(signum) for signum in signals}

    def restore():
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def handle(signum, frame):
        if not request.requested:
            request.signum = signum
            return
        restore()  # second signal: stop at once
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    for signum in signals:
        signal.signal(signum, handle)
    try:
        yield request
    finally:
        restore()


def start_fresh(trainer) -> list:
    """A `train()` without a checkpoint is a run of its own, the one a new trainer with the same arguments would train
    from the model's current weights. TRL and transformers keep per-run state across `train()` calls (a notebook cell
    run again, or after an interrupt): the micro-step counter and buffered micro-batches (the new run would train
    first on the rest of the previous run's generation batch, out of phase), the metrics that a step or an evaluation
    cut short left unlogged and those its reward functions logged (`log_metric`), the adaptive entropy controller
    (its coefficient would start where the last run left it), the random state (the generations would follow the
    last run's), the optimizer transformers made for the last run (Adam's moments and step count) and the step whose
    weights vLLM holds (the weights would not be sent at a step the last run sent them at). Each is set as a new
    trainer sets it. Before the trainer's first run the random state and the optimizer are the caller's (seeded or
    set since the trainer was built, or passed in `optimizers`), as with TRL's trainer; so is an optimizer the caller
    set or passed at any time. Returns the callback that records the run (`new_run`), as `restore` does."""
    trainer._step = 0
    trainer._buffered_inputs = None
    trainer._metrics = {mode: defaultdict(list) for mode in trainer._metrics}  # "train", "eval"
    trainer._pending_metrics.clear()
    trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = entropy_control.initial(
        trainer.args)
    if trainer._last_run is not None:  # a run began: it drew from the random state, made its optimizer
        set_seed(trainer.args.seed, device_specific=True)  # as TRL's __init__ seeds, last
    return [new_run(trainer)]


def new_run(trainer) -> LastRun:
    """What every `train()` sets before transformers starts its run, from a checkpoint or not: the weights go to vLLM
    before the first generation, whatever step's weights it holds (TRL sends them only at a step it has not sent);
    transformers makes a new optimizer where it made the last run's (`drop_made_optimizer`), and loads a checkpoint's
    state into that; the run is recorded (`LastRun`)."""
    if trainer.use_vllm:
        trainer._last_loaded_step = -1
    drop_made_optimizer(trainer)
    return LastRun(trainer)


def drop_made_optimizer(trainer) -> None:
    """Drops the optimizer transformers made for the last run, so that it makes a new one as training starts (a new
    trainer's); a caller's stays. Kept, it would be the caller's to every later run (`LastRun`), its moments with it.
    A `train()` that failed before its run began, where transformers was to make one (another callback's
    `on_train_begin`, or loading a checkpoint's optimizer or scaler), made and prepared one too: the one accelerate
    prepared (`AcceleratedOptimizer`, DeepSpeed's wrapper included), where the caller sets a plain one."""
    made = [trainer._last_run.optimizer if trainer._last_run is not None else None]
    if trainer._making_optimizer and isinstance(trainer.optimizer, AcceleratedOptimizer):
        made.append(trainer.optimizer)
    if trainer.optimizer is not None and any(trainer.optimizer is optimizer for optimizer in made):
        trainer.optimizer = None  # transformers makes a new one as training starts


class LastRun(TrainerCallback):
    """Records on the trainer (`_last_run`), as its run begins, what the next `start_fresh` sets as a new trainer has
    it: that the run began, and the optimizer transformers made and prepared for it (`optimizer`; None where it was
    the caller's, which stays the caller's). Until then `_making_optimizer` says whether transformers makes one."""

    def __init__(self, trainer):
        self.trainer, self.made, self.optimizer = trainer, trainer.optimizer is None, None
        trainer._making_optimizer = self.made

    def on_train_begin(self, args, state, control, **kwargs):
        trainer, self.trainer = self.trainer, None  # the record the trainer keeps does not keep the trainer
        self.optimizer = trainer.optimizer if self.made else None
        trainer._last_run, trainer._making_optimizer = self, False


def restore(trainer, checkpoint: str) -> list:
    """What transformers does not restore of a checkpoint: each process's generation state and, with
    `sync_ref_model`, the synced reference model. Returns the callbacks that finish the restore once training begins
    (transformers resets its loss accumulators then) and record the run (`new_run`)."""
    check_epochs_unfinished(trainer, checkpoint)
    accelerator = trainer.accelerator
    main = accelerator.is_main_process
    accumulators = restore_generation_state(trainer, checkpoint, accelerator.process_index, accelerator.device,
                                            warn=main)  # fmt: skip
    if trainer.args.sync_ref_model and trainer.ref_model is not None:
        restore_reference_model(accelerator.unwrap_model(trainer.ref_model), checkpoint, main, main)
    trainer._routing.check_resumed(trainer._buffered_inputs)  # MoE routing replay needs the batch's routing
    return [RestoreAtTrainBegin(trainer, accumulators or {}), new_run(trainer)]


class GracefulStopCallback(TrainerCallback):
    """After every optimizer step, on every process: agree on the stop request; if any process got a signal, save
    a checkpoint and stop (the Trainer saves in the same step's `_maybe_log_save_evaluate`, then leaves its loops)."""

    def __init__(self, request: StopRequest | None, agree: Callable[[bool], bool]):
        self.request = request
        self.agree = agree
        self.stopped_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        requested = self.request is not None and self.request.requested
        if self.agree(requested):  # every process calls it every step, so no process waits alone
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
        return control

    def record(self, max_steps: int, output_dir: str) -> dict | None:
        """`DHPOTrainer.graceful_stop`: the signal, step and checkpoint of the stop; None without one, or when it came
        at the last step (the run had finished)."""
        if self.stopped_at is None or self.stopped_at >= max_steps:
            return None
        signalled = self.request.name if self.request is not None and self.request.requested else None
        return {"signal": signalled or "a signal to another process", "step": self.stopped_at,
                "checkpoint": os.path.join(output_dir, f"checkpoint-{self.stopped_at}")}  # fmt: skip
