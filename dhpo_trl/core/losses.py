"""Policy losses of DHPO, of the paper's four baselines and of TRL's SAPO, LUSPO and VESPO as pure tensor functions.

Every function here is side-effect free: it takes per-token log-probabilities, advantages and masks and
returns per-token losses (plus detached diagnostics), so it can be checked against the paper's equations
directly. The trainer masks and aggregates the per-token losses exactly as TRL does, the same way for every row.

Notation (paper, sections 2-3): token ratio r = pi_theta / pi_old (eq. 2); sequence ratio
s_i = exp(mean_t log r_{i,t}) (eq. 4), applied per token as s_{i,t} = sg[s_i] * pi_theta / sg[pi_theta]
(eq. 5); mixed ratio m = w r + (1 - w) s (eq. 8); clipped mixed ratio m~ (eq. 11 or the unified clip);
per-token objective min(m A, m~ A) (eq. 7).

Every function masks the log-ratio (and, where the loss uses it, log pi) on padding, so garbage there (inf/NaN
log-probs of padded positions) cannot reach the loss: NaN * 0 is NaN, so masking after the fact would not help.
"""

from __future__ import annotations

import math

import torch

from .paper import (
    AVERAGED_TOKEN_WEIGHT,
    EPSILON_HIGH,
    EPSILON_LOW,
    GMPO_EPSILON,
    GRPO_EPSILON,
    GSPO_EPSILON_HIGH,
    GSPO_EPSILON_LOW,
)  # fmt: skip

MIXINGS = ("averaged", "entropy")
CLIPPINGS = ("branch", "unified")
# Where the min and max of the entropy normalisation are taken (`DHPOConfig.entropy_norm_scope`): the valid tokens of
# the micro-batch, of each response, or of the micro-batch on every process (the caller passes that range).
ENTROPY_NORM_SCOPES = ("batch", "sequence", "global")
# TRL's `importance_sampling_level`: one ratio per token, or the sequence's geometric mean for all its tokens.
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# VESPO clamps the sequence log-weight below at log(1e-8), as TRL's `get_gamma_weights` does.
VESPO_LOG_WEIGHT_MIN = math.log(1e-8)
# TRL clamps VESPO's lambda below at 1e-4.
VESPO_LAMBDA_MIN = 1e-4

# exp(20) ~ 4.9e8: far outside any trust region, yet keeps exp() finite in fp32/bf16 (as VERL does).
LOG_RATIO_CLAMP = 20.0
# An entropy range at or below this is treated as constant: every token gets w = 0.5.
ENTROPY_RANGE_EPS = 1e-8


def is_number(value, finite: bool = False) -> bool:
    """A real number (int or float, not bool, not NaN); with `finite`, not infinite either (every `DHPOConfig`
    number, VESPO's shape parameters)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return math.isfinite(value) if finite else not math.isnan(value)


def _check_epsilons(**epsilons: float) -> None:
    for name, value in epsilons.items():
        if not is_number(value) or value < 0:
            raise ValueError(f"`{name}` must be a non-negative number, got {value!r}.")


def _check_delta(delta: float | None) -> None:
    # As VERL's clip_ratio_c: a dual clip at or below 1 would cap the loss of A < 0 tokens inside the trust region.
    if delta is not None and (not is_number(delta) or delta <= 1.0):
        raise ValueError(f"`delta` must be None or a number > 1 (the dual clip for A < 0), got {delta!r}.")


def _check_shapes(reference_name: str, reference: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if reference.dim() != 2:
        raise ValueError(f"`{reference_name}` must have shape (batch, seq), got {tuple(reference.shape)}.")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(
                f"`{name}` must have the same shape as `{reference_name}` {tuple(reference.shape)}, "
                f"got {tuple(tensor.shape)}."
            )


def _as_column(advantages: torch.Tensor, batch_size: int, seq_len: int) -> torch.Tensor:
    """(B,), (B, 1) or (B, T) advantages -> a tensor that broadcasts against (B, T)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if advantages.dim() != 2 or advantages.size(0) != batch_size or advantages.size(1) not in (1, seq_len):
        raise ValueError(
            f"`advantages` must have shape ({batch_size},), ({batch_size}, 1) or ({batch_size}, {seq_len}), "
            f"got {tuple(advantages.shape)}."
        )
    return advantages


