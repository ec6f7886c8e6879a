"""Every limit in dhpo_trl/core/losses.py, at the limit and just past it: trust-region edges and epsilon 0, token weight
exactly 0 and 1, the 1e-8 entropy-range threshold, the +-20 log-ratio clamp, one-token and empty sequences, and the
paper's defaults.

Ratios are built in float64 as exp(log(v)) with pi_theta = 1, which gives v exactly for the values used here
(1.25, 0.75, 2, 0.5), so "at the limit" means exactly at it.
"""

import math

import pytest
import torch

from dhpo_trl.core.losses import (
    cispo_per_token_loss,
    dhpo_per_token_loss,
    entropy_mixing_weight,
    gmpo_per_token_loss,
    gspo_per_token_loss,
)


def batch(ratios, advantages, mask=None):
    """(logps, old, advantages, mask) with pi_theta = 1 and r = ratios[i][t] exactly; rows padded with 1."""
    width = max(len(row) for row in ratios)
    table = [[*row, *[1.0] * (width - len(row))] for row in ratios]
    old = -torch.tensor(table, dtype=torch.float64).log()
    logps = torch.zeros_like(old, requires_grad=True)
    if mask is None:
        mask = torch.tensor([[1.0] * len(row) + [0.0] * (width - len(row)) for row in ratios], dtype=torch.float64)
    return logps, old, torch.tensor(advantages, dtype=torch.float64), mask


def assert_values(tensor, expected):
    torch.testing.assert_close(tensor.detach(), torch.tensor(expected, dtype=tensor.dtype), atol=1e-12, rtol=0)


TOKEN_ONLY = dict(mixing="averaged", token_weight=1.0)
SEQUENCE_ONLY = dict(mixing="averaged", token_weight=0.0)


# ------------------------------------------------------------------------------------------- trust-region edges
@pytest.mark.parametrize("clipping", ["branch", "unified"])
def test_a_ratio_exactly_on_the_token_edge_is_not_clipped(clipping):
    eps = dict(epsilon_low_token=0.25, epsilon_high_token=0.25)
    logps, old, adv, mask = batch([[1.25, 1.25 * (1 + 1e-9)], [0.75, 0.75 * (1 - 1e-9)]], [1.0, -1.0])
    loss, info = dhpo_per_token_loss(logps, old, adv, mask, clipping=clipping, **TOKEN_ONLY, **eps)
    assert info["token_clipped_high"].tolist() == [[False, True], [False, False]]
    assert info["token_clipped_low"].tolist() == [[False, False], [False, True]]
    # on the edge the clipped and unclipped terms are equal: the min picks neither as "clipped"
    assert info["uses_clipped_term"].tolist() == [[False, True], [False, True]]
    assert_values(loss, [[-1.25, -1.25], [0.75, 0.75]])


def test_a_sequence_ratio_exactly_on_its_edge_is_not_clipped():
    eps = dict(epsilon_low_seq=0.25, epsilon_high_seq=0.25)
    # one-token sequences: s_i is that token's ratio
    logps, old, adv, mask = batch([[1.25], [1.25 * (1 + 1e-9)], [0.75], [0.75 * (1 - 1e-9)]], [1.0, 1.0, -1.0, -1.0])
    _, info = dhpo_per_token_loss(logps, old, adv, mask, **SEQUENCE_ONLY, **eps)
    assert info["sequence_clipped_high"][:, 0].tolist() == [False, True, False, False]
    assert info["sequence_clipped_low"][:, 0].tolist() == [False, False, False, True]
    assert info["sequence_ratio"].tolist() == pytest.approx([1.25, 1.25, 0.75, 0.75], abs=1e-8)


