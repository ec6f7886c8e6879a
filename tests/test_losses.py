"""The pure losses against independent, loop-based implementations of the paper's equations and of TRL's.

The references below deliberately share no code with `dhpo_trl.core.losses`: they walk over each sequence and its
valid tokens with Python loops, exactly as eqs. 2, 4, 5, 7, 8, 10, 11 and 16 of the paper (and GMPO's
geometric-mean objective) read, and TRL's formulas are copied from `GRPOTrainer._compute_loss` (trl 1.16).
"""

import math

import pytest
import torch
from reference_losses import (
    constant_weights,
    reference_dhpo,
    reference_entropy_weights,
    seq_mean_token_mean,
    token_mean,
    valid_positions,
    verl_cispo_terms,
    verl_gspo_terms,
    verl_vanilla_terms,
)

from dhpo_trl.core import aggregation
from dhpo_trl.core.losses import (
    cispo_per_token_loss,
    dhpo_per_token_loss,
    entropy_mixing_weight,
    gmpo_per_token_loss,
    grpo_per_token_loss,
    gspo_per_token_loss,
    sapo_per_token_loss,
    vespo_per_token_loss,
)

B, T = 5, 7
LENGTHS = [7, 4, 1, 6, 3]  # varying completion lengths, right padding as in TRL's completion_mask
EPS = dict(epsilon_low_token=0.2, epsilon_high_token=0.28, epsilon_low_seq=0.1, epsilon_high_seq=0.15)


def make_batch(seed=0, dtype=torch.float32, log_ratio_scale=0.4):
    """Log-probs whose ratios often leave the trust regions, advantages of both signs, padded masks."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    logps = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * log_ratio_scale
    mask = torch.zeros(B, T)
    for i, length in enumerate(LENGTHS):
        mask[i, :length] = 1
    advantages = torch.tensor([1.3, -0.7, 0.9, -1.1, 0.4], dtype=torch.float64)
    entropies = torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    return (
        logps.to(dtype).requires_grad_(),
        old.to(dtype),
        advantages.to(dtype),
        mask.to(dtype),
        entropies.to(dtype),
    )


def reference_eq7_loss(terms, mask):
    """Eq. 7 as a loss: mean over responses with tokens of the per-response token mean."""
    per_sequence = []
    for i in range(mask.size(0)):
        valid = valid_positions(mask, i)
        if valid:
            per_sequence.append(sum(terms[i, t] for t in valid) / len(valid))
    return sum(per_sequence) / mask.size(0)  # TRL divides by B (clamped counts give 0 for empty rows)


def grpo_aggregate(per_token_loss, mask):
    """TRL's loss_type="grpo" aggregation (grpo_trainer.py, `_compute_loss`)."""
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def trl_per_token_loss(logps, old, advantages, mask, epsilon_low, epsilon_high, level, delta=None):
    """TRL's clipped surrogate, written as `GRPOTrainer._compute_loss` computes it for loss_type="grpo"."""
    advantages = advantages.reshape(-1, 1)
    log_ratio = logps - old
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    return -torch.min(coef_1 * advantages, coef_2 * advantages)


def trl_cispo_per_token_loss(logps, old, advantages, epsilon_high):
    """TRL's loss_type="cispo" per-token loss."""
    clamped_ratios = torch.clamp(torch.exp(logps - old), max=epsilon_high).detach()
    return -clamped_ratios * advantages.reshape(-1, 1) * logps


def grad_of(loss, tensor):
    (grad,) = torch.autograd.grad(loss, tensor)
    return grad


# --------------------------------------------------------------------------- against the paper's equations
@pytest.mark.parametrize("mixing", ["averaged", "entropy"])
@pytest.mark.parametrize("clipping", ["branch", "unified"])
@pytest.mark.parametrize("advantage_shape", ["(B,)", "(B,1)"])
def test_matches_independent_equations(mixing, clipping, advantage_shape):
    logps, old, advantages, mask, entropies = make_batch(dtype=torch.float64)
    if advantage_shape == "(B,1)":
        advantages = advantages.unsqueeze(1)
    loss, info = dhpo_per_token_loss(
        logps, old, advantages, mask, entropies, mixing=mixing, token_weight=0.3, clipping=clipping, **EPS
    )
    if mixing == "averaged":
        weights = [[0.3] * T for _ in range(B)]
    else:
        weights = reference_entropy_weights(entropies, mask)
    terms = reference_dhpo(logps, old, advantages, mask, weights, clipping, EPS)

    # the entropy weight is normalised in float32 (entropies are float32 in training), hence the looser tolerance
    tol = 1e-12 if mixing == "averaged" else 1e-7
    assert loss.shape == (B, T)
    for (i, t), term in terms.items():
        assert loss[i, t].item() == pytest.approx(term.item(), abs=tol)
        assert info["mixing_weight"][i, t].item() == pytest.approx(weights[i][t], abs=tol)
    # the batch really exercises the clip: some tokens pick the clipped term, some don't
    picked = info["uses_clipped_term"][mask.bool()]
    assert 0 < picked.sum() < picked.numel()

    expected_loss = reference_eq7_loss(terms, mask)
    actual_loss = grpo_aggregate(loss, mask)
    assert actual_loss.item() == pytest.approx(expected_loss.item(), abs=tol)
    torch.testing.assert_close(grad_of(actual_loss, logps), grad_of(expected_loss, logps), atol=tol, rtol=0)