def _checked_advantages(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, **tensors: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """A loss's inputs checked against the (B, T) `per_token_logps`; `advantages` as a column in its dtype."""
    _check_shapes("per_token_logps", per_token_logps, old_per_token_logps=old_per_token_logps, mask=mask, **tensors)
    batch_size, seq_len = per_token_logps.shape
    return _as_column(advantages, batch_size, seq_len).to(per_token_logps.dtype)


def masked_log_ratio(
    per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """log r_{i,t}, zero on padding (so padding never produces inf/NaN), clamped to +-20 for finite exp()."""
    log_ratio = torch.where(mask.bool(), per_token_logps - old_per_token_logps, torch.zeros_like(per_token_logps))
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def unit_ratio(per_token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """pi_theta / sg[pi_theta] per token: value 1, gradient grad log pi; 1 with no gradient on padding."""
    logps_valid = torch.where(mask.bool(), per_token_logps, torch.zeros_like(per_token_logps))
    return torch.exp(logps_valid - logps_valid.detach())


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i = mean over valid tokens of log r_{i,t} (eq. 4); 0 for a sequence without valid tokens. Shape (B,)."""
    mask = mask.to(log_ratio.dtype)
    return (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def entropy_mixing_weight(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    scope: str = "batch",
    entropy_range: tuple[torch.Tensor | float, torch.Tensor | float] | None = None,
) -> torch.Tensor:
    """Entropy-guided mixing weight w = (H - min H) / (max H - min H) (eq. 10), detached.

    `scope="batch"` takes min and max over all valid tokens of the tensors passed in, `scope="sequence"` over
    the valid tokens of each row, `scope="global"` uses `entropy_range=(min, max)` (the trainer passes the min and
    max reduced across processes), which overrides the other two when given. A range of at most 1e-8 gives w = 0.5 everywhere.
    """
    if scope not in ENTROPY_NORM_SCOPES:
        raise ValueError(f"`entropy_norm_scope` must be one of {ENTROPY_NORM_SCOPES}, got {scope!r}.")
    if scope == "global" and entropy_range is None:
        raise ValueError(
            "`entropy_norm_scope='global'` needs `entropy_range`, the (min, max) entropy over every process."
        )
    entropies = entropies.detach().float()
    valid = mask.bool()
    if entropy_range is not None:
        low = torch.as_tensor(entropy_range[0], dtype=entropies.dtype, device=entropies.device)
        high = torch.as_tensor(entropy_range[1], dtype=entropies.dtype, device=entropies.device)
    elif scope == "batch":
        if not valid.any():
            return torch.full_like(entropies, 0.5)
        low, high = entropies[valid].min(), entropies[valid].max()
    else:  # per sequence; a row without valid tokens gets (inf, -inf), a negative spread, so w = 0.5
        low = torch.where(valid, entropies, torch.full_like(entropies, float("inf"))).amin(-1, keepdim=True)
        high = torch.where(valid, entropies, torch.full_like(entropies, float("-inf"))).amax(-1, keepdim=True)
    spread = high - low
    degenerate = spread <= ENTROPY_RANGE_EPS
    weight = ((entropies - low) / torch.where(degenerate, torch.ones_like(spread), spread)).clamp(0.0, 1.0)
    weight = torch.where(degenerate, torch.full_like(weight, 0.5), weight)
    # Padding carries no entropy signal; 0.5 keeps it finite and neutral (the caller masks it anyway).
    return torch.where(valid, weight, torch.full_like(weight, 0.5))


def dhpo_per_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    entropies: torch.Tensor | None = None,
    *,
    mixing: str = "entropy",
    token_weight: float = AVERAGED_TOKEN_WEIGHT,
    clipping: str = "branch",
    epsilon_low_token: float = EPSILON_LOW,
    epsilon_high_token: float = EPSILON_HIGH,
    epsilon_low_seq: float = EPSILON_LOW,
    epsilon_high_seq: float = EPSILON_HIGH,
    entropy_scope: str = "batch",
    entropy_range: tuple[torch.Tensor | float, torch.Tensor | float] | None = None,
    delta: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token DHPO loss -min(m A, m~ A) (eqs. 7, 8, 11), optionally dual-clipped for A < 0.

    Args:
        per_token_logps: log pi_theta of the sampled tokens, (B, T), with gradient.
        old_per_token_logps: log pi_old of the same tokens, (B, T).
        advantages: group-relative advantages, (B,) or (B, 1) (a (B, T) tensor is accepted too).
        mask: 1 for completion tokens that count, 0 for padding, (B, T).
        entropies: token entropies of pi_theta, (B, T); required for `mixing="entropy"`, always detached.
        mixing: "averaged" (w = `token_weight` everywhere) or "entropy" (w = min-max normalised entropy).
        token_weight: w for averaged mixing, in [0, 1]; 1 is GRPO's token ratio, 0 is GSPO's sequence ratio.
        clipping: "branch" clips r and s in their own trust regions before mixing (eq. 11); "unified" clips
            the mixed ratio m with the token epsilons (the paper's ablation).
        epsilon_low_token, epsilon_high_token: token trust region [1 - low, 1 + high].
        epsilon_low_seq, epsilon_high_seq: sequence trust region [1 - low, 1 + high].
        entropy_scope: one of `ENTROPY_NORM_SCOPES` ("batch", "sequence", "global" with `entropy_range`), where
            min and max of the entropy normalisation are taken (`DHPOConfig.entropy_norm_scope`).
        entropy_range: explicit (min, max) for the normalisation, overriding `entropy_scope`.
        delta: optional dual clip (Ye et al., 2020; VERL's `clip_ratio_c`): for A < 0 the loss is capped at
            -delta A, so a token whose mixed ratio exploded stops pushing. None (the paper's equations) disables
            it. With `token_weight=1` and `delta=3` this is VERL's `vanilla` PPO loss.

    Returns:
        `per_token_loss` (B, T), finite everywhere (not masked: the caller masks and aggregates), and `info`,
        a dict of detached tensors: `mixing_weight` (B, T), `token_ratio` (B, T), `sequence_ratio` (B,),
        `mixed_ratio` (B, T), `clipped_mixed_ratio` (B, T), and the boolean (B, T) masks
        `token_clipped_low/high`, `sequence_clipped_low/high` (the branch ratio is outside its trust region on
        the side where the clip binds for the sign of A), `uses_clipped_term` (the min picks m~ A < m A),
        `clipped_low/high` (`uses_clipped_term` for A < 0 / A > 0: TRL's `clip_ratio` meaning, exactly TRL's at
        w = 1) and, with `delta`, `dual_clipped` (the dual clip sets the loss).
    """
    if mixing not in MIXINGS:
        raise ValueError(f"`mixing` must be one of {MIXINGS}, got {mixing!r}.")
    if clipping not in CLIPPINGS:
        raise ValueError(f"`clipping` must be one of {CLIPPINGS}, got {clipping!r}.")
    if not is_number(token_weight) or not 0.0 <= token_weight <= 1.0:
        raise ValueError(f"`token_weight` must be in [0, 1], got {token_weight!r}.")
    _check_epsilons(
        epsilon_low_token=epsilon_low_token,
        epsilon_high_token=epsilon_high_token,
        epsilon_low_seq=epsilon_low_seq,
        epsilon_high_seq=epsilon_high_seq,
    )
    _check_delta(delta)
    if mixing == "entropy" and entropies is None:
        raise ValueError(
            "`entropies` is required for mixing='entropy' (pass the token entropies of the current policy, "
            "or use mixing='averaged')."
        )
    advantages = _checked_advantages(per_token_logps, old_per_token_logps, advantages, mask, entropies=entropies)

    log_ratio = masked_log_ratio(per_token_logps, old_per_token_logps, mask)
    token_ratio = torch.exp(log_ratio)  # eq. 2
    sequence_ratio = torch.exp(sequence_log_ratio(log_ratio, mask)).detach()  # eq. 4, sg[s_i]
    # eq. 5: value s_i, gradient s_i * grad log pi_theta(o_t) (exp(x - sg[x]) would be NaN for garbage x on padding)
    sequence_token_ratio = sequence_ratio.unsqueeze(1) * unit_ratio(per_token_logps, mask)

    if mixing == "averaged":
        weight = torch.full_like(token_ratio, float(token_weight))
    else:
        weight = entropy_mixing_weight(entropies, mask, scope=entropy_scope, entropy_range=entropy_range)
    weight = weight.to(token_ratio.dtype).detach()  # eq. 10: w is a fixed coefficient for the gradient

    mixed_ratio = weight * token_ratio + (1.0 - weight) * sequence_token_ratio  # eq. 8
    token_low, token_high = 1.0 - epsilon_low_token, 1.0 + epsilon_high_token
    seq_low, seq_high = 1.0 - epsilon_low_seq, 1.0 + epsilon_high_seq
    if clipping == "branch":  # eq. 11
        clipped_mixed_ratio = weight * token_ratio.clamp(token_low, token_high) + (
            1.0 - weight
        ) * sequence_token_ratio.clamp(seq_low, seq_high)
    else:
        clipped_mixed_ratio = mixed_ratio.clamp(token_low, token_high)

    unclipped_objective = mixed_ratio * advantages
    clipped_objective = clipped_mixed_ratio * advantages
    per_token_loss = -torch.min(unclipped_objective, clipped_objective)  # eq. 7, per token
    negative, positive = advantages < 0, advantages > 0
    if delta is not None:  # dual clip: min(-delta A, loss) for A < 0, as VERL's vanilla loss
        dual_loss = -advantages * delta
        dual_clipped = negative & (per_token_loss > dual_loss)
        per_token_loss = torch.where(negative, torch.min(per_token_loss, dual_loss), per_token_loss)

    with torch.no_grad():
        seq_col = sequence_ratio.unsqueeze(1)
        if clipping == "branch":
            token_clipped_low, token_clipped_high = (token_ratio < token_low) & negative, (token_ratio > token_high) & positive
            seq_clipped_low = ((seq_col < seq_low) & negative).expand_as(token_ratio)
            seq_clipped_high = ((seq_col > seq_high) & positive).expand_as(token_ratio)
        else:  # one clip on m: report it under the token branch, whose epsilons it uses
            token_clipped_low, token_clipped_high = (mixed_ratio < token_low) & negative, (mixed_ratio > token_high) & positive
            seq_clipped_low = seq_clipped_high = torch.zeros_like(token_ratio, dtype=torch.bool)
        uses_clipped_term = clipped_objective < unclipped_objective
        info = {
            "mixing_weight": weight,
            "token_ratio": token_ratio.detach(),
            "sequence_ratio": sequence_ratio,
            "mixed_ratio": mixed_ratio.detach(),
            "clipped_mixed_ratio": clipped_mixed_ratio.detach(),
            "token_clipped_low": token_clipped_low,
            "token_clipped_high": token_clipped_high,
            "sequence_clipped_low": seq_clipped_low,
            "sequence_clipped_high": seq_clipped_high,
            "uses_clipped_term": uses_clipped_term,
            "clipped_low": uses_clipped_term & negative,
            "clipped_high": uses_clipped_term & positive,
        }
        if delta is not None:
            info["dual_clipped"] = dual_clipped
    return per_token_loss, info


def gmpo_per_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = GMPO_EPSILON,
    epsilon_high: float = GMPO_EPSILON,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Geometric-Mean Policy Optimization (Zhao et al., 2025): -A * exp(mean_t clipped log r_{i,t}).

    Each token's log-ratio is clipped to [-epsilon_low, epsilon_high] PPO-style (the clip only binds in the
    direction that would increase the objective for the sign of A), then the sequence objective is the
    geometric mean of the clipped token ratios times A. The per-sequence loss is returned broadcast over the
    sequence's tokens, so TRL's "grpo" aggregation (per-sequence token mean) yields exactly the GMPO loss.

    The loss is a mean over sequences only under the per-response mean (`loss_type="grpo"`), which is what VERL's
    `geo_mean` computes whatever its aggregation mode; the trainer refuses the token-weighted aggregations for GMPO.

    Returns `per_token_loss` (B, T) and `info` with `token_ratio` (B, T), `sequence_ratio` (B,) (the clipped
    geometric mean), `token_clipped` (B, T) boolean and its split by the sign of A, `clipped_low/high`.
    """
    _check_epsilons(gmpo_epsilon_low=epsilon_low, gmpo_epsilon_high=epsilon_high)
    advantages = _checked_advantages(per_token_logps, old_per_token_logps, advantages, mask)
    if advantages.size(1) != 1:
        raise ValueError("`advantages` must be one value per sequence for GMPO, got a (B, T) tensor.")

    log_ratio = masked_log_ratio(per_token_logps, old_per_token_logps, mask)
    sign = torch.sign(advantages)
    clipped_log_ratio = log_ratio.clamp(-epsilon_low, epsilon_high)
    # sgn(A) * min(sgn(A) x, sgn(A) clip(x)): the pessimistic choice of the clipped and unclipped log-ratio
    pessimistic_log_ratio = sign * torch.min(sign * log_ratio, sign * clipped_log_ratio)
    geometric_ratio = torch.exp(sequence_log_ratio(pessimistic_log_ratio, mask)).unsqueeze(1)
    per_sequence_loss = -advantages * geometric_ratio  # (B, 1)
    per_token_loss = per_sequence_loss.expand(per_token_logps.shape)
    with torch.no_grad():
        info = {
            "token_ratio": torch.exp(log_ratio),
            "sequence_ratio": geometric_ratio.squeeze(1).detach(),
            # A = 0 gives sign 0 and a zero log-ratio, which is no clip: the sequence has no gradient to clip.
            "token_clipped": (pessimistic_log_ratio != log_ratio) & mask.bool() & (advantages != 0),
        }
        info["clipped_low"] = info["token_clipped"] & (advantages < 0)
        info["clipped_high"] = info["token_clipped"] & (advantages > 0)
    return per_token_loss, info


def _clipped_surrogate(ratio, advantages, epsilon_low, epsilon_high, delta):
    """TRL's clipped surrogate -min(r' A, clip(r) A) with r' = min(r, delta) (TRL's two-sided clip), and its
    clip indicators in TRL's meaning (computed on r', as TRL does)."""
    clipped_ratio = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    if delta is not None:  # with delta > 1 + epsilon_high this is exactly VERL's dual clip for A < 0
        ratio = ratio.clamp(max=delta)
    per_token_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    with torch.no_grad():
        clipped_low = (ratio < 1.0 - epsilon_low) & (advantages < 0)
        clipped_high = (ratio > 1.0 + epsilon_high) & (advantages > 0)
    return per_token_loss, clipped_low, clipped_high


def grpo_per_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = GRPO_EPSILON,
    epsilon_high: float = GRPO_EPSILON,
    delta: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's token-level clipped surrogate -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) (eq. 3), as TRL computes
    it, including TRL's `delta` (r capped at delta in the unclipped term). With delta = 3 this is VERL's `vanilla`
    loss with its default dual clip `clip_ratio_c = 3`.

    Returns `per_token_loss` (B, T) and `info` with `token_ratio` (B, T) and TRL's `clip_ratio` indicators
    `clipped_low` / `clipped_high` (B, T).
    """
    _check_epsilons(epsilon_low=epsilon_low, epsilon_high=epsilon_high)
    _check_delta(delta)
    advantages = _checked_advantages(per_token_logps, old_per_token_logps, advantages, mask)
    token_ratio = torch.exp(masked_log_ratio(per_token_logps, old_per_token_logps, mask))
    per_token_loss, clipped_low, clipped_high = _clipped_surrogate(
        token_ratio, advantages, epsilon_low, epsilon_high, delta
    )
    info = {"token_ratio": token_ratio.detach(), "clipped_low": clipped_low, "clipped_high": clipped_high}
    return per_token_loss, info


