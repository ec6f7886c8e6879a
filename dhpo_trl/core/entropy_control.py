"""TRL's adaptive entropy controller (`use_adaptive_entropy`) as pure functions of its state and a step's statistics.

The bonus a window applies is `coef` when the previous optimizer step's world entropy was at or below the target
(`applied_coefficient`), else nothing; each micro-batch adds its (entropy sum, token count) over the bonus's tokens
to the window (`accumulate`); at the optimizer step the caller sums the window over processes and `close_window`
moves the coefficient by `delta` towards more or less exploration. The state is TRL's three attributes
(`entropy_coef`, `_last_world_entropy`, `_entropy_window_stats`), so TRL's checkpoint file and the generation
state keep carrying it. The TRL lines mirrored are listed in `dhpo_trl.training.trl_mirror`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class State(NamedTuple):
    coef: float  # TRL's `entropy_coef`
    last_world_entropy: float = math.inf  # the previous step's entropy over every process (inf before the first)
    window: torch.Tensor | None = None  # (entropy sum, token count) of this window so far, this process


class Control(NamedTuple):
    adaptive: bool
    target: float
    delta: float
    low: float
    high: float


def initial(args) -> State:
    """The state a new trainer starts from: the configured coefficient, no step measured, an empty window."""
    return State(args.entropy_coef)


def control_of(args) -> Control:
    """The controller's settings from a `DHPOConfig` / `GRPOConfig`."""
    return Control(bool(args.use_adaptive_entropy), args.entropy_target, args.entropy_coef_delta,
                   args.entropy_coef_min, args.entropy_coef_max)  # fmt: skip


def effective_entropy_stats(entropies: torch.Tensor, mask: torch.Tensor, entropy_mask: torch.Tensor | None):
    """(entropy sum, token count) over the bonus's tokens, detached: what the adaptive controller accumulates."""
    effective = mask if entropy_mask is None else mask * entropy_mask
    return torch.stack([(entropies * effective).sum(), effective.sum()]).detach()


def applied_coefficient(coef: float, last_world_entropy: float, target: float, adaptive: bool) -> float:
    """The coefficient a window applies: adaptive control applies it only when the last step's world entropy was
    at or below the target (inf before the first step: no bonus)."""
    if adaptive:
        return coef if last_world_entropy <= target else 0.0
    return coef


def next_coefficient(coef: float, world_entropy: float, target: float, delta: float, low: float, high: float) -> float:
    """TRL's adaptive controller, once per optimizer step: raise by `delta` (capped at `high`) when the window's
    world entropy is at or below the target, else lower (floored at `low`)."""
    return min(coef + delta, high) if world_entropy <= target else max(coef - delta, low)


def applied(state: State, control: Control) -> float:
    return applied_coefficient(state.coef, state.last_world_entropy, control.target, control.adaptive)


def accumulate(state: State, stats: torch.Tensor) -> State:
    """The state after one more micro-batch's `effective_entropy_stats`."""
    return state._replace(window=stats if state.window is None else state.window + stats)


def close_window(state: State, world_sum: float, world_count: float, control: Control) -> State:
    """The state after the optimizer step: the window's (entropy sum, token count) summed over every process moves
    the coefficient, becomes the last world entropy, and the window starts empty."""
    world_entropy = world_sum / max(world_count, 1.0)
    coef = next_coefficient(state.coef, world_entropy, control.target, control.delta, control.low, control.high)
    return State(coef, world_entropy, None)