def test_info_ratios_match_definitions():
    logps, old, advantages, mask, entropies = make_batch(dtype=torch.float64)
    _, info = dhpo_per_token_loss(logps, old, advantages, mask, entropies, **EPS)
    for i, length in enumerate(LENGTHS):
        log_ratios = [(logps[i, t] - old[i, t]).item() for t in range(length)]
        assert info["sequence_ratio"][i].item() == pytest.approx(math.exp(sum(log_ratios) / length), rel=1e-12)
        for t in range(length):
            assert info["token_ratio"][i, t].item() == pytest.approx(math.exp(log_ratios[t]), rel=1e-12)
            w = info["mixing_weight"][i, t].item()
            mixed = w * math.exp(log_ratios[t]) + (1 - w) * info["sequence_ratio"][i].item()
            assert info["mixed_ratio"][i, t].item() == pytest.approx(mixed, rel=1e-12)
    # clip flags follow the sign of A and the trust region of each branch
    adv = advantages.unsqueeze(1)
    token_ratio = info["token_ratio"]
    assert torch.equal(info["token_clipped_low"], (token_ratio < 0.8) & (adv < 0))
    assert torch.equal(info["token_clipped_high"], (token_ratio > 1.28) & (adv > 0))
    seq = info["sequence_ratio"].unsqueeze(1).expand(B, T)
    assert torch.equal(info["sequence_clipped_low"], (seq < 0.9) & (adv < 0))
    assert torch.equal(info["sequence_clipped_high"], (seq > 1.15) & (adv > 0))
    assert info["token_clipped_low"].any() and info["token_clipped_high"].any()


# --------------------------------------------------------------------------- equals TRL at w = 1 and w = 0
@pytest.mark.parametrize("clipping", ["branch", "unified"])
@pytest.mark.parametrize("advantage_shape", ["(B,)", "(B,1)"])
def test_token_weight_one_is_trl_token_level_grpo(clipping, advantage_shape):
    logps, old, advantages, mask, entropies = make_batch(seed=1)
    if advantage_shape == "(B,1)":
        advantages = advantages.unsqueeze(1)
    ours, _ = dhpo_per_token_loss(
        logps, old, advantages, mask, mixing="averaged", token_weight=1.0, clipping=clipping, **EPS
    )
    trl = trl_per_token_loss(logps, old, advantages, mask, 0.2, 0.28, level="token")
    torch.testing.assert_close(ours * mask, trl * mask, atol=1e-6, rtol=0)
    ours_loss, trl_loss = grpo_aggregate(ours, mask), grpo_aggregate(trl, mask)
    assert abs(ours_loss.item() - trl_loss.item()) <= 1e-6
    torch.testing.assert_close(grad_of(ours_loss, logps), grad_of(trl_loss, logps), atol=1e-6, rtol=0)


@pytest.mark.parametrize("clipping", ["branch", "unified"])
@pytest.mark.parametrize("advantage_shape", ["(B,)", "(B,1)"])
def test_token_weight_zero_is_trl_sequence_level_gspo(clipping, advantage_shape):
    logps, old, advantages, mask, entropies = make_batch(seed=4, log_ratio_scale=0.3)
    if advantage_shape == "(B,1)":
        advantages = advantages.unsqueeze(1)
    ours, info = dhpo_per_token_loss(
        logps, old, advantages, mask, mixing="averaged", token_weight=0.0, clipping=clipping, **EPS
    )
    # branch clipping clips s with the sequence epsilons; the unified clip uses the token epsilons
    low, high = (0.1, 0.15) if clipping == "branch" else (0.2, 0.28)
    trl = trl_per_token_loss(logps, old, advantages, mask, low, high, level="sequence")  # (B, 1)
    torch.testing.assert_close(ours * mask, trl * mask, atol=1e-6, rtol=0)
    ours_loss, trl_loss = grpo_aggregate(ours, mask), grpo_aggregate(trl, mask)
    assert abs(ours_loss.item() - trl_loss.item()) <= 1e-6
    torch.testing.assert_close(grad_of(ours_loss, logps), grad_of(trl_loss, logps), atol=1e-6, rtol=0)
    # the sequence clip binds for some sequences, and not for others
    clipped = (info["sequence_ratio"] < 1 - low) | (info["sequence_ratio"] > 1 + high)
    assert 0 < clipped.sum() < B


# --------------------------------------------------------------------------- eq. 16
@pytest.mark.parametrize("mixing", ["averaged", "entropy"])
@pytest.mark.parametrize("clipping", ["branch", "unified"])
def test_gradient_is_mixed_ratio_times_advantage_eq16(mixing, clipping):
    logps, old, advantages, mask, entropies = make_batch(seed=3, dtype=torch.float64)
    loss, info = dhpo_per_token_loss(
        logps, old, advantages, mask, entropies, mixing=mixing, token_weight=0.35, clipping=clipping, **EPS
    )
    # each per-token term depends on logpi of its own token only (s_i is stop-gradient, eq. 5)
    grad = grad_of((loss * mask).sum(), logps)
    checked = 0
    for i, length in enumerate(LENGTHS):
        log_ratios = [(logps[i, t] - old[i, t]).item() for t in range(length)]
        s = math.exp(sum(log_ratios) / length)
        for t in range(length):
            if info["uses_clipped_term"][i, t]:
                continue
            w = info["mixing_weight"][i, t].item()
            m = w * math.exp(log_ratios[t]) + (1 - w) * s
            assert grad[i, t].item() == pytest.approx(-m * advantages[i].item(), rel=1e-10, abs=1e-12)
            checked += 1
    assert checked >= sum(LENGTHS) // 2
    assert torch.all(grad[~mask.bool()] == 0)