def gspo_per_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = GSPO_EPSILON_LOW,
    epsilon_high: float = GSPO_EPSILON_HIGH,
    delta: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's sequence-level clipped surrogate -min(s A, clip(s, 1 - eps_low, 1 + eps_high) A) (eq. 6), as TRL
    computes it (`importance_sampling_level="sequence"`): s_i = exp(mean_t log r_{i,t}) with its full gradient,
    one value per sequence broadcast over its tokens. Its gradient equals that of the per-token form of eq. 5 under
    every aggregation (each of the |o_i| tokens carries s_i A / |o_i| sum_t grad log pi).

    Returns `per_token_loss` (B, T) and `info` with `token_ratio` (B, T), `sequence_ratio` (B,) and TRL's
    `clip_ratio` indicators `clipped_low` / `clipped_high`, one per sequence (B, 1), as TRL logs them.
    """
    _check_epsilons(epsilon_low=epsilon_low, epsilon_high=epsilon_high)
    _check_delta(delta)
    advantages = _checked_advantages(per_token_logps, old_per_token_logps, advantages, mask)
    if advantages.size(1) != 1:
        raise ValueError("`advantages` must be one value per sequence for GSPO, got a (B, T) tensor.")
    log_ratio = masked_log_ratio(per_token_logps, old_per_token_logps, mask)
    sequence_ratio = torch.exp(sequence_log_ratio(log_ratio, mask)).unsqueeze(1)  # (B, 1), with gradient
    per_sequence_loss, clipped_low, clipped_high = _clipped_surrogate(
        sequence_ratio, advantages, epsilon_low, epsilon_high, delta
    )
    info = {
        "token_ratio": torch.exp(log_ratio).detach(),
        "sequence_ratio": sequence_ratio.squeeze(1).detach(),
        "clipped_low": clipped_low,
        "clipped_high": clipped_high,
    }
    return per_sequence_loss.expand(per_token_logps.shape), info


def importance_weight(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, mask: torch.Tensor,
                      level: str = "token") -> torch.Tensor:  # fmt: skip
    """TRL's `coef_1` with its full gradient: r_{i,t} (B, T) at `level="token"`, s_i = exp(mean_t log r_{i,t}) (B, 1)
    at `level="sequence"`."""
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"`importance_sampling_level` must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {level!r}.")
    log_ratio = masked_log_ratio(per_token_logps, old_per_token_logps, mask)
    if level == "token":
        return torch.exp(log_ratio)
    return torch.exp(sequence_log_ratio(log_ratio, mask)).unsqueeze(1)


def cispo_per_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 1.2,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (Chen et al., 2025): -sg[min(r, cap)] A log pi_theta. The importance weight is clipped and detached, so
    every token keeps its gradient sg[min(r, cap)] A grad log pi. No lower bound: the paper's eps_low = 10 puts
    VERL's lower clip 1 - 10 below 0. The caller aggregates it by `loss_type` like every other row. `level="sequence"`
    weighs every token of a sequence by its capped sequence ratio instead, as TRL does with
    `importance_sampling_level="sequence"`.

    Returns `per_token_loss` (B, T) (zero on padding, whatever log pi holds there) and `info` with `token_ratio`
    (B, T), `weight_capped` (r > cap) and `clipped_high` (r > cap and A > 0: TRL's `cispo_clip_ratio`), (B, T) at the
    token level and one per sequence (B, 1) at the sequence level, as TRL logs them.
    """
    if not is_number(cap) or cap <= 0:
        raise ValueError(f"`cap` must be a positive number (the largest importance weight), got {cap!r}.")
    advantages = _checked_advantages(per_token_logps, old_per_token_logps, advantages, mask)
    if level == "sequence" and advantages.size(1) != 1:
        raise ValueError("`advantages` must be one value per sequence at the sequence level, got a (B, T) tensor.")
    weight = importance_weight(per_token_logps, old_per_token_logps, mask, level).detach()
    logps_valid = torch.where(mask.bool(), per_token_logps, torch.zeros_like(per_token_logps))
    per_token_loss = -weight.clamp(max=cap) * advantages * logps_valid
    with torch.no_grad():
        capped = weight > cap
        if level == "token":
            capped = capped & mask.bool()
        info = {
            "token_ratio": torch.exp(masked_log_ratio(per_token_logps, old_per_token_logps, mask)).detach(),
            "weight_capped": capped,
            "clipped_high": capped & (advantages > 0),
        }
    return per_token_loss, info