@pytest.mark.parametrize("clipping", ["branch", "unified"])
def test_epsilon_zero_is_a_one_point_trust_region(clipping):
    """With every epsilon 0, the clipped ratio is exactly 1: r = 1 is not clipped, any other r is (on its side)."""
    zero = dict(epsilon_low_token=0, epsilon_high_token=0.0, epsilon_low_seq=0, epsilon_high_seq=0.0)
    logps, old, adv, mask = batch([[1.0, 2.0, 0.5], [1.0, 2.0, 0.5]], [1.0, -1.0])
    loss, info = dhpo_per_token_loss(logps, old, adv, mask, clipping=clipping, **TOKEN_ONLY, **zero)
    # A > 0: -min(r, 1); A < 0: max(r, 1)
    assert_values(loss, [[-1.0, -1.0, -0.5], [1.0, 2.0, 1.0]])
    assert info["token_clipped_high"].tolist() == [[False, True, False], [False, False, False]]
    assert info["token_clipped_low"].tolist() == [[False, False, False], [False, False, True]]
    assert_values(info["clipped_mixed_ratio"], [[1.0] * 3] * 2)
    (grad,) = torch.autograd.grad(loss[:, 1:].sum(), logps)
    # the clipped tokens get no gradient; the others get -A r (d r / d log pi = r)
    assert_values(grad[:, 1:], [[0.0, -0.5], [2.0, 0.0]])


def test_epsilon_zero_on_the_sequence_branch():
    zero = dict(epsilon_low_seq=0, epsilon_high_seq=0)
    logps, old, adv, mask = batch([[2.0, 0.5], [2.0, 2.0], [0.5, 0.5]], [1.0, 1.0, -1.0])
    loss, info = dhpo_per_token_loss(logps, old, adv, mask, **SEQUENCE_ONLY, **zero)
    # s = 1, 2, 0.5; clipped to 1 everywhere
    assert info["sequence_ratio"].tolist() == pytest.approx([1.0, 2.0, 0.5], abs=1e-12)
    assert_values(loss, [[-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0]])
    assert info["sequence_clipped_high"][:, 0].tolist() == [False, True, False]
    assert info["sequence_clipped_low"][:, 0].tolist() == [False, False, True]


@pytest.mark.parametrize("value", [0, 0.0])
def test_epsilon_zero_is_accepted_and_negative_or_non_numbers_are_not(value):
    logps, old, adv, mask = batch([[1.0]], [1.0])
    for name in ("epsilon_low_token", "epsilon_high_token", "epsilon_low_seq", "epsilon_high_seq"):
        dhpo_per_token_loss(logps, old, adv, mask, **TOKEN_ONLY, **{name: value})
        for bad in (-1e-12, "0.2", None):
            with pytest.raises(ValueError, match=f"`{name}` must be a non-negative number"):
                dhpo_per_token_loss(logps, old, adv, mask, **TOKEN_ONLY, **{name: bad})
    gmpo_per_token_loss(logps, old, adv, mask, epsilon_low=value, epsilon_high=value)
    with pytest.raises(ValueError, match="`gmpo_epsilon_high` must be"):
        gmpo_per_token_loss(logps, old, adv, mask, epsilon_high="0.4")


# ------------------------------------------------------------------------------------------------ token weight
@pytest.mark.parametrize("weight", [0, 0.0, 1, 1.0])
def test_token_weight_exactly_zero_or_one_selects_one_ratio(weight):
    logps, old, adv, mask = batch([[2.0, 0.5, 1.0]], [1.0])  # s = 1
    _, info = dhpo_per_token_loss(logps, old, adv, mask, mixing="averaged", token_weight=weight)
    expected = [2.0, 0.5, 1.0] if weight == 1 else [1.0, 1.0, 1.0]
    assert info["mixed_ratio"][0].tolist() == pytest.approx(expected, abs=1e-12)
    assert info["mixing_weight"].tolist() == [[float(weight)] * 3]


@pytest.mark.parametrize("weight", [1.0 + 1e-12, -1e-12, "0.5", None])
def test_token_weight_outside_zero_one_is_rejected(weight):
    logps, old, adv, mask = batch([[1.0]], [1.0])
    with pytest.raises(ValueError, match=r"`token_weight` must be in \[0, 1\]"):
        dhpo_per_token_loss(logps, old, adv, mask, mixing="averaged", token_weight=weight)


