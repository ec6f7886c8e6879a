"""TRL's aggregations of a per-token loss and its entropy bonus, as pure functions of tensors and one `Window`.

A micro-batch's loss is its share of the loss of its gradient-accumulation window (the micro-batches of one
optimizer step on one process). How large that share is depends on the batching: TRL's fixed slices make every
micro-batch 1 / `gradient_accumulation_steps` of the window; dynamic batching (`dhpo_trl.training.batching`) cuts the window
into micro-batches of varying rows and tokens, and under a token budget into more passes than micro-steps. The
`Window` attached to every micro-batch says which, so the share is computed here and nowhere else. The TRL lines
these functions mirror are listed in `dhpo_trl.training.trl_mirror`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# TRL's aggregations of a per-token loss. "grpo" is the per-response token mean of eqs. 3, 6 and 7. "luspo" (the
# per-response token sum, averaged over responses) is LUSPO's own: the LUSPO row accepts only it, the others only
# the base four.
BASE_AGGREGATIONS = ("grpo", "bnpo", "dr_grpo", "dapo")
AGGREGATIONS = (*BASE_AGGREGATIONS, "luspo")
# Aggregations that TRL divides by the accumulation steps (and reports undivided as `policy_loss`); "dapo"
# normalises by the window's tokens instead.
PER_PASS_AGGREGATIONS = ("grpo", "bnpo", "dr_grpo", "luspo")


@dataclass(frozen=True)
class Window:
    """The accumulation window of one micro-batch, on this process.

    `sequences`: rows of the window (TRL: rows of the micro-batch x `passes`). `passes`: forward passes over the
    window (TRL: `gradient_accumulation_steps` in training, 1 in evaluation; dynamic batching: the planned passes).
    `tokens`: loss tokens of the window, or None for TRL's fixed slices, where each pass weighs 1 / `passes`.
    `dapo_tokens`: dapo's normaliser, the window's loss tokens averaged over processes as TRL derives it from
    `num_items_in_batch` (a tensor; the same whatever the batching).
    """

    sequences: float
    passes: float
    tokens: float | None
    dapo_tokens: torch.Tensor | float | None

    def share(self, micro_tokens) -> torch.Tensor | float:
        """This micro-batch's share of the window, by tokens when they are known, else 1 / `passes`."""
        if self.tokens is None:
            return 1.0 / self.passes
        return micro_tokens / max(float(self.tokens), 1.0)


def dapo_tokens(num_items_in_batch, num_processes: int, accumulation_share: float):
    """TRL's dapo normaliser: `num_items_in_batch` spans the generation batch on every process, so it is averaged
    over processes and scaled to one window (`accumulation_share` = gradient_accumulation_steps /
    steps_per_generation in training, 1 in evaluation)."""
    return num_items_in_batch.clamp(min=1.0) / num_processes * accumulation_share


def fixed_slice_window(rows: int, passes: int, dapo: torch.Tensor | float) -> Window:
    """The window of one of TRL's fixed slices: `passes` equal slices of `rows` rows each."""
    return Window(sequences=float(rows * passes), passes=float(passes), tokens=None, dapo_tokens=dapo)


def trl_slice_window(rows: int, num_items_in_batch, train: bool, accumulation: int, steps_per_generation: int,
                     num_processes: int) -> Window:  # fmt: skip
    """The window of a micro-batch TRL cut (`rows` rows): `accumulation` slices in training (TRL's
    `current_gradient_accumulation_steps`, shorter for an epoch's last window), the micro-batch alone in
    evaluation; dapo's normaliser from `num_items_in_batch` (None: no dapo normaliser)."""
    passes = accumulation if train else 1
    share = accumulation / steps_per_generation if train else 1.0
    dapo = None if num_items_in_batch is None else dapo_tokens(num_items_in_batch, num_processes, share)
    return fixed_slice_window(rows, passes, dapo)


def planned_window(mask: torch.Tensor, passes: int, dapo: torch.Tensor | float) -> Window:
    """The window of dynamically planned micro-batches: `mask` is the loss mask of the whole window."""
    return Window(sequences=float(mask.size(0)), passes=float(passes), tokens=float(mask.sum()), dapo_tokens=dapo)


def aggregate(loss_type: str, per_token_loss: torch.Tensor, mask: torch.Tensor, window: Window,
              max_completion_length: int) -> torch.Tensor:  # fmt: skip
    """This micro-batch's share of the window's aggregated loss.

    "grpo" (eq. 7): per-response token mean, summed, over the window's rows. "bnpo": token mean of the micro-batch
    over the passes (TRL's per-micro-batch meaning; dynamic batching refuses it). "dr_grpo": token sum over the
    window's rows x `max_completion_length`. "dapo": token sum over the window's tokens averaged over processes.
    "luspo": per-response token sum, summed, over the window's rows (each response weighs by its length). With TRL's
    fixed slices each is exactly TRL's value divided for accumulation.
    """
    mask = mask.to(per_token_loss.dtype)
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / window.sequences
    if loss_type == "luspo":
        return (per_token_loss * mask).sum() / window.sequences
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / window.passes
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (window.sequences * max_completion_length)
    if loss_type == "dapo":
        if window.dapo_tokens is None:
            raise ValueError("loss_type='dapo' needs the batch's `num_items_in_batch` (TRL sets it) for its normaliser.")
        return (per_token_loss * mask).sum() / window.dapo_tokens
    raise ValueError(f"loss_type={loss_type!r} is not an aggregation: use one of {list(AGGREGATIONS)}.")


def reported_policy_loss(loss_type: str, loss: torch.Tensor, window: Window) -> torch.Tensor:
    """TRL's `policy_loss` metric: the aggregated loss before the division for accumulation (dapo: as is)."""
    return loss.detach() * window.passes if loss_type in PER_PASS_AGGREGATIONS else loss.detach()


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor, entropy_mask: torch.Tensor | None,
                  window: Window) -> torch.Tensor:  # fmt: skip
    """The mean entropy H of the tokens the bonus acts on (`mask`, times `entropy_mask` from
    `top_entropy_quantile` when given), as this micro-batch's share of the window (the loss subtracts coef x H).

    TRL's meaning: the mean over the micro-batch's effective tokens, divided for accumulation. Over a dynamically
    planned window the share is the micro-batch's loss tokens over the window's, so without an entropy mask the
    window's bonus is the token mean over all its tokens, whatever the grouping; with one, each micro-batch's mean
    is over its high-entropy tokens, as in TRL (not over all the window's tokens, which would shrink the bonus by
    the kept fraction).
    """
    effective = mask if entropy_mask is None else mask * entropy_mask
    mean = (entropies * effective).sum() / effective.sum().clamp(min=1.0)
    return mean * window.share(mask.sum())