def sapo_per_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature_pos: float = 1.0,
    temperature_neg: float = 1.05,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al., 2025, "Soft Adaptive Policy Optimization"), as TRL's `loss_type="sapo"`: the hard clip is
    replaced by a soft gate, -(4 / tau) sigmoid(tau (r - 1)) A, with tau = `temperature_pos` where A > 0 and
    `temperature_neg` elsewhere. Its gradient is sigmoid'(tau (r - 1)) 4 r A grad log pi: 1 x A grad log pi at r = 1,
    fading smoothly as r leaves 1, faster for the larger temperature (negative advantages by default). `level`:
    r per token (TRL's default) or the sequence ratio s_i for all of a sequence's tokens.

    Returns `per_token_loss` (B, T) and `info` with `token_ratio` (B, T) and `soft_gate` (the gate's value
    (4 / tau) sigmoid(tau (r - 1)), (B, T) or (B, 1), 1 at r = 1).
    """
    for name, value in (("temperature_pos", temperature_pos), ("temperature_neg", temperature_neg)):
        if not is_number(value) or value <= 0:
            raise ValueError(f"`{name}` must be a positive number (SAPO divides by it), got {value!r}.")
    advantages = _checked_advantages(per_token_logps, old_per_token_logps, advantages, mask)
    ratio = importance_weight(per_token_logps, old_per_token_logps, mask, level)
    temperature = torch.where(advantages > 0, temperature_pos, temperature_neg).to(ratio.dtype)
    gate = torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature
    per_token_loss = (-gate * advantages).expand(per_token_logps.shape)
    info = {
        "token_ratio": torch.exp(masked_log_ratio(per_token_logps, old_per_token_logps, mask)).detach(),
        "soft_gate": gate.detach(),
    }
    return per_token_loss, info


def vespo_weight(log_ratio: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *, k_pos: float,
                 lambda_pos: float, k_neg: float, lambda_neg: float) -> torch.Tensor:  # fmt: skip
    """VESPO's gamma weight phi(w) = exp(lambda + k log w - lambda w) of the sequence weight w = prod_t r_{i,t}
    (a sum of log-ratios, not a mean), detached, (B, 1); phi(1) = 1. (k, lambda) are the positive pair where A >= 0,
    the negative pair elsewhere; lambda is floored at 1e-4 and log w clamped to [log 1e-8, 20], as TRL does."""
    with torch.no_grad():
        log_w = (log_ratio * mask.to(log_ratio.dtype)).sum(-1, keepdim=True)
        log_w = log_w.clamp(VESPO_LOG_WEIGHT_MIN, LOG_RATIO_CLAMP)
        nonnegative = advantages >= 0
        k = torch.where(nonnegative, k_pos, k_neg).to(log_w.dtype)
        lam = torch.where(nonnegative, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=VESPO_LAMBDA_MIN)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_per_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO (TRL's `loss_type="vespo"`): -sg[phi(w_i)] A log pi_theta, every token of sequence i weighted by the
    gamma weight of its sequence importance weight w_i (`vespo_weight`): a smooth, asymmetric down-weighting of
    sequences far from the sampling policy instead of a hard clip.

    Returns `per_token_loss` (B, T) (zero on padding) and `info` with `token_ratio` (B, T) and `phi` (B, 1), TRL's
    `vespo/phi_seq_mean`.
    """
    for name, value in (("k_pos", k_pos), ("lambda_pos", lambda_pos), ("k_neg", k_neg), ("lambda_neg", lambda_neg)):
        if not is_number(value, finite=True):
            raise ValueError(f"`{name}` must be a finite number, got {value!r}.")
    advantages = _checked_advantages(per_token_logps, old_per_token_logps, advantages, mask)
    if advantages.size(1) != 1:
        raise ValueError("`advantages` must be one value per sequence for VESPO, got a (B, T) tensor.")
    log_ratio = masked_log_ratio(per_token_logps, old_per_token_logps, mask)
    phi = vespo_weight(log_ratio, mask, advantages, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg,
                       lambda_neg=lambda_neg)  # fmt: skip
    logps_valid = torch.where(mask.bool(), per_token_logps, torch.zeros_like(per_token_logps))
    per_token_loss = -phi * advantages * logps_valid
    return per_token_loss, {"token_ratio": torch.exp(log_ratio).detach(), "phi": phi}
