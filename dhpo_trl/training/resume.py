"""Exact resume from any checkpoint, and a graceful stop on SIGTERM / SIGUSR1.

TRL keeps the rest of the current generation batch (`_buffered_inputs`) and its micro-step counter (`_step`) only in
memory, so a run resumed from a checkpoint in the middle of a generation batch regenerates at the wrong phase and
sees other data from then on. Here:

* **generation state**: every process writes `dhpo_generation_state_rank{r}.pt` into the checkpoint: TRL's `_step`,
  the not-yet-consumed micro-batches (whatever `_buffered_inputs` holds, recursively: dicts, lists,
  `batching.Passes`, tensors with their device, numbers), the adaptive entropy controller and the metrics not yet
  logged. `restore_generation_state` puts them back before training resumes.
* **completeness**: the main process writes `dhpo_checkpoint_complete.json` last, after every process wrote its
  files; it records the run's settings. A folder holding our files but not the marker was left half-written and
  is never loaded. A checkpoint from before this module (no file of ours) counts as complete when transformers'
  `trainer_state.json` (written after weights, optimizer and RNG states) is there.
* **settings**: a resume whose objective, batch geometry or world size differs from the checkpoint's is refused.
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
import signal
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import TrainerCallback

from ..core import aggregation
from . import batching

GENERATION_STATE = "dhpo_generation_state_rank{rank}.pt"
COMPLETE_MARKER = "dhpo_checkpoint_complete.json"
TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME, written after weights, optimizer and RNG
FORMAT = 1
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

# Trainer attributes that change during training and decide what later steps do. `_last_loaded_step` (vLLM) is
# deliberately not here: after a resume the server must receive the resumed weights before it generates.
TRAINER_ATTRIBUTES = ("_step", "_buffered_inputs", "entropy_coef", "_last_world_entropy", "_entropy_window_stats")


# ----------------------------------------------------------------------------------------------- settings
def run_settings(args, world_size: int) -> dict:
    """The settings a resume must agree with (see `RESUME_SETTINGS`), with the objective's own settings."""
    from ..core.config import uses_dynamic_batching
    from ..core.objectives import get_objective

    names = (*RESUME_SETTINGS, *get_objective(args.algorithm).settings(args))
    settings = {name: getattr(args, name, None) for name in dict.fromkeys(names)}
    settings["dynamic_batching"] = uses_dynamic_batching(args)  # None (automatic) recorded as what it decided
    settings[WORLD_SIZE] = int(world_size)
    return settings


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
        weights_only = bool((read_marker(path) or {}).get("save_only_model"))
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


def check_resumable(path: str, current: dict) -> None:
    """Refuse to resume `path` under other settings (`current`: `run_settings` of this run), naming them."""
    marker = read_marker(path)
    if marker is None:  # older checkpoint: no settings recorded (restore_generation_state warns once)
        return
    saved = marker.get("settings", {})
    differ = settings_difference(saved, current)
    if differ:
        listed = ", ".join(f"{name}={saved.get(name)!r} in the checkpoint but {current.get(name)!r} now" for name in differ)
        raise ValueError(
            f"--resume_from_checkpoint {path}: {listed}. Resume with the checkpoint's settings, or train into a new "
            "output_dir."
        )


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
    values = {name: getattr(trainer, name) for name in TRAINER_ATTRIBUTES if hasattr(trainer, name)}
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
    """Write the completeness marker (last, by the main process, after every process saved). A weights-only
    checkpoint (`save_only_model`) is complete but cannot be resumed; the marker says so."""
    path = os.path.join(checkpoint, COMPLETE_MARKER)
    record = {"format": FORMAT, "global_step": global_step, "save_only_model": bool(save_only_model),
              "settings": settings}  # fmt: skip
    with open(f"{path}.tmp", "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1)
    os.replace(f"{path}.tmp", path)


def restore_generation_state(trainer, checkpoint: str, rank: int, device, warn: bool = True) -> bool:
    """Put the generation state saved in `checkpoint` for `rank` back on `trainer`. True if restored.

    An older checkpoint without it: `_step` is set to the micro-steps done (global_step x accumulation steps), so
    the run regenerates at this step and later generation batches start where the uninterrupted run's do; one
    warning (`warn`: the main process) says so.
    """
    path = os.path.join(checkpoint, GENERATION_STATE.format(rank=rank))
    if not os.path.isfile(path):
        if read_marker(checkpoint) is not None:
            raise FileNotFoundError(f"{path} is missing from a checkpoint marked complete: was it saved with "
                                    "another number of processes, or a file deleted?")  # fmt: skip
        with open(os.path.join(checkpoint, TRAINER_STATE), encoding="utf-8") as handle:
            global_step = json.load(handle)["global_step"]
        if warn:
            warnings.warn(
                f"{checkpoint} has no generation state (saved before dhpo_trl kept it): the run regenerates at step "
                f"{global_step}, so it continues from other data than the uninterrupted run, and its settings are not "
                "checked.", stacklevel=2,
            )  # fmt: skip
        trainer._step = global_step * trainer.args.gradient_accumulation_steps
        trainer._buffered_inputs = None
        return False
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path} has format {state.get('format')}, this dhpo_trl reads {FORMAT}.")
    for name in TRAINER_ATTRIBUTES:
        if name in state:
            setattr(trainer, name, decode(state[name], device))
    metrics = defaultdict(list)
    metrics.update(decode(state.get("_metrics_train", encode({}))))
    trainer._metrics["train"] = metrics
    return True


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


def agree_any(flag: bool, device) -> bool:
    """True on every process if `flag` is True on any (one all-reduce of one number; no-op with one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item() > 0)


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