# --------------------------------------------------------------------------- entropy-guided weight (eq. 10)
def test_entropy_weight_batch_scope_ignores_padding():
    _, _, _, mask, entropies = make_batch(seed=4)
    entropies = entropies.clone()
    entropies[~mask.bool()] = 50.0  # padding must not set the max
    weight = entropy_mixing_weight(entropies, mask)
    expected = torch.tensor(reference_entropy_weights(entropies, mask), dtype=weight.dtype)
    torch.testing.assert_close(weight, expected, atol=1e-6, rtol=0)
    valid = weight[mask.bool()]
    assert valid.min().item() == 0.0 and valid.max().item() == pytest.approx(1.0)


def test_entropy_weight_sequence_scope_normalises_each_row():
    _, _, _, mask, entropies = make_batch(seed=5)
    weight = entropy_mixing_weight(entropies, mask, scope="sequence")
    expected = torch.tensor(reference_entropy_weights(entropies, mask, scope="sequence"), dtype=weight.dtype)
    torch.testing.assert_close(weight, expected, atol=1e-6, rtol=0)
    for i, length in enumerate(LENGTHS):
        if length > 1:  # every row with a spread spans [0, 1] on its own
            assert weight[i, :length].min().item() == 0.0
            assert weight[i, :length].max().item() == pytest.approx(1.0)
    assert weight[2, 0].item() == 0.5  # a one-token row has no spread


def test_entropy_weight_explicit_range_and_clamp():
    _, _, _, mask, entropies = make_batch(seed=6)
    weight = entropy_mixing_weight(entropies, mask, entropy_range=(0.5, 1.5))
    expected = torch.tensor(reference_entropy_weights(entropies, mask, entropy_range=(0.5, 1.5)), dtype=weight.dtype)
    torch.testing.assert_close(weight, expected, atol=1e-6, rtol=0)
    valid = mask.bool()
    assert (weight[valid & (entropies < 0.5)] == 0).all() and (weight[valid & (entropies > 1.5)] == 1).all()


def test_entropy_weight_of_an_all_padding_row_is_one_half_in_sequence_scope():
    _, _, _, mask, entropies = make_batch(seed=5)
    mask = mask.clone()
    mask[1] = 0  # a row with no valid token next to rows with a spread
    weight = entropy_mixing_weight(entropies, mask, scope="sequence")
    assert torch.equal(weight[1], torch.full((T,), 0.5))
    expected = torch.tensor(reference_entropy_weights(entropies, mask, scope="sequence"), dtype=weight.dtype)
    torch.testing.assert_close(weight, expected, atol=1e-6, rtol=0)


