"""Policy losses of DHPO and the GMPO baseline as pure tensor functions.

Every function here is side-effect free: it takes per-token log-probabilities, advantages and masks and
returns per-token losses (plus detached diagnostics), so it can be checked against the paper's equations
directly. The trainer masks and aggregates the per-token losses exactly as TRL does.

Notation (paper, sections 2-3): token ratio r = pi_theta / pi_old (eq. 2); sequence ratio
s_i = exp(mean_t log r_{i,t}) (eq. 4), applied per token as s_{i,t} = sg[s_i] * pi_theta / sg[pi_theta]
(eq. 5); mixed ratio m = w r + (1 - w) s (eq. 8); clipped mixed ratio m~ (eq. 11 or the unified clip);
per-token objective min(m A, m~ A) (eq. 7).
"""

from __future__ import annotations

import torch

MIXINGS = ("averaged", "entropy")
CLIPPINGS = ("branch", "unified")
ENTROPY_SCOPES = ("batch", "sequence")

# exp(20) ~ 4.9e8: far outside any trust region, yet keeps exp() finite in fp32/bf16 (as VERL does).
LOG_RATIO_CLAMP = 20.0
# An entropy range at or below this is treated as constant: every token gets w = 0.5.
ENTROPY_RANGE_EPS = 1e-8


def _check_epsilons(**epsilons: float) -> None:
    for name, value in epsilons.items():
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"`{name}` must be a non-negative number, got {value!r}.")


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


def masked_log_ratio(
    per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """log r_{i,t}, zero on padding (so padding never produces inf/NaN), clamped to +-20 for finite exp()."""
    log_ratio = torch.where(mask.bool(), per_token_logps - old_per_token_logps, torch.zeros_like(per_token_logps))
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


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
    the valid tokens of each row. `entropy_range=(min, max)` overrides both (the trainer's "global" scope
    passes the min and max reduced across processes). A range of at most 1e-8 gives w = 0.5 everywhere.
    """
    if scope not in ENTROPY_SCOPES:
        raise ValueError(f"`entropy_norm_scope` must be one of {ENTROPY_SCOPES}, got {scope!r}.")
    entropies = entropies.detach().float()
    valid = mask.bool()
    if entropy_range is not None:
        low = torch.as_tensor(entropy_range[0], dtype=entropies.dtype, device=entropies.device)
        high = torch.as_tensor(entropy_range[1], dtype=entropies.dtype, device=entropies.device)
    elif scope == "batch":
        if not valid.any():
            return torch.full_like(entropies, 0.5)
        low, high = entropies[valid].min(), entropies[valid].max()
    else:  # per sequence; rows without valid tokens get an empty range and fall back to 0.5
        low = torch.where(valid, entropies, torch.full_like(entropies, float("inf"))).amin(-1, keepdim=True)
        high = torch.where(valid, entropies, torch.full_like(entropies, float("-inf"))).amax(-1, keepdim=True)
        empty = ~valid.any(-1, keepdim=True)
        low = torch.where(empty, torch.zeros_like(low), low)
        high = torch.where(empty, torch.zeros_like(high), high)
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
    token_weight: float = 0.5,
    clipping: str = "branch",
    epsilon_low_token: float = 0.2,
    epsilon_high_token: float = 0.28,
    epsilon_low_seq: float = 0.2,
    epsilon_high_seq: float = 0.28,
    entropy_scope: str = "batch",
    entropy_range: tuple[torch.Tensor | float, torch.Tensor | float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token DHPO loss -min(m A, m~ A) (eqs. 7, 8, 11).

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
        entropy_scope: "batch" or "sequence", where min and max of the entropy normalisation are taken.
        entropy_range: explicit (min, max) for the normalisation, overriding `entropy_scope`.

    Returns:
        `per_token_loss` (B, T), finite everywhere (not masked: the caller masks and aggregates), and `info`,
        a dict of detached tensors: `mixing_weight` (B, T), `token_ratio` (B, T), `sequence_ratio` (B,),
        `mixed_ratio` (B, T), `clipped_mixed_ratio` (B, T), and the boolean (B, T) masks
        `token_clipped_low/high`, `sequence_clipped_low/high` (the branch ratio is outside its trust region on
        the side where the clip binds for the sign of A) and `uses_clipped_term` (the min picks m~ A < m A).
    """
    if mixing not in MIXINGS:
        raise ValueError(f"`mixing` must be one of {MIXINGS}, got {mixing!r}.")
    if clipping not in CLIPPINGS:
        raise ValueError(f"`clipping` must be one of {CLIPPINGS}, got {clipping!r}.")
    if not isinstance(token_weight, (int, float)) or not 0.0 <= token_weight <= 1.0:
        raise ValueError(f"`token_weight` must be in [0, 1], got {token_weight!r}.")
    _check_epsilons(
        epsilon_low_token=epsilon_low_token,
        epsilon_high_token=epsilon_high_token,
        epsilon_low_seq=epsilon_low_seq,
        epsilon_high_seq=epsilon_high_seq,
    )
    if mixing == "entropy" and entropies is None:
        raise ValueError(
            "`entropies` is required for mixing='entropy' (pass the token entropies of the current policy, "
            "or use mixing='averaged')."
        )
    _check_shapes(
        "per_token_logps", per_token_logps, old_per_token_logps=old_per_token_logps, mask=mask, entropies=entropies
    )
    batch_size, seq_len = per_token_logps.shape
    advantages = _as_column(advantages, batch_size, seq_len).to(per_token_logps.dtype)

    log_ratio = masked_log_ratio(per_token_logps, old_per_token_logps, mask)
    token_ratio = torch.exp(log_ratio)  # eq. 2
    sequence_ratio = torch.exp(sequence_log_ratio(log_ratio, mask)).detach()  # eq. 4, sg[s_i]
    # eq. 5: value s_i, gradient s_i * grad log pi_theta(o_t). Padding gets s_i with log pi zeroed, so garbage
    # (inf/NaN) there cannot reach the loss (exp(x - sg[x]) is NaN for infinite x).
    logps_valid = torch.where(mask.bool(), per_token_logps, torch.zeros_like(per_token_logps))
    sequence_token_ratio = sequence_ratio.unsqueeze(1) * torch.exp(logps_valid - logps_valid.detach())

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

    with torch.no_grad():
        negative, positive = advantages < 0, advantages > 0
        seq_col = sequence_ratio.unsqueeze(1)
        if clipping == "branch":
            token_clipped_low, token_clipped_high = (token_ratio < token_low) & negative, (token_ratio > token_high) & positive
            seq_clipped_low = ((seq_col < seq_low) & negative).expand_as(token_ratio)
            seq_clipped_high = ((seq_col > seq_high) & positive).expand_as(token_ratio)
        else:  # one clip on m: report it under the token branch, whose epsilons it uses
            token_clipped_low, token_clipped_high = (mixed_ratio < token_low) & negative, (mixed_ratio > token_high) & positive
            seq_clipped_low = seq_clipped_high = torch.zeros_like(token_ratio, dtype=torch.bool)
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
            "uses_clipped_term": clipped_objective < unclipped_objective,
        }
    return per_token_loss, info