# ------------------------------------------------------------------------------------------ entropy threshold
def test_entropy_range_exactly_at_the_threshold_is_constant():
    """A range of exactly 1e-8 (in float32, where the weight is computed) gives w = 0.5; twice that is a range."""
    mask = torch.ones(1, 2)
    at_threshold = torch.tensor([[0.0, 1e-8]])
    above = torch.tensor([[0.0, 2e-8]])
    assert entropy_mixing_weight(at_threshold, mask).tolist() == [[0.5, 0.5]]
    assert entropy_mixing_weight(above, mask).tolist() == [[0.0, 1.0]]
    for scope in ("batch", "sequence"):
        assert entropy_mixing_weight(at_threshold, mask, scope=scope).tolist() == [[0.5, 0.5]]
        assert entropy_mixing_weight(above, mask, scope=scope).tolist() == [[0.0, 1.0]]
    entropies = torch.tensor([[0.0, 1e-8, 2e-8]])
    assert entropy_mixing_weight(entropies, torch.ones(1, 3), entropy_range=(0.0, 1e-8)).tolist() == [[0.5] * 3]
    assert entropy_mixing_weight(entropies, torch.ones(1, 3), entropy_range=(0.0, 2e-8)).tolist() == [
        [0.0, pytest.approx(0.5), 1.0]
    ]