def test_entropy_weight_keeps_float32_whatever_the_range_dtype():
    # The trainer's global scope passes the range as reduced tensors, possibly float64: the weight (and so the
    # mixed ratio) must stay in the entropies' float32, not be promoted.
    _, _, _, mask, entropies = make_batch(seed=6)
    range64 = (torch.tensor(0.5, dtype=torch.float64), torch.tensor(1.5, dtype=torch.float64))
    weight = entropy_mixing_weight(entropies, mask, entropy_range=range64)
    assert weight.dtype == torch.float32
    expected = torch.tensor(reference_entropy_weights(entropies, mask, entropy_range=(0.5, 1.5)), dtype=torch.float32)
    torch.testing.assert_close(weight, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("scope", ["batch", "sequence"])
def test_constant_entropies_give_one_half(scope):
    _, _, _, mask, _ = make_batch()
    entropies = torch.full((B, T), 0.7)
    assert torch.equal(entropy_mixing_weight(entropies, mask, scope=scope), torch.full((B, T), 0.5))
    # a spread at or below 1e-8 counts as constant
    entropies[0, 0] += 5e-9
    assert torch.equal(entropy_mixing_weight(entropies.double(), mask, scope=scope), torch.full((B, T), 0.5).double())


def test_entropy_weight_is_stop_gradient():
    logps, old, advantages, mask, entropies = make_batch(seed=7)
    entropies.requires_grad_()
    loss, info = dhpo_per_token_loss(logps, old, advantages, mask, entropies, **EPS)
    assert not info["mixing_weight"].requires_grad
    grads = torch.autograd.grad((loss * mask).sum(), [logps, entropies], allow_unused=True)
    assert grads[1] is None
    assert torch.isfinite(grads[0]).all()


# --------------------------------------------------------------------------- robustness
@pytest.mark.parametrize("mixing", ["averaged", "entropy"])
@pytest.mark.parametrize("clipping", ["branch", "unified"])
def test_finite_with_extreme_ratios_and_garbage_padding(mixing, clipping):
    logps, old, advantages, mask, entropies = make_batch(seed=8)
    logps = logps.detach().clone()
    logps[0, 0], old[0, 1] = -1e4, -1e4  # log-ratios of -1e4 and about +1e4
    logps[3, 2] = 80.0
    padding = ~mask.bool()
    for tensor, garbage in ((logps, float("nan")), (old, float("inf")), (entropies, float("nan"))):
        tensor[padding] = garbage
    logps.requires_grad_()
    loss, info = dhpo_per_token_loss(logps, old, advantages, mask, entropies, mixing=mixing, clipping=clipping)
    assert torch.isfinite(loss).all()
    for key in ("mixing_weight", "token_ratio", "sequence_ratio", "mixed_ratio", "clipped_mixed_ratio"):
        assert torch.isfinite(info[key]).all(), key
    grad = grad_of(grpo_aggregate(loss, mask), logps)
    assert torch.isfinite(grad).all()
    assert torch.all(grad[padding] == 0)


def test_all_masked_batch_gives_zero_loss():
    logps, old, advantages, _, entropies = make_batch()
    mask = torch.zeros(B, T)
    loss, info = dhpo_per_token_loss(logps, old, advantages, mask, entropies)
    total = grpo_aggregate(loss, mask)
    assert total.item() == 0.0
    assert torch.isfinite(loss).all() and torch.all(info["mixing_weight"] == 0.5)
    assert torch.all(grad_of(total, logps) == 0)


# --------------------------------------------------------------------------- validation
def _call(**overrides):
    logps, old, advantages, mask, entropies = make_batch()
    kwargs = dict(
        per_token_logps=logps, old_per_token_logps=old, advantages=advantages, mask=mask, entropies=entropies
    )
    kwargs.update(overrides)
    return dhpo_per_token_loss(**kwargs)


@pytest.mark.parametrize(
    ("overrides", "argument"),
    [
        (dict(entropies=None, mixing="entropy"), "entropies"),
        (dict(mixing="averaged", token_weight=1.5), "token_weight"),
        (dict(mixing="averaged", token_weight=-0.1), "token_weight"),
        (dict(epsilon_low_token=-0.1), "epsilon_low_token"),
        (dict(epsilon_high_token=-0.1), "epsilon_high_token"),
        (dict(epsilon_low_seq=-0.1), "epsilon_low_seq"),
        (dict(epsilon_high_seq=-1), "epsilon_high_seq"),
        (dict(mixing="geometric"), "mixing"),
        (dict(clipping="both"), "clipping"),
        (dict(old_per_token_logps=torch.zeros(B, T + 1)), "old_per_token_logps"),
        (dict(mask=torch.ones(B - 1, T)), "mask"),
        (dict(entropies=torch.zeros(B, 2)), "entropies"),
        (dict(advantages=torch.zeros(B + 1)), "advantages"),
        (dict(advantages=torch.zeros(B, 2)), "advantages"),
        (dict(per_token_logps=torch.zeros(B * T)), "per_token_logps"),
        (dict(entropy_scope="token"), "entropy_norm_scope"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(overrides, argument):
    with pytest.raises(ValueError, match=argument):
        _call(**overrides)


# --------------------------------------------------------------------------- GMPO
def reference_gmpo_sequence_objective(logps, old, advantage, valid, eps_low, eps_high):
    """GMPO (Zhao et al., 2025): A * {prod_t min(rho_t^sgn A, clip(rho_t, e^-eps, e^eps)^sgn A)}^(sgn A / |o|)."""
    sign = float(torch.sign(advantage))
    product = 1.0
    for t in valid:
        rho = torch.exp(logps[t] - old[t])
        rho_clipped = torch.clamp(rho, math.exp(-eps_low), math.exp(eps_high))
        product = product * torch.minimum(rho**sign, rho_clipped**sign)
    return advantage * product ** (sign / len(valid))


@pytest.mark.parametrize("advantage_shape", ["(B,)", "(B,1)"])
@pytest.mark.parametrize(("eps_low", "eps_high"), [(0.4, 0.4), (0.1, 0.3)])
def test_gmpo_matches_geometric_mean_formula(advantage_shape, eps_low, eps_high):
    logps, old, advantages, mask, _ = make_batch(seed=9, dtype=torch.float64, log_ratio_scale=0.5)
    advantages = advantages.clone()
    advantages[4] = 0.0  # a zero advantage contributes nothing
    adv_in = advantages.unsqueeze(1) if advantage_shape == "(B,1)" else advantages
    loss, info = gmpo_per_token_loss(logps, old, adv_in, mask, epsilon_low=eps_low, epsilon_high=eps_high)
    assert 0 < info["token_clipped"].sum() < mask.sum()

    per_sequence = []
    for i in range(B):
        valid = valid_positions(mask, i)
        objective = reference_gmpo_sequence_objective(logps[i], old[i], advantages[i], valid, eps_low, eps_high)
        per_sequence.append(-objective)
        for t in valid:  # the sequence loss is broadcast over its tokens
            assert loss[i, t].item() == pytest.approx(-objective.item(), abs=1e-12)
    expected = sum(per_sequence) / B
    actual = grpo_aggregate(loss, mask)
    assert actual.item() == pytest.approx(expected.item(), abs=1e-12)
    torch.testing.assert_close(grad_of(actual, logps), grad_of(expected, logps), atol=1e-12, rtol=0)


def test_gmpo_finite_with_garbage_padding_and_validates():
    logps, old, advantages, mask, _ = make_batch(seed=10)
    logps = logps.detach().clone()
    logps[~mask.bool()] = float("nan")
    old[~mask.bool()] = float("-inf")
    logps[1, 0] = -1e4
    logps.requires_grad_()
    loss, _ = gmpo_per_token_loss(logps, old, advantages, mask)
    assert torch.isfinite(loss).all()
    assert torch.isfinite(grad_of(grpo_aggregate(loss, mask), logps)).all()
    with pytest.raises(ValueError, match="gmpo_epsilon_low"):
        gmpo_per_token_loss(logps, old, advantages, mask, epsilon_low=-0.1)
    with pytest.raises(ValueError, match="gmpo_epsilon_high"):
        gmpo_per_token_loss(logps, old, advantages, mask, epsilon_high=-0.1)
    with pytest.raises(ValueError, match="advantages"):
        gmpo_per_token_loss(logps, old, torch.zeros(B, T), mask)
    with pytest.raises(ValueError, match="mask"):
        gmpo_per_token_loss(logps, old, advantages, torch.ones(B, T + 1))


# --------------------------------------------------------------------------- the baselines, against VERL and TRL
def binding_batch(seed=11, log_ratio_scale=0.6):
    """`make_batch` in float64 where every clip binds: ratios far outside [0.8, 1.28] both ways, and two A < 0
    tokens with r = e^1.5 = 4.48 and e^1.3 = 3.67 beyond the dual clip at 3."""
    logps, old, advantages, mask, entropies = make_batch(seed, dtype=torch.float64, log_ratio_scale=log_ratio_scale)
    logps = logps.detach().clone()
    logps[1, 0] = old[1, 0] + 1.5  # advantages[1] = -0.7
    logps[3, 0] = old[3, 0] + 1.3  # advantages[3] = -1.1
    return logps.requires_grad_(), old, advantages, mask, entropies


def token_mean_aggregate(per_token_loss, mask):
    """TRL's loss_type="bnpo" (VERL's "token-mean")."""
    return (per_token_loss * mask).sum() / mask.sum()


def assert_same_loss_and_grad(ours, reference, logps, atol=1e-12):
    assert ours.item() == pytest.approx(reference.item(), abs=atol)
    torch.testing.assert_close(grad_of(ours, logps), grad_of(reference, logps), atol=atol, rtol=0)


@pytest.mark.parametrize(("eps_low", "eps_high"), [(0.2, 0.2), (0.2, 0.28)])
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_grpo_with_delta_3_is_verl_vanilla_with_its_dual_clip(eps_low, eps_high, aggregation):
    logps, old, advantages, mask, _ = binding_batch()
    ratio = torch.exp(logps - old).detach()
    negative = advantages.reshape(-1, 1) < 0
    assert ((ratio > 3) & negative & mask.bool()).sum() == 2  # the dual clip binds
    assert ((ratio < 1 - eps_low) & negative & mask.bool()).any() and ((ratio > 1 + eps_high) & ~negative).any()
    loss, info = grpo_per_token_loss(logps, old, advantages, mask, epsilon_low=eps_low, epsilon_high=eps_high,
                                     delta=3.0)  # fmt: skip
    reference_terms = verl_vanilla_terms(logps, old, advantages, mask, eps_low, eps_high, clip_ratio_c=3.0)
    if aggregation == "seq-mean-token-mean":
        assert_same_loss_and_grad(grpo_aggregate(loss, mask), seq_mean_token_mean(reference_terms, mask), logps)
    else:
        assert_same_loss_and_grad(token_mean_aggregate(loss, mask), token_mean(reference_terms, mask), logps)
    # TRL's clip_ratio indicators
    valid = mask.bool()
    assert torch.equal(info["clipped_low"] & valid, (ratio < 1 - eps_low) & negative & valid)
    assert torch.equal(info["clipped_high"] & valid, (ratio > 1 + eps_high) & (advantages.reshape(-1, 1) > 0) & valid)


@pytest.mark.parametrize("delta", [None, 2.0, 3.0])
def test_grpo_and_gspo_are_trls_surrogate(delta):
    logps, old, advantages, mask, _ = binding_batch(seed=12)
    cases = (("token", grpo_per_token_loss, 0.2, 0.28), ("sequence", gspo_per_token_loss, 0.03, 0.04))
    for level, fn, low, high in cases:
        loss, _ = fn(logps, old, advantages, mask, epsilon_low=low, epsilon_high=high, delta=delta)
        trl = trl_per_token_loss(logps, old, advantages, mask, low, high, level=level, delta=delta)
        assert_same_loss_and_grad(grpo_aggregate(loss, mask), grpo_aggregate(trl, mask), logps)


def test_issue_example_one_token_past_the_dual_clip():
    """log r = 1.5, A = -1: VERL's vanilla loss is 3.0 with gradient 0; without the dual clip it is e^1.5 with
    gradient e^1.5 (d r / d log pi = r)."""
    old = torch.tensor([[-2.0]], dtype=torch.float64)
    mask, advantages = torch.ones(1, 1, dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)
    for delta, value, gradient in ((3.0, 3.0, 0.0), (None, math.exp(1.5), math.exp(1.5))):
        logps = (old + 1.5).requires_grad_()
        loss, _ = grpo_per_token_loss(logps, old, advantages, mask, epsilon_low=0.2, epsilon_high=0.2, delta=delta)
        assert loss.item() == pytest.approx(value, rel=1e-12)
        assert grad_of(loss.sum(), logps).item() == pytest.approx(gradient, rel=1e-12, abs=1e-15)
    logps = (old + 1.5).requires_grad_()
    verl = verl_vanilla_terms(logps, old, advantages, mask, 0.2, 0.2, clip_ratio_c=3.0)[0, 0]
    assert verl.item() == pytest.approx(3.0) and grad_of(verl, logps).item() == 0.0


@pytest.mark.parametrize(("eps_low", "eps_high"), [(3e-4, 4e-4), (0.03, 0.04)])
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_gspo_is_verl_gspo(eps_low, eps_high, aggregation):
    """TRL's sequence-level form has the value and the gradient of VERL's per-token form under either aggregation."""
    logps, old, advantages, mask, _ = binding_batch(seed=13, log_ratio_scale=0.05)
    loss, info = gspo_per_token_loss(logps, old, advantages, mask, epsilon_low=eps_low, epsilon_high=eps_high)
    s = info["sequence_ratio"]
    assert ((s < 1 - eps_low) | (s > 1 + eps_high)).any() and info["clipped_low"].shape == (B, 1)
    reference_terms = verl_gspo_terms(logps, old, advantages, mask, eps_low, eps_high)
    if aggregation == "seq-mean-token-mean":
        assert_same_loss_and_grad(grpo_aggregate(loss, mask), seq_mean_token_mean(reference_terms, mask), logps)
    else:
        assert_same_loss_and_grad(token_mean_aggregate(loss, mask), token_mean(reference_terms, mask), logps)


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_cispo_is_verl_cispo_with_the_papers_clip(aggregation):
    """The paper's CISPO: VERL's clip [1 - 10, 1 + 0.2], i.e. the weight capped at 1.2 and no lower bound."""
    logps, old, advantages, mask, _ = binding_batch(seed=14)
    ratio = torch.exp(logps - old).detach()
    capped = (ratio > 1.2) & mask.bool()
    assert (capped & (advantages.reshape(-1, 1) > 0)).any() and (capped & (advantages.reshape(-1, 1) < 0)).any()
    loss, info = cispo_per_token_loss(logps, old, advantages, mask, cap=1.2)
    assert torch.equal(info["weight_capped"], capped)
    reference_terms = verl_cispo_terms(logps, old, advantages, mask, clip_low=10.0, clip_high=0.2)
    if aggregation == "seq-mean-token-mean":
        assert_same_loss_and_grad(grpo_aggregate(loss, mask), seq_mean_token_mean(reference_terms, mask), logps)
    else:
        assert_same_loss_and_grad(token_mean_aggregate(loss, mask), token_mean(reference_terms, mask), logps)
    loss, _ = cispo_per_token_loss(logps, old, advantages, mask, cap=1.2)
    trl = trl_cispo_per_token_loss(logps, old, advantages, epsilon_high=1.2)
    assert_same_loss_and_grad(token_mean_aggregate(loss, mask), token_mean_aggregate(trl, mask), logps)


def test_cispo_issue_example_aggregation_matters():
    """Lengths 1 and 3, r = 1, A = (+1, -1), log pi = -1: 0 per response (eq. 7, VERL's seq-mean-token-mean), -0.5
    as a token mean (TRL's loss_type="cispo")."""
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]], dtype=torch.float64)
    logps = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    old, advantages = logps.detach().clone(), torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, _ = cispo_per_token_loss(logps, old, advantages, mask, cap=1.2)
    assert grpo_aggregate(loss, mask).item() == pytest.approx(0.0, abs=1e-15)
    assert token_mean_aggregate(loss, mask).item() == pytest.approx(-0.5)
    reference_terms = verl_cispo_terms(logps, old, advantages, mask, clip_low=10.0, clip_high=0.2)
    assert seq_mean_token_mean(reference_terms, mask).item() == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("clipping", ["branch", "unified"])
def test_dhpo_at_w_one_with_delta_3_is_verl_vanilla(clipping):
    """Token weight 1 and delta 3: VERL's vanilla loss at 0.2 / 0.28 with clip_ratio_c = 3."""
    logps, old, advantages, mask, _ = binding_batch()
    loss, info = dhpo_per_token_loss(logps, old, advantages, mask, mixing="averaged", token_weight=1.0,
                                     clipping=clipping, delta=3.0)  # fmt: skip
    reference = seq_mean_token_mean(verl_vanilla_terms(logps, old, advantages, mask, 0.2, 0.28, 3.0), mask)
    assert_same_loss_and_grad(grpo_aggregate(loss, mask), reference, logps)
    assert info["dual_clipped"].sum() == 2 and info["dual_clipped"][1, 0] and info["dual_clipped"][3, 0]
    # TRL's clip_ratio meaning, exactly TRL's GRPO indicators at w = 1
    _, grpo_info = grpo_per_token_loss(logps, old, advantages, mask, epsilon_low=0.2, epsilon_high=0.28, delta=3.0)
    for key in ("clipped_low", "clipped_high"):
        assert torch.equal(info[key] & mask.bool(), grpo_info[key] & mask.bool()), key


@pytest.mark.parametrize("mixing", ["averaged", "entropy"])
@pytest.mark.parametrize("clipping", ["branch", "unified"])
def test_dhpo_dual_clip_matches_the_equations(mixing, clipping):
    logps, old, advantages, mask, entropies = binding_batch(seed=15)
    loss, info = dhpo_per_token_loss(logps, old, advantages, mask, entropies, mixing=mixing, clipping=clipping,
                                     delta=2.0, **EPS)  # fmt: skip
    weights = constant_weights(mask, 0.5) if mixing == "averaged" else reference_entropy_weights(entropies, mask)
    terms = reference_dhpo(logps, old, advantages, mask, weights, clipping, EPS, dual_clip=2.0)
    atol = 1e-12 if mixing == "averaged" else 1e-7  # the entropy weights are computed in float32
    assert_same_loss_and_grad(grpo_aggregate(loss, mask), seq_mean_token_mean(terms, mask), logps, atol=atol)
    assert info["dual_clipped"].any()
    plain, _ = dhpo_per_token_loss(logps, old, advantages, mask, entropies, mixing=mixing, clipping=clipping, **EPS)
    assert torch.equal(loss[~info["dual_clipped"]], plain[~info["dual_clipped"]])  # elsewhere the paper's loss


@pytest.mark.parametrize("clipping", ["branch", "unified"])
def test_dhpo_clip_indicators_mean_the_min_picks_the_clipped_term(clipping):
    """TRL's clip_ratio meaning for DHPO: the clipped term sets the loss (it exceeds the unclipped one), by sign of A."""
    logps, old, advantages, mask, entropies = binding_batch(seed=17)
    with torch.no_grad():  # sequence 3 (A < 0): s = e^-0.2 below 1 - 0.1 while token 1's r = e^-0.1 is in range
        logps[3, 1], logps[3, 2:6] = old[3, 1] - 0.1, old[3, 2:6] - 0.6
    _, info = dhpo_per_token_loss(logps, old, advantages, mask, entropies, clipping=clipping, **EPS)
    if clipping == "branch":  # the sequence branch alone makes the clip bind, on both sides
        for side in ("low", "high"):
            assert (info[f"clipped_{side}"] & ~info[f"token_clipped_{side}"] & mask.bool()).any(), side
    weights = reference_entropy_weights(entropies, mask)
    clipped = reference_dhpo(logps, old, advantages, mask, weights, clipping, EPS)
    free = reference_dhpo(logps, old, advantages, mask, weights, clipping, {name: 1e9 for name in EPS})
    expected_low, expected_high = torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.bool)
    for (i, t), term in clipped.items():
        binds = term.item() > free[i, t].item() + 1e-9
        expected_low[i, t], expected_high[i, t] = binds and advantages[i] < 0, binds and advantages[i] > 0
    assert expected_low.any() and expected_high.any()
    assert torch.equal(info["clipped_low"] & mask.bool(), expected_low)
    assert torch.equal(info["clipped_high"] & mask.bool(), expected_high)


