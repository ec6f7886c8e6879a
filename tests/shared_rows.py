"""The prompt tokens of share_prompts' update passes, counted on each pass's packed row (for the tests and their
torchrun scripts): independent of the plan's own count, which the trainer logs."""

import torch

from dhpo_trl.training import shared_prompts


def prompt_tokens(passes: list[dict]) -> tuple[int, int]:
    """(prompt tokens the packed rows forward, attended prompt tokens of their sequences): each pass is one row, whose
    packed length less its attended completion tokens is the prompt tokens it forwards."""
    forwarded = total = 0
    for part in passes:
        ids = torch.cat([part["prompt_ids"], part["completion_ids"]], 1)
        mask = torch.cat([part["prompt_mask"], part["completion_mask"]], 1)
        (row,) = shared_prompts.pack(ids, mask, part["completion_ids"].size(1), [list(range(ids.size(0)))])
        forwarded += row.input_ids.numel() - int(part["completion_mask"].sum())
        total += int(part["prompt_mask"].sum())
    return forwarded, total
