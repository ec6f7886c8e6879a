"""A trainer in a long-lived process (a notebook): what another cell can have done to the process-wide state it
trains with.

accelerate keeps one process-wide state (`AcceleratorState`), which every `Accelerator` reads. transformers empties
it whenever a `TrainingArguments` is built (`_setup_devices`, unless `accelerator_config` asks for
`use_configured_state`) and fills it again only when a trainer is built. A `DHPOConfig` (or `GRPOConfig`) built
after a trainer, with no trainer built since, leaves that trainer with no state: its next `train()` would fail
inside accelerate, naming neither the cause nor the fix. `trl.GRPOTrainer` fails the same way.
"""

from __future__ import annotations


# What of accelerate's process-wide state a trainer trains with that another config's trainer can set otherwise.
STATE_FIELDS = ("distributed_type", "mixed_precision", "num_processes", "device")


def accelerate_state(accelerator) -> dict | None:
    """`STATE_FIELDS` of the process-wide state `accelerator` reads; None where a config built since emptied it."""
    state = accelerator.state
    if not hasattr(state, "distributed_type"):  # transformers' `AcceleratorState._reset_state()`
        return None
    return {name: getattr(state, name, None) for name in STATE_FIELDS}


def check_accelerate_state(accelerator, built: dict | None) -> tuple[bool, int]:
    """The process's place (main process, number of processes), refused in one line where a config built since
    this trainer emptied accelerate's state, or a trainer built since with another config refilled it otherwise than
    `built` (the state at this trainer's construction): this trainer would train under the other's settings."""
    now = accelerate_state(accelerator)
    if now is None:
        raise RuntimeError(
            "accelerate's process-wide state was reset by a DHPOConfig/GRPOConfig/TrainingArguments built after this "
            "trainer: build the trainer again (after the last config), then train it."
        )  # fmt: skip
    changed = [name for name in STATE_FIELDS if built is not None and now[name] != built[name]]
    if changed:
        raise RuntimeError(
            f"accelerate's process-wide state has {changed[0]}={now[changed[0]]!r}, set by a trainer built after this "
            f"one with another config (this one's: {built[changed[0]]!r}): build this trainer again, then train it."
        )  # fmt: skip
    return accelerator.is_main_process, accelerator.num_processes