@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo"])
def test_baselines_finite_with_garbage_padding(name):
    logps, old, advantages, mask, _ = make_batch(seed=16)
    logps = logps.detach().clone()
    padding = ~mask.bool()
    logps[padding], old[padding] = float("nan"), float("inf")
    logps[0, 0] = -1e4
    logps.requires_grad_()
    fn = {"grpo": grpo_per_token_loss, "gspo": gspo_per_token_loss, "cispo": cispo_per_token_loss}[name]
    loss, info = fn(logps, old, advantages, mask)
    assert torch.isfinite(loss).all() and torch.isfinite(info["token_ratio"]).all()
    grad = grad_of(grpo_aggregate(loss, mask), logps)
    assert torch.isfinite(grad).all() and torch.all(grad[padding] == 0)


@pytest.mark.parametrize(
    ("fn", "kwargs", "argument"),
    [
        (grpo_per_token_loss, dict(delta=1.0), "delta"),
        (gspo_per_token_loss, dict(delta=0.9), "delta"),
        (dhpo_per_token_loss, dict(delta=True, mixing="averaged"), "delta"),
        (grpo_per_token_loss, dict(epsilon_low=-0.1), "epsilon_low"),
        (gspo_per_token_loss, dict(epsilon_high=-0.1), "epsilon_high"),
        (cispo_per_token_loss, dict(cap=0.0), "cap"),
        (cispo_per_token_loss, dict(cap="1.2"), "cap"),
        (gspo_per_token_loss, dict(advantages=torch.zeros(B, T)), "advantages"),
        (cispo_per_token_loss, dict(mask=torch.ones(B, T + 1)), "mask"),
        (dhpo_per_token_loss, dict(mixing="averaged", token_weight=True), "token_weight"),
    ],
)
def test_baselines_bad_input_names_the_argument(fn, kwargs, argument):
    logps, old, advantages, mask, _ = make_batch()
    call = dict(per_token_logps=logps, old_per_token_logps=old, advantages=advantages, mask=mask)
    call.update(kwargs)
    with pytest.raises(ValueError, match=argument):
        fn(**call)


