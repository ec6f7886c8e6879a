"""Early, named errors for reward functions that return garbage, and for reward weights that do not match them.

TRL turns each reward function's output into a float tensor; a string, a nested list or an infinite value then
fails deep inside `torch.tensor` (or silently turns every advantage into NaN). `checked_reward_function` wraps a
synchronous reward function so that such output raises a ValueError naming the function, the sample and the fix,
on the first batch. None and NaN stay allowed: TRL treats them as "no reward for this sample".
"""

from __future__ import annotations

import functools
import math
import numbers

import torch
from trl.trainer.utils import get_callable_name, is_async_callable


def _as_reward(value):
    """A float (NaN for None), or None when the value is not a single real number."""
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    elif hasattr(value, "item") and getattr(value, "shape", None) == ():  # numpy scalars
        value = value.item()
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def checked_reward_function(func):
    """Wrap `func` (a TRL reward function) so that malformed output raises a clear ValueError."""
    name = get_callable_name(func)

    @functools.wraps(func)
    def checked(*args, completions=None, **kwargs):
        rewards = func(*args, completions=completions, **kwargs)
        if isinstance(rewards, (str, bytes)) or not hasattr(rewards, "__len__"):
            raise ValueError(
                f"Reward function '{name}' returned {type(rewards).__name__}; it must return a list with one float "
                f"(or None) per completion ({len(completions)} here)."
            )
        for index, value in enumerate(rewards):
            reward = _as_reward(value)
            if reward is None or math.isinf(reward):
                raise ValueError(
                    f"Reward function '{name}' returned {value!r} for completion {index}: each reward must be a "
                    "finite number, or None/NaN to skip that sample. Fix the function (e.g. map failures to 0.0)."
                )
        return rewards

    checked.__name__ = name  # TRL names the reward's metrics after it
    return checked


def check_reward_functions(reward_funcs, reward_weights=None):
    """Wrap every plain synchronous callable in `reward_funcs` (a callable, a model id, a module, or a list), after
    checking `reward_weights` (`DHPOConfig.reward_weights`) against them."""
    check_reward_weights(reward_weights, reward_funcs)
    if reward_funcs is None:
        return None
    single = not isinstance(reward_funcs, list)
    funcs = [reward_funcs] if single else list(reward_funcs)
    wrapped = [
        checked_reward_function(f)
        if callable(f) and not isinstance(f, torch.nn.Module) and not is_async_callable(f)
        else f
        for f in funcs
    ]
    return wrapped[0] if single else wrapped


def check_reward_weights(reward_weights, reward_funcs) -> None:
    """One weight per reward function (TRL checks it too, once the policy has loaded)."""
    if reward_weights is None:
        return
    count = 0 if reward_funcs is None else len(reward_funcs) if isinstance(reward_funcs, list) else 1
    if len(reward_weights) != count:
        raise ValueError(
            f"DHPOConfig.reward_weights={list(reward_weights)!r} has {len(reward_weights)} weights for {count} reward "
            "function(s): give one weight per function of `reward_funcs`, in order, or leave reward_weights unset."
        )
