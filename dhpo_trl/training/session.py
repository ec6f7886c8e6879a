"""A trainer in a long-lived process (a notebook): what another cell can have done to the process-wide state it
trains with.

accelerate keeps one process-wide state (`AcceleratorState`), which every `Accelerator` reads. transformers empties
it whenever a `TrainingArguments` is built (`_setup_devices`, unless `accelerator_config` asks for
`use_configured_state`) and fills it again only when a trainer is built. A `DHPOConfig` (or `GRPOConfig`) built
after a trainer, with no trainer built since, leaves that trainer with no state: its next `train()` would fail
inside accelerate, naming neither the cause nor the fix. `trl.GRPOTrainer` fails the same way.
"""

from __future__ import annotations


def check_accelerate_state(accelerator) -> tuple[bool, int]:
    """The process's place (main process, number of processes), refused in one line where a config built since
    this trainer emptied accelerate's state."""
    if not hasattr(accelerator.state, "distributed_type"):  # transformers' `AcceleratorState._reset_state()`
        raise RuntimeError(
            "accelerate's process-wide state was reset by a DHPOConfig/GRPOConfig/TrainingArguments built after this "
            "trainer: build the trainer again (after the last config), then train it."
        )  # fmt: skip
    return accelerator.is_main_process, accelerator.num_processes