# --------------------------------------------------------------------------- TRL 1.16's SAPO, VESPO, LUSPO, CISPO
def loop_ratio(logps, old, mask, i, t, level):
    """r_{i,t}, or s_i = exp(mean over the sequence's valid tokens of log r) at the sequence level, by hand."""
    if level == "token":
        return math.exp(logps[i, t].item() - old[i, t].item())
    valid = valid_positions(mask, i)
    return math.exp(sum(logps[i, u].item() - old[i, u].item() for u in valid) / len(valid))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sapo_is_trls_soft_gate_per_token_with_its_gradient(level):
    """SAPO as TRL's `loss_type="sapo"` reads: -(4 / tau) sigmoid(tau (r - 1)) A, tau = 2 for A > 0 and 5 else;
    its gradient wrt log pi is -4 sigmoid'(tau (r - 1)) r A (summed over the sequence at the sequence level / |o|)."""
    logps, old, advantages, mask, _ = make_batch(dtype=torch.float64)
    loss, info = sapo_per_token_loss(logps, old, advantages, mask, temperature_pos=2.0, temperature_neg=5.0,
                                     level=level)  # fmt: skip
    grad = grad_of((loss * mask).sum(), logps)
    for i in range(B):
        a = advantages[i].item()
        tau = 2.0 if a > 0 else 5.0
        valid = valid_positions(mask, i)
        for t in valid:
            r = loop_ratio(logps, old, mask, i, t, level)
            sig = 1 / (1 + math.exp(-tau * (r - 1)))
            assert loss[i, t].item() == pytest.approx(-(4 / tau) * sig * a, abs=1e-12)
            slope = -4 * sig * (1 - sig) * r * a  # d loss_t / d log r (token) or d loss / d log s (sequence)
            # sequence level: the |o| tokens' losses each move with log s = mean log r, so d/d log pi_t = |o| x slope / |o|
            assert grad[i, t].item() == pytest.approx(slope, abs=1e-10)
    assert info["soft_gate"].shape == ((B, T) if level == "token" else (B, 1))