def gmpo_per_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.4,
    epsilon_high: float = 0.4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Geometric-Mean Policy Optimization (Zhao et al., 2025): -A * exp(mean_t clipped log r_{i,t}).

    Each token's log-ratio is clipped to [-epsilon_low, epsilon_high] PPO-style (the clip only binds in the
    direction that would increase the objective for the sign of A), then the sequence objective is the
    geometric mean of the clipped token ratios times A. The per-sequence loss is returned broadcast over the
    sequence's tokens, so TRL's "grpo" aggregation (per-sequence token mean) yields exactly the GMPO loss.

    Returns `per_token_loss` (B, T) and `info` with `token_ratio` (B, T), `sequence_ratio` (B,) (the clipped
    geometric mean) and `token_clipped` (B, T) boolean.
    """
    _check_epsilons(gmpo_epsilon_low=epsilon_low, gmpo_epsilon_high=epsilon_high)
    _check_shapes("per_token_logps", per_token_logps, old_per_token_logps=old_per_token_logps, mask=mask)
    batch_size, seq_len = per_token_logps.shape
    advantages = _as_column(advantages, batch_size, seq_len).to(per_token_logps.dtype)
    if advantages.size(1) != 1:
        raise ValueError("`advantages` must be one value per sequence for GMPO, got a (B, T) tensor.")

    log_ratio = masked_log_ratio(per_token_logps, old_per_token_logps, mask)
    sign = torch.sign(advantages)
    clipped_log_ratio = log_ratio.clamp(-epsilon_low, epsilon_high)
    # sgn(A) * min(sgn(A) x, sgn(A) clip(x)): the pessimistic choice of the clipped and unclipped log-ratio
    pessimistic_log_ratio = sign * torch.min(sign * log_ratio, sign * clipped_log_ratio)
    geometric_ratio = torch.exp(sequence_log_ratio(pessimistic_log_ratio, mask)).unsqueeze(1)
    per_sequence_loss = -advantages * geometric_ratio  # (B, 1)
    per_token_loss = per_sequence_loss.expand(batch_size, seq_len)
    with torch.no_grad():
        info = {
            "token_ratio": torch.exp(log_ratio),
            "sequence_ratio": geometric_ratio.squeeze(1).detach(),
            "token_clipped": (pessimistic_log_ratio != log_ratio) & mask.bool(),
        }
    return per_token_loss, info
