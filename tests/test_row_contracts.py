"""Contracts of the baseline rows' pure losses and their wiring in the objective registry: defaults, bad input,
dtypes, the cap boundary and the clip indicators, each checked on hand-chosen numbers."""

import math
from types import SimpleNamespace

import pytest
import torch

from dhpo_trl.core.losses import cispo_per_token_loss, gmpo_per_token_loss, grpo_per_token_loss, gspo_per_token_loss
from dhpo_trl.core.objectives import get_objective

# One sequence of two tokens with log-ratios 0.5 and -0.5 (r = e^0.5, e^-0.5), plus a padded third position.
LOG_R = [[0.5, -0.5, 0.0]]
MASK = torch.tensor([[1, 1, 0]])


def batch(log_r=LOG_R, advantage=1.0, dtype=torch.float32):
    logps = torch.tensor([[-1.0, -2.0, -3.0]], dtype=dtype, requires_grad=True)
    old = logps.detach() - torch.tensor(log_r, dtype=dtype)
    return logps, old, torch.tensor([advantage], dtype=torch.float64), MASK


@pytest.mark.parametrize(
    "loss, defaults",
    [
        (grpo_per_token_loss, dict(epsilon_low=0.2, epsilon_high=0.2)),
        (gspo_per_token_loss, dict(epsilon_low=3e-4, epsilon_high=4e-4)),
        (cispo_per_token_loss, dict(cap=1.2)),
    ],
)
def test_defaults_are_the_papers_and_advantages_take_the_log_probs_dtype(loss, defaults):
    # float64 advantages, float32 log-probs; ratios above 1 for A > 0 and below 1 for A < 0, so both bounds bind
    for log_r, advantage in (([[0.01, 0.5, 0.0]], 1.0), ([[-0.01, -0.5, 0.0]], -1.0)):
        logps, old, advantages, mask = batch(log_r=log_r, advantage=advantage)
        default_loss, _ = loss(logps, old, advantages, mask)
        explicit, _ = loss(logps, old, advantages, mask, **defaults)
        assert default_loss.dtype == torch.float32
        torch.testing.assert_close(default_loss, explicit, rtol=0, atol=0)
        for name, value in defaults.items():  # and each default acts on one of the two batches
            looser = loss(logps, old, advantages, mask, **{**defaults, name: value * 2})[0]
            if not torch.allclose(looser, default_loss):
                defaults = {k: v for k, v in defaults.items() if k != name}
    assert defaults == {}, f"defaults without effect on either batch: {defaults}"


def test_grpo_default_clip_values_by_hand():
    logps, old, advantages, mask = batch()
    loss, info = grpo_per_token_loss(logps, old, advantages, mask)
    # A > 0: min(r, clip(r, 0.8, 1.2)) -> token 1 clipped at 1.2, token 2 keeps e^-0.5
    assert loss[0, :2].tolist() == pytest.approx([-1.2, -math.exp(-0.5)], rel=1e-6)
    assert info["clipped_high"][0].tolist() == [True, False, False]


@pytest.mark.parametrize("loss", [grpo_per_token_loss, gspo_per_token_loss])
@pytest.mark.parametrize("name", ["epsilon_low", "epsilon_high"])
def test_negative_epsilons_are_refused_by_name(loss, name):
    logps, old, advantages, mask = batch()
    with pytest.raises(ValueError, match=f"`{name}` must be a non-negative number, got -0.1"):
        loss(logps, old, advantages, mask, **{name: -0.1})


@pytest.mark.parametrize("loss", [grpo_per_token_loss, gspo_per_token_loss, cispo_per_token_loss, gmpo_per_token_loss])
def test_old_log_probs_of_another_shape_are_refused_by_name(loss):
    logps, old, advantages, mask = batch()
    with pytest.raises(ValueError, match="old_per_token_logps"):
        loss(logps, old[:, :2], advantages, mask)


def test_cispo_weight_at_exactly_the_cap_is_not_counted_as_capped():
    cap = math.exp(0.25)  # r equal to the cap: min(r, cap) leaves it unchanged, so it is not clipped
    logps, old, advantages, mask = batch(log_r=[[0.25, 0.26, 0.0]])
    loss, info = cispo_per_token_loss(logps, old, advantages, mask, cap=cap)
    assert info["weight_capped"][0].tolist() == [False, True, False]
    assert info["clipped_high"][0].tolist() == [False, True, False]
    assert loss[0, :2].tolist() == pytest.approx([cap * 1.0, cap * 2.0], rel=1e-5)  # -cap * A * log pi


def test_cispo_counts_a_capped_weight_as_clipped_only_for_a_positive_advantage():
    # TRL's cispo_clip_ratio: the cap binds the gradient only where A > 0; at A = 0 the token has no gradient at all
    logps, old, _, mask = batch(log_r=[[0.5, 0.5, 0.0]])
    for advantage, clipped in ((1.0, True), (0.0, False), (-1.0, False)):
        _, info = cispo_per_token_loss(logps, old, torch.tensor([advantage]), mask)
        assert info["weight_capped"][0].tolist() == [True, True, False]
        assert info["clipped_high"][0].tolist() == [clipped, clipped, False]