def test_sapo_at_ratio_one_gives_grpos_gradient_and_refuses_zero_temperature():
    logps, _, advantages, mask, _ = make_batch(dtype=torch.float64)
    loss, _ = sapo_per_token_loss(logps, logps.detach(), advantages, mask)
    expected = -advantages.unsqueeze(1) * mask  # on-policy: A grad log pi, as GRPO's
    torch.testing.assert_close(grad_of((loss * mask).sum(), logps), expected.to(logps.dtype))
    with pytest.raises(ValueError, match="`temperature_neg` must be a positive number"):
        sapo_per_token_loss(logps, logps.detach(), advantages, mask, temperature_neg=0.0)


def test_vespo_weights_each_sequence_by_trls_gamma_of_its_summed_log_ratio():
    logps, old, advantages, mask, _ = make_batch(dtype=torch.float64, log_ratio_scale=0.2)
    pairs = dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
    loss, info = vespo_per_token_loss(logps, old, advantages, mask, **pairs)
    grad = grad_of((loss * mask).sum(), logps)
    for i in range(B):
        a = advantages[i].item()
        k, lam = (2.0, 3.0) if a >= 0 else (3.0, 2.0)
        valid = valid_positions(mask, i)
        log_w = sum(logps[i, t].item() - old[i, t].item() for t in valid)  # a sum: w is the sequence's product
        phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
        assert info["phi"][i, 0].item() == pytest.approx(phi, rel=1e-12)
        for t in valid:
            assert loss[i, t].item() == pytest.approx(-phi * a * logps[i, t].item(), rel=1e-12)
            assert grad[i, t].item() == pytest.approx(-phi * a, rel=1e-12)  # phi detached: phi A grad log pi
    on_policy, _ = vespo_per_token_loss(logps, logps.detach(), advantages, mask, **pairs)
    torch.testing.assert_close(grad_of((on_policy * mask).sum(), logps), (-advantages.unsqueeze(1) * mask))


