"""TRL's adaptive entropy controller as pure functions (`dhpo_trl.core.entropy_control`), against TRL's rules
written out by hand: apply the coefficient only at or below the target, move it once per optimizer step."""

import math

import pytest
import torch

from dhpo_trl.core import entropy_control
from dhpo_trl.core.entropy_control import Control, State

# padding holds huge values, so any leak into a sum shows
ENTROPIES = torch.tensor([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]])  # valid entropies 1, 2, 4: sum 7 over 3 tokens
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
HIGH = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])  # a top-entropy mask: with MASK, the entropies 1 and 4
CONTROL = Control(adaptive=True, target=2.5, delta=0.05, low=0.01, high=0.2)


def test_effective_entropy_stats_sum_the_bonus_tokens_detached():
    entropies = ENTROPIES.clone().requires_grad_(True)
    stats = entropy_control.effective_entropy_stats(entropies, MASK, None)
    assert stats.tolist() == [7.0, 3.0] and not stats.requires_grad
    assert entropy_control.effective_entropy_stats(entropies, MASK, HIGH).tolist() == [5.0, 2.0]


def test_adaptive_coefficient_applies_only_at_or_below_the_target():
    assert entropy_control.applied_coefficient(0.1, math.inf, 2.5, adaptive=True) == 0.0  # no world entropy yet
    assert entropy_control.applied_coefficient(0.1, 2.5, 2.5, adaptive=True) == 0.1  # at the target: applied
    assert entropy_control.applied_coefficient(0.1, 2.6, 2.5, adaptive=True) == 0.0
    assert entropy_control.applied_coefficient(0.1, math.inf, 2.5, adaptive=False) == 0.1  # static: always


def test_adaptive_coefficient_moves_by_delta_within_its_bounds():
    step = dict(target=2.5, delta=0.05, low=0.01, high=0.2)
    assert entropy_control.next_coefficient(0.1, 7 / 3, **step) == pytest.approx(0.15)  # below: up
    assert entropy_control.next_coefficient(0.1, 2.5, **step) == pytest.approx(0.15)  # at: up
    assert entropy_control.next_coefficient(0.18, 1.0, **step) == pytest.approx(0.2)  # capped
    assert entropy_control.next_coefficient(0.1, 3.0, **step) == pytest.approx(0.05)  # above: down
    assert entropy_control.next_coefficient(0.03, 3.0, **step) == pytest.approx(0.01)  # floored


def test_a_window_accumulates_then_moves_the_coefficient_once():
    state = State(0.1)
    assert entropy_control.applied(state, CONTROL) == 0.0  # before the first step
    for stats in ([3.0, 2.0], [1.0, 2.0]):  # two micro-batches: 4 / 4 tokens = 1.0 on this process
        state = entropy_control.accumulate(state, torch.tensor(stats))
    assert state.window.tolist() == [4.0, 4.0] and state.coef == 0.1  # nothing moves inside the window
    # the caller sums the window over processes: another process's (8, 2) makes the world entropy 12 / 6 = 2.0
    after = entropy_control.close_window(state, 12.0, 6.0, CONTROL)
    assert after == State(pytest.approx(0.15), 2.0, None)
    assert entropy_control.applied(after, CONTROL) == pytest.approx(0.15)
    above = entropy_control.close_window(after, 30.0, 6.0, CONTROL)  # world entropy 5 > 2.5: down, not applied
    assert above.coef == pytest.approx(0.1) and entropy_control.applied(above, CONTROL) == 0.0


def test_an_empty_window_counts_at_least_one_token():
    state = entropy_control.accumulate(State(0.1), torch.zeros(2))
    assert entropy_control.close_window(state, 0.0, 0.0, CONTROL).last_world_entropy == 0.0


def test_static_control_applies_the_coefficient_always():
    assert entropy_control.applied(State(0.3), CONTROL._replace(adaptive=False)) == 0.3


def test_a_window_of_one_token_is_its_entropy():
    state = entropy_control.accumulate(State(0.1), torch.tensor([3.0, 1.0]))
    assert entropy_control.close_window(state, 3.0, 1.0, CONTROL).last_world_entropy == 3.0


def test_control_of_reads_each_setting_into_its_field():
    from types import SimpleNamespace

    args = SimpleNamespace(use_adaptive_entropy=1, entropy_target=2.5, entropy_coef_delta=0.05, entropy_coef_min=0.01,
                           entropy_coef_max=0.2)  # fmt: skip
    control = entropy_control.control_of(args)
    assert control == Control(adaptive=True, target=2.5, delta=0.05, low=0.01, high=0.2)
    assert control.adaptive is True  # a bool, whatever the config holds
