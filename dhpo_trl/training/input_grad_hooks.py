"""As many input-embedding hooks as training began with, however often TRL turns gradient checkpointing off and on.

TRL runs each generation batch's no-grad passes (old and reference log-probs) with gradient checkpointing off
(`trl.models.utils.disable_gradient_checkpointing`) and turns it on again after. transformers'
`gradient_checkpointing_enable` registers a forward hook on the input embeddings every time
(`enable_input_require_grads`, which keeps only the new handles in `_require_grads_hooks`), and
`gradient_checkpointing_disable` removes it only for adapters transformers loaded itself, so a run gains one hook
per generation batch. Eagerly that is a growing list of calls that each set `requires_grad` again. With
`torch_compile=True` the compiled model guards on the number of hooks of the modules it runs, so every generation
batch compiles it again, and past dynamo's recompile limit (8 by default) it runs eagerly for the rest of the run:
`trl.GRPOTrainer` with `torch_compile=True` does, on TRL's batching and dynamic batching (tests/test_torch_compile.py).
A hook registered before training and already replaced then stays (with PEFT and checkpointing, TRL's own
`enable_input_require_grads` before the Trainer's checkpointing one: two hooks throughout).
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

ATTRIBUTE = "_require_grads_hooks"  # transformers' PreTrainedModel: the handles of its input-embedding hooks


def _handles(model: nn.Module) -> dict[int, tuple[nn.Module, list]]:
    return {id(module): (module, list(getattr(module, ATTRIBUTE)))
            for module in model.modules() if getattr(module, ATTRIBUTE, None)}  # fmt: skip


@contextmanager
def replaced_hooks_removed(model: nn.Module):
    """Within the block, a module whose input-embedding hooks are registered again (its `_require_grads_hooks`
    replaced) loses the hooks it had before: it ends with the new ones only."""
    before = _handles(model)
    try:
        yield
    finally:  # TRL re-enables checkpointing in a `finally` too: a generation batch that raises replaced the hooks
        for module, handles in before.values():
            kept = {handle.id for handle in getattr(module, ATTRIBUTE, None) or []}
            for handle in handles:
                if handle.id not in kept:
                    handle.remove()  # idempotent: a hook transformers removed already stays removed