def test_cispo_at_the_sequence_level_caps_the_sequence_ratio_for_every_token():
    logps, old, advantages, mask, _ = make_batch(dtype=torch.float64)
    cap = 1.05
    loss, info = cispo_per_token_loss(logps, old, advantages, mask, cap=cap, level="sequence")
    for i in range(B):
        s = loop_ratio(logps, old, mask, i, 0, "sequence")
        assert info["weight_capped"][i, 0].item() == (s > cap)
        for t in valid_positions(mask, i):
            assert loss[i, t].item() == pytest.approx(-min(s, cap) * advantages[i].item() * logps[i, t].item(), rel=1e-12)
    assert info["clipped_high"].shape == (B, 1) and 0 < info["weight_capped"].sum() < B


def test_luspo_aggregation_is_the_per_response_token_sum_averaged_over_responses():
    """TRL's `loss_type="luspo"`: `(per_token_loss * mask).sum(-1).mean()`, divided for accumulation."""
    per_token = torch.randn(B, T, dtype=torch.float64)
    _, _, _, mask, _ = make_batch(dtype=torch.float64)
    by_hand = sum(sum(per_token[i, t].item() for t in valid_positions(mask, i)) for i in range(B)) / B
    window = aggregation.fixed_slice_window(B, 2, None)  # two accumulated micro-batches of B rows
    assert aggregation.aggregate("luspo", per_token, mask, window, T).item() == pytest.approx(by_hand / 2, rel=1e-12)