def test_cispo_accepts_a_cap_below_one():
    # any positive cap is an importance-weight bound; 0.5 scales every weight above it down to 0.5
    logps, old, advantages, mask = batch(log_r=[[0.5, -1.0, 0.0]])  # r = 1.65 (capped), 0.37 (kept)
    loss, info = cispo_per_token_loss(logps, old, advantages, mask, cap=0.5)
    assert info["weight_capped"][0].tolist() == [True, False, False]
    assert loss[0, :2].tolist() == pytest.approx([0.5 * 1.0, math.exp(-1.0) * 2.0], rel=1e-5)  # -w * A * log pi


@pytest.mark.parametrize("advantage, low, high", [(1.0, [False, False], [True, False]), (-1.0, [False, True], [False, False])])
def test_gmpo_clip_indicators_split_by_the_sign_of_the_advantage(advantage, low, high):
    # log-ratios 0.5 and -0.5 against a clip of [-0.4, 0.4]: for A > 0 only the upper clip binds (token 1),
    # for A < 0 only the lower one (token 2); the padded position never counts.
    logps, old, advantages, mask = batch(advantage=advantage)
    _, info = gmpo_per_token_loss(logps, old, advantages, mask)
    assert info["token_clipped"][0].tolist() == [a or b for a, b in zip(low, high)] + [False]
    assert info["clipped_low"][0].tolist() == low + [False]
    assert info["clipped_high"][0].tolist() == high + [False]


def args(**overrides):
    fields = dict(epsilon=0.2, epsilon_high=None, delta=None, importance_sampling_level="sequence")
    return SimpleNamespace(**{**fields, **overrides})


def test_grpo_row_passes_epsilon_as_the_lower_clip():
    logps, old, advantages, mask = batch(advantage=-1.0)
    # A < 0: the lower clip binds on token 2 (r = e^-0.5 = 0.61) at 1 - 0.3, not at the default 1 - 0.2
    loss, _, _ = get_objective("grpo").compute(logps, old, advantages, mask, None, args(epsilon=0.3), None)
    assert loss[0, 1].item() == pytest.approx(0.7, rel=1e-6)


def test_gspo_row_passes_epsilon_high_and_delta():
    logps, old, advantages, mask = batch(log_r=[[1.5, 1.5, 0.0]], advantage=1.0)  # s = e^1.5 = 4.48
    loss, _, _ = get_objective("gspo").compute(logps, old, advantages, mask, None, args(epsilon_high=0.5), None)
    assert loss[0, 0].item() == pytest.approx(-1.5, rel=1e-6)  # clipped at 1 + 0.5
    negative = batch(log_r=[[1.5, 1.5, 0.0]], advantage=-1.0)
    loss, _, _ = get_objective("gspo").compute(*negative, None, args(delta=3.0), None)
    assert loss[0, 0].item() == pytest.approx(3.0, rel=1e-6)  # the dual clip caps s at delta for A < 0


def test_grpo_row_uses_epsilon_for_the_upper_clip_when_epsilon_high_is_unset():
    logps, old, advantages, mask = batch(advantage=1.0)  # token 1: r = e^0.5 = 1.65, clipped at 1 + 0.3
    loss, _, _ = get_objective("grpo").compute(logps, old, advantages, mask, None, args(epsilon=0.3), None)
    assert loss[0, 0].item() == pytest.approx(-1.3, rel=1e-6)


def dhpo_args(**overrides):
    fields = dict(mixing="entropy", token_weight=0.5, clipping="branch", epsilon_low_token=0.2,
                  epsilon_high_token=0.28, epsilon_low_seq=0.2, epsilon_high_seq=0.28, entropy_norm_scope="batch",
                  delta=None)  # fmt: skip
    return SimpleNamespace(**{**fields, **overrides})


@pytest.mark.parametrize(
    "setting, value, log_r, advantage",
    [
        ("epsilon_low_token", 0.05, [-0.3, -0.2], -1.0),  # r = 0.74, 0.82 below 1 - 0.05 (and 0.74 below 0.8)
        ("epsilon_high_token", 0.05, [0.6, 0.1], 1.0),  # r = 1.82 above 1.28 and 1.05
        ("epsilon_low_seq", 0.05, [-0.3, -0.2], -1.0),  # s = e^-0.25 = 0.78 below 0.8 and 0.95
        ("epsilon_high_seq", 0.05, [0.6, 0.1], 1.0),  # s = e^0.35 = 1.42 above 1.28 and 1.05
        ("delta", 1.5, [1.5, 1.2], -1.0),  # ratios far above 1 for A < 0: the dual clip caps them
    ],
)
def test_dhpo_row_passes_each_clip_setting_to_the_loss(setting, value, log_r, advantage):
    from dhpo_trl.core.losses import dhpo_per_token_loss

    logps, old, advantages, mask = batch(log_r=[[*log_r, 0.0]], advantage=advantage)
    averaged = dict(mixing="averaged", token_weight=0.5)  # both branches weigh on every token
    row = get_objective("dhpo").compute(
        logps, old, advantages, mask, None, dhpo_args(**averaged, **{setting: value}), None
    )[0]
    expected = dhpo_per_token_loss(logps, old, advantages, mask, **averaged, **{setting: value})[0]
    default = dhpo_per_token_loss(logps, old, advantages, mask, **averaged)[0]
    torch.testing.assert_close(row, expected)
    assert not torch.allclose(row, default)  # the setting changes this batch's loss