def test_sequence_scope_threshold_is_per_row_and_padding_is_neutral():
    entropies = torch.tensor([[3.0, 3.0 + 1e-8, 9.0], [1.0, 2.0, 9.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    weight = entropy_mixing_weight(entropies.double(), mask, scope="sequence")
    # row 0's range is below float32 resolution at 3.0 (constant), row 1 spans [0, 1], row 2 is all padding
    assert weight.tolist() == [[0.5, 0.5, 0.5], [0.0, 1.0, 0.5], [0.5, 0.5, 0.5]]
    assert weight.dtype == torch.float32
    assert entropy_mixing_weight(entropies, torch.zeros(3, 3)).tolist() == [[0.5] * 3] * 3


def test_explicit_range_clamps_to_zero_one():
    weight = entropy_mixing_weight(torch.tensor([[-1.0, 0.5, 1.0, 4.0]]), torch.ones(1, 4), entropy_range=(0.0, 2.0))
    assert weight.tolist() == [[0.0, 0.25, 0.5, 1.0]]


def test_default_entropy_scope_is_the_whole_batch():
    entropies, mask = torch.tensor([[0.0, 1.0], [2.0, 4.0]]), torch.ones(2, 2)
    assert entropy_mixing_weight(entropies, mask).tolist() == [[0.0, 0.25], [0.5, 1.0]]


# --------------------------------------------------------------------------------------------- log-ratio clamp
def test_log_ratio_is_clamped_at_plus_minus_twenty():
    logps = torch.zeros(1, 5, dtype=torch.float64)
    old = -torch.tensor([[19.5, 20.0, 25.0, -20.0, -25.0]], dtype=torch.float64)  # log r = -old
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 5, dtype=torch.float64)
    _, info = dhpo_per_token_loss(logps, old, adv, mask, **TOKEN_ONLY)
    expected = [math.exp(19.5), math.exp(20.0), math.exp(20.0), math.exp(-20.0), math.exp(-20.0)]
    assert info["token_ratio"][0].tolist() == pytest.approx(expected, rel=1e-12)
    assert info["sequence_ratio"].item() == pytest.approx(math.exp((19.5 + 20 + 20 - 20 - 20) / 5), rel=1e-12)
    _, gmpo = gmpo_per_token_loss(logps, old, adv, mask)
    assert gmpo["token_ratio"][0].tolist() == pytest.approx(expected, rel=1e-12)


def test_one_token_and_empty_sequences():
    logps, old, adv, _ = batch([[2.0, 0.5], [2.0, 0.5], [2.0, 0.5]], [1.0, 1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    _, info = dhpo_per_token_loss(logps, old, adv, mask, **TOKEN_ONLY)
    assert info["sequence_ratio"].tolist() == pytest.approx([1.0, 0.5, 1.0], abs=1e-12)  # empty: log s = 0
    _, gmpo = gmpo_per_token_loss(logps, old, adv, mask, epsilon_low=10, epsilon_high=10)
    assert gmpo["sequence_ratio"].tolist() == pytest.approx([1.0, 0.5, 1.0], abs=1e-12)


# --------------------------------------------------------------------------------------------------- GMPO edges
def test_gmpo_log_ratio_exactly_on_the_clip_is_not_clipped():
    logps, old, adv, mask = batch([[math.exp(0.25), math.exp(0.3)], [math.exp(-0.25), math.exp(-0.3)]], [1.0, -1.0])
    old = -torch.tensor([[0.25, 0.3], [-0.25, -0.3]], dtype=torch.float64)  # exact log-ratios
    loss, info = gmpo_per_token_loss(logps, old, adv, mask, epsilon_low=0.25, epsilon_high=0.25)
    assert info["token_clipped"].tolist() == [[False, True], [False, True]]
    # A > 0: mean(0.25, min(0.3, 0.25)); A < 0: mean(-0.25, max(-0.3, -0.25))
    assert info["sequence_ratio"].tolist() == pytest.approx([math.exp(0.25), math.exp(-0.25)], abs=1e-12)
    assert loss[:, 0].tolist() == pytest.approx([-math.exp(0.25), math.exp(-0.25)], abs=1e-12)


def test_gmpo_epsilon_zero():
    logps, old, adv, mask = batch([[2.0, 0.5, 1.0], [2.0, 0.5, 1.0]], [1.0, -1.0])
    loss, info = gmpo_per_token_loss(logps, old, adv, mask, epsilon_low=0, epsilon_high=0)
    # A > 0 keeps min(log r, 0): (0, log 0.5, 0); A < 0 keeps max(log r, 0): (log 2, 0, 0)
    assert info["token_clipped"].tolist() == [[True, False, False], [False, True, False]]
    assert info["sequence_ratio"].tolist() == pytest.approx([0.5 ** (1 / 3), 2 ** (1 / 3)], abs=1e-12)
    assert_values(loss, [[-(0.5 ** (1 / 3))] * 3, [2 ** (1 / 3)] * 3])


# ------------------------------------------------------------------------------------------------------ defaults
def test_defaults_are_the_papers():
    """DHPO-E with branch clipping, 0.2 / 0.28 on both branches, batch entropy scope; GMPO's 0.4 / 0.4."""
    # each trust-region edge binds somewhere: row 0 (A > 0) has s = 1.31 and r up to 1.65, row 1 (A < 0) has
    # s = 0.76 and r down to 0.61
    log_ratios = [[0.5, 0.1, 0.3, 0.2, 0.25], [-0.5, -0.1, -0.3, -0.2, -0.25], [0.05, -0.1, 0.0, 0.1, -0.05]]
    logps = torch.zeros(3, 5, dtype=torch.float64)
    old = -torch.tensor(log_ratios, dtype=torch.float64)
    entropies = torch.rand(3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    adv, mask = torch.tensor([1.0, -0.5, 0.8], dtype=torch.float64), torch.ones(3, 5, dtype=torch.float64)
    explicit = dict(mixing="entropy", clipping="branch", epsilon_low_token=0.2, epsilon_high_token=0.28,
                    epsilon_low_seq=0.2, epsilon_high_seq=0.28, entropy_scope="batch")  # fmt: skip
    default_loss, default_info = dhpo_per_token_loss(logps, old, adv, mask, entropies)
    loss, info = dhpo_per_token_loss(logps, old, adv, mask, entropies, **explicit)
    assert torch.equal(default_loss, loss)
    for key in info:
        assert torch.equal(default_info[key], info[key]), key
    averaged, _ = dhpo_per_token_loss(logps, old, adv, mask, mixing="averaged")
    half, _ = dhpo_per_token_loss(logps, old, adv, mask, mixing="averaged", token_weight=0.5)
    assert torch.equal(averaged, half)
    default_gmpo, _ = gmpo_per_token_loss(logps, old, adv, mask)
    gmpo, _ = gmpo_per_token_loss(logps, old, adv, mask, epsilon_low=0.4, epsilon_high=0.4)
    assert torch.equal(default_gmpo, gmpo)
    # and the defaults do bind on this batch, so a different default would change the loss
    for other in (dict(epsilon_high_token=0.3), dict(epsilon_low_seq=0.25), dict(epsilon_high_seq=0.3),
                  dict(epsilon_low_token=0.25), dict(clipping="unified"), dict(entropy_scope="sequence")):  # fmt: skip
        changed, _ = dhpo_per_token_loss(logps, old, adv, mask, entropies, **{**explicit, **other})
        assert not torch.equal(changed, loss), other
    for other in (dict(epsilon_low=0.5), dict(epsilon_high=0.5)):
        changed, _ = gmpo_per_token_loss(logps, old, adv, mask, **{"epsilon_low": 0.4, "epsilon_high": 0.4, **other})
        assert not torch.equal(changed, gmpo), other


# --------------------------------------------------------------------------------------- dtypes, signs, messages
@pytest.mark.parametrize("mask_dtype", [torch.float64, torch.int64, torch.bool])
def test_outputs_follow_the_log_probs_dtype(mask_dtype):
    """float32 log-probs give float32 losses and ratios whatever the dtype of the mask and the advantages."""
    logps = torch.zeros(2, 3, requires_grad=True)
    old = -torch.tensor([[0.1, 0.2, 0.3], [0.0, -0.1, 0.2]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).to(mask_dtype)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    entropies = torch.rand(2, 3, dtype=torch.float64)
    loss, info = dhpo_per_token_loss(logps, old, adv, mask, entropies)
    assert loss.dtype == torch.float32
    for key in ("token_ratio", "sequence_ratio", "mixed_ratio", "clipped_mixed_ratio", "mixing_weight"):
        assert info[key].dtype == torch.float32, key
    gmpo, gmpo_info = gmpo_per_token_loss(logps, old, adv, mask)
    assert gmpo.dtype == gmpo_info["sequence_ratio"].dtype == torch.float32
    assert info["sequence_ratio"][0].item() == pytest.approx(math.exp(0.15), rel=1e-6)  # mean over 2 tokens


def test_entropy_weight_is_float32_for_a_float64_range():
    entropies, mask = torch.tensor([[0.0, 1.0, 2.0]]), torch.ones(1, 3)
    bounds = (torch.tensor(0.0, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64))
    weight = entropy_mixing_weight(entropies, mask, entropy_range=bounds)
    assert weight.dtype == torch.float32 and weight.tolist() == [[0.0, 0.5, 1.0]]


@pytest.mark.parametrize("clipping", ["branch", "unified"])
def test_a_zero_advantage_clips_nothing_and_costs_nothing(clipping):
    logps, old, adv, mask = batch([[3.0, 0.2, 1.0], [3.0, 3.0, 3.0], [0.2, 0.2, 0.2]], [0.0, 0.0, 0.0])
    loss, info = dhpo_per_token_loss(logps, old, adv, mask, mixing="averaged", clipping=clipping)
    assert_values(loss, [[0.0] * 3] * 3)
    for key in ("token_clipped_low", "token_clipped_high", "sequence_clipped_low", "sequence_clipped_high",
                "uses_clipped_term"):  # fmt: skip
        assert info[key].dtype == torch.bool and info[key].shape == (3, 3) and not info[key].any(), key
    gmpo, _ = gmpo_per_token_loss(logps, old, adv, mask)
    assert_values(gmpo, [[0.0] * 3] * 3)


def test_advantages_per_token_are_accepted():
    logps, old, adv, mask = batch([[1.5, 0.5], [2.0, 0.9]], [1.0, -0.5])
    per_sequence, _ = dhpo_per_token_loss(logps, old, adv, mask, mixing="averaged")
    per_token, _ = dhpo_per_token_loss(logps, old, adv.unsqueeze(1).expand(2, 2), mask, mixing="averaged")
    assert torch.equal(per_sequence, per_token)


def call(function, **overrides):
    logps, old, adv, mask = batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [1.0, -1.0])
    kwargs = {"per_token_logps": logps, "old_per_token_logps": old, "advantages": adv, "mask": mask, **overrides}
    if function is dhpo_per_token_loss:
        kwargs.setdefault("entropies", torch.zeros(2, 3))
    return function(**kwargs)


@pytest.mark.parametrize(
    ("function", "overrides", "message"),
    [
        (dhpo_per_token_loss, dict(mixing="geometric"),
         "`mixing` must be one of ('averaged', 'entropy'), got 'geometric'."),
        (dhpo_per_token_loss, dict(clipping="both"), "`clipping` must be one of ('branch', 'unified'), got 'both'."),
        (dhpo_per_token_loss, dict(token_weight=2), "`token_weight` must be in [0, 1], got 2."),
        (dhpo_per_token_loss, dict(epsilon_high_seq=-0.5),
         "`epsilon_high_seq` must be a non-negative number, got -0.5."),
        (dhpo_per_token_loss, dict(entropies=None),
         "`entropies` is required for mixing='entropy' (pass the token entropies of the current policy, or use "
         "mixing='averaged')."),
        (dhpo_per_token_loss, dict(per_token_logps=torch.zeros(2, 3, 1)),
         "`per_token_logps` must have shape (batch, seq), got (2, 3, 1)."),
        (dhpo_per_token_loss, dict(entropies=torch.zeros(2, 4)),
         "`entropies` must have the same shape as `per_token_logps` (2, 3), got (2, 4)."),
        (dhpo_per_token_loss, dict(advantages=torch.zeros(2, 2)),
         "`advantages` must have shape (2,), (2, 1) or (2, 3), got (2, 2)."),
        (dhpo_per_token_loss, dict(advantages=torch.zeros(2, 3, 1)),
         "`advantages` must have shape (2,), (2, 1) or (2, 3), got (2, 3, 1)."),
        (dhpo_per_token_loss, dict(entropy_scope="global"),
         "`entropy_norm_scope='global'` needs `entropy_range`, the (min, max) entropy over every process."),
        (dhpo_per_token_loss, dict(entropy_scope="token"),
         "`entropy_norm_scope` must be one of ('batch', 'sequence', 'global'), got 'token'."),
        (gmpo_per_token_loss, dict(epsilon_low=-1), "`gmpo_epsilon_low` must be a non-negative number, got -1."),
        (gmpo_per_token_loss, dict(old_per_token_logps=torch.zeros(2, 2)),
         "`old_per_token_logps` must have the same shape as `per_token_logps` (2, 3), got (2, 2)."),
        (gmpo_per_token_loss, dict(per_token_logps=torch.zeros(6)),
         "`per_token_logps` must have shape (batch, seq), got (6,)."),
        (gmpo_per_token_loss, dict(advantages=torch.zeros(2, 3)),
         "`advantages` must be one value per sequence for GMPO, got a (B, T) tensor."),
        (gspo_per_token_loss, dict(advantages=torch.zeros(2, 3)),
         "`advantages` must be one value per sequence for GSPO, got a (B, T) tensor."),
        (cispo_per_token_loss, dict(cap=0),
         "`cap` must be a positive number (the largest importance weight), got 0."),
    ],
)  # fmt: skip
def test_bad_input_messages(function, overrides, message):
    with pytest.raises(ValueError) as error:
        call(function, **overrides)
    assert str(error.value) == message


def test_an_explicit_entropy_range_overrides_the_batch_range():
    """The trainer's "global" scope passes the range of all processes: it, not this batch's, normalises w."""
    logps, old, adv, mask = batch([[1.0, 1.0, 1.0]], [1.0])
    entropies = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    _, local = dhpo_per_token_loss(logps, old, adv, mask, entropies)
    _, wider = dhpo_per_token_loss(logps, old, adv, mask, entropies, entropy_range=(0.0, 4.0))
    assert local["mixing_weight"].tolist() == [[0.0, 0.5, 1.0]]
    assert wider["mixing_weight"].tolist() == [[0.25, 0.5, 0.75]]