def test_dhpo_row_passes_the_global_entropy_range():
    from dhpo_trl.core.losses import dhpo_per_token_loss

    logps, old, advantages, mask = batch(log_r=[[0.6, -0.5, 0.0]], advantage=1.0)
    entropies = torch.tensor([[0.3, 1.1, 9.0]])
    span = (torch.tensor(0.0), torch.tensor(2.0))  # the range reduced across processes, wider than this batch's
    row = get_objective("dhpo").compute(logps, old, advantages, mask, entropies, dhpo_args(), span)
    _, info = dhpo_per_token_loss(logps, old, advantages, mask, entropies, entropy_range=span)
    torch.testing.assert_close(row[2]["mixing_weight"], info["mixing_weight"])
    assert row[2]["mixing_weight"][0, :2].tolist() == pytest.approx([0.15, 0.55])  # (H - 0) / 2


@pytest.mark.parametrize("advantage", [0.0, 0.5, -0.5])
def test_gmpo_counts_no_clip_for_a_zero_advantage_and_splits_fractional_ones_by_sign(advantage):
    # A = 0: no gradient, nothing clipped (the sign-0 pessimistic log-ratio is not a clip); |A| < 1 still counts.
    logps, old, advantages, mask = batch(advantage=advantage)
    _, info = gmpo_per_token_loss(logps, old, advantages, mask)
    expected_low = [False, advantage < 0, False]
    expected_high = [advantage > 0, False, False]
    assert info["clipped_low"][0].tolist() == expected_low
    assert info["clipped_high"][0].tolist() == expected_high
    assert info["token_clipped"][0].tolist() == [a or b for a, b in zip(expected_low, expected_high)]


@pytest.mark.parametrize("side", ["low", "high"])
def test_grpo_ratio_exactly_at_a_clip_bound_is_not_counted_as_clipped(side):
    log_r = -0.25 if side == "low" else 0.25
    logps, old, advantages, mask = batch(log_r=[[log_r, 0.0, 0.0]], advantage=-1.0 if side == "low" else 1.0)
    ratio = float(torch.exp(logps.detach() - old)[0, 0])  # the float32 ratio the loss sees
    epsilon = {"epsilon_low": 1.0 - ratio} if side == "low" else {"epsilon_high": ratio - 1.0}
    _, info = grpo_per_token_loss(logps, old, advantages, mask, **epsilon)
    assert info[f"clipped_{side}"][0, 0].item() is False  # min(r, clip(r)) leaves r unchanged at the bound


def test_dhpo_ratio_exactly_at_delta_is_not_counted_as_dual_clipped():
    from dhpo_trl.core.losses import dhpo_per_token_loss

    logps, old, advantages, mask = batch(log_r=[[1.5, 0.0, 0.0]], advantage=-1.0)
    ratio = float(torch.exp(logps.detach() - old)[0, 0])  # 4.48 in float32; w = 1, so m = r
    settings = dict(mixing="averaged", token_weight=1.0)
    _, at = dhpo_per_token_loss(logps, old, advantages, mask, delta=ratio, **settings)
    _, below = dhpo_per_token_loss(logps, old, advantages, mask, delta=ratio - 0.01, **settings)
    assert at["dual_clipped"][0, 0].item() is False and below["dual_clipped"][0, 0].item() is True


ROWS = [grpo_per_token_loss, gspo_per_token_loss, cispo_per_token_loss, gmpo_per_token_loss]


@pytest.mark.parametrize("loss", ROWS)
def test_bad_shapes_are_refused_with_the_field_and_the_expected_shape(loss):
    logps, old, advantages, mask = batch()
    with pytest.raises(ValueError, match=r"^`per_token_logps` must have shape \(batch, seq\), got \(3,\)\.$"):
        loss(logps[0], old[0], advantages, mask[0])
    with pytest.raises(ValueError, match=r"^`mask` must have the same shape as `per_token_logps` \(1, 3\), got \(1, 2\)"):
        loss(logps, old, advantages, mask[:, :2])
    with pytest.raises(ValueError, match=r"^`advantages` must have shape \(1,\), \(1, 1\) or \(1, 3\), got \(1, 2\)\.$"):
        loss(logps, old, torch.ones(1, 2), mask)


def test_unknown_algorithm_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"^algorithm='ppo' is not supported: use one of \['dhpo', 'gmpo', 'grpo', "):
        get_objective("ppo")
