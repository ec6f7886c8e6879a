"""The logged metrics as pure functions: local sums and extremes per process, one cross-process reduction, then means.

Every metric a micro-batch logs is a ratio of sums over all processes (a token or sequence mean) or an extreme over
all processes. `*_sums` functions return this process's `(sums, maxima)` (dicts of 0-dim tensors; a minimum is
stored negated, so one MAX reduces both), `reduce_across` reduces them in one SUM and one MAX collective, and
`*_metrics` turn the totals into the logged values. Nothing here talks to a process group: the collective is the
`all_reduce(tensor, op)` callable the trainer passes (`op` is "sum" or "max"), so every function runs in one process.

No valid token on any process gives NaN (which TRL's `log` skips), never 0 means or +-inf extremes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

AllReduce = Callable[[torch.Tensor, str], torch.Tensor]


def local_all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """The reduction of one process: itself."""
    return tensor


def reduce_across(sums: dict, maxima: dict, all_reduce: AllReduce) -> tuple[dict, dict]:
    """Sum `sums` and take the maximum of `maxima` over processes: one collective each (none when empty).

    Every process must call this with the same keys in the same order (the caller builds them from the same
    settings). Returns floats.
    """
    out = []
    for values, op in ((sums, "sum"), (maxima, "max")):
        if not values:
            out.append({})
            continue
        tensors = [torch.as_tensor(v).detach().float().reshape(()) for v in values.values()]
        device = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
        local = torch.stack([t.to(device) for t in tensors])
        out.append(dict(zip(values, all_reduce(local, op).tolist(), strict=True)))
    return out[0], out[1]


def _finite(value: float) -> float:
    return value if math.isfinite(value) else math.nan


def _ratio(total: float, count: float) -> float:
    return total / count if count > 0 else math.nan


def _masked_max(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Largest value where `valid`, -inf where nothing is (so it never wins a MAX over processes)."""
    if values.numel() == 0:
        return values.new_tensor(-math.inf)
    return torch.where(valid, values, torch.full_like(values, -math.inf)).max()


# ------------------------------------------------------------------ TRL's and the objective's loss metrics
def loss_sums(info: dict, entropies: torch.Tensor, mask: torch.Tensor, per_token_kl: torch.Tensor | None,
              prefix: str | None, fractions: tuple = ()) -> tuple[dict, dict]:  # fmt: skip
    """Local sums for `entropy`, `kl`, `off_policy/abs_log_ratio` and the objective's `<prefix>/` metrics.

    Token means are over `mask`'s tokens; sequence means over the rows with at least one. `fractions`: the
    objective's (metric suffix, info key) token fractions present in `info`.
    """
    valid = mask.bool()
    tokens = valid.float()
    rows = valid.any(-1)
    sums = {
        "tokens": tokens.sum(), "sequences": rows.float().sum(),
        "entropy": (entropies.detach().float() * tokens).sum(),
        "abs_log_ratio": (info["abs_log_ratio"].float() * tokens).sum(),
    }  # fmt: skip
    if per_token_kl is not None:
        sums["kl"] = (per_token_kl.detach().float() * tokens).sum()
    if "log_ratio" in info:
        sums.update(sequence_spread_sums(info["log_ratio"], valid))
    maxima = {}
    if prefix is None:
        return sums, maxima
    token_ratio, sequence_ratio = info["token_ratio"].detach().float(), info["sequence_ratio"].detach().float()
    sums["token_ratio"] = (token_ratio * tokens).sum()
    sums["sequence_ratio"] = (sequence_ratio * rows).sum()
    if "mixing_weight" in info:
        weight = info["mixing_weight"].detach().float()
        sums["mixing_weight"] = (weight * tokens).sum()
        sums["mixing_weight_sq"] = (weight.square() * tokens).sum()
    for _, key in fractions:
        if key in info:
            sums[key] = (info[key].float() * tokens).sum()
    maxima["-token_ratio_min"] = _masked_max(-token_ratio, valid)
    maxima["token_ratio_max"] = _masked_max(token_ratio, valid)
    maxima["-sequence_ratio_min"] = _masked_max(-sequence_ratio, rows)
    maxima["sequence_ratio_max"] = _masked_max(sequence_ratio, rows)
    return sums, maxima


def sequence_spread_sums(log_ratio: torch.Tensor, valid: torch.Tensor) -> dict:
    """Sums over the sequences with a valid token of std_t log r_{i,t} (the population std within the sequence: how
    far its token ratios spread around its sequence ratio) and of |log s_i| (log s_i = mean_t log r_{i,t}, the
    sequence ratio). Divided by the sequence count they are `off_policy/log_ratio_spread` and
    `off_policy/abs_sequence_log_ratio`: on short completions the spread is small and every token ratio is close to
    the sequence ratio, so the objectives that mix or choose between them can hardly differ."""
    tokens = valid.float()
    counts = tokens.sum(-1)
    log_ratio = log_ratio.detach().float() * tokens
    mean = log_ratio.sum(-1) / counts.clamp(min=1.0)
    variance = ((log_ratio - mean.unsqueeze(-1)).square() * tokens).sum(-1) / counts.clamp(min=1.0)
    rows = (counts > 0).float()
    return {"log_ratio_spread": (variance.sqrt() * rows).sum(), "abs_sequence_log_ratio": (mean.abs() * rows).sum()}


def loss_metrics(sums: dict, maxima: dict, prefix: str | None, fractions: tuple = ()) -> dict[str, float]:
    """The logged values from the reduced `loss_sums`."""
    tokens, sequences = sums["tokens"], sums["sequences"]
    out = {"entropy": _ratio(sums["entropy"], tokens), "off_policy/abs_log_ratio": _ratio(sums["abs_log_ratio"], tokens)}
    if "kl" in sums:
        out["kl"] = _ratio(sums["kl"], tokens)
    for name in ("log_ratio_spread", "abs_sequence_log_ratio"):
        if name in sums:
            out[f"off_policy/{name}"] = _ratio(sums[name], sequences)
    if prefix is None:
        return out
    out[f"{prefix}/token_ratio/mean"] = _ratio(sums["token_ratio"], tokens)
    out[f"{prefix}/token_ratio/min"] = _finite(-maxima["-token_ratio_min"])
    out[f"{prefix}/token_ratio/max"] = _finite(maxima["token_ratio_max"])
    out[f"{prefix}/sequence_ratio/mean"] = _ratio(sums["sequence_ratio"], sequences)
    out[f"{prefix}/sequence_ratio/min"] = _finite(-maxima["-sequence_ratio_min"])
    out[f"{prefix}/sequence_ratio/max"] = _finite(maxima["sequence_ratio_max"])
    if "mixing_weight" in sums:
        mean = _ratio(sums["mixing_weight"], tokens)
        out[f"{prefix}/mixing_weight/mean"] = mean
        variance = _ratio(sums["mixing_weight_sq"], tokens) - mean**2
        out[f"{prefix}/mixing_weight/std"] = max(variance, 0.0) ** 0.5 if math.isfinite(variance) else math.nan
    for name, key in fractions:
        if key in sums:
            out[f"{prefix}/{name}"] = _ratio(sums[key], tokens)
    return out


# ------------------------------------------------------------------ TRL's clip metrics
def _share_sums(indicator: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of an indicator: over valid tokens, or over rows for one value per sequence ((B, 1), GSPO)."""
    indicator = indicator.float()
    if indicator.shape[1] == 1:
        return indicator.sum(), torch.tensor(float(indicator.shape[0]))
    return (indicator * mask).sum(), mask.sum()


def _row_shares(indicator: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row share of the indicator, and which rows have one (TRL's masked_seq_mean is NaN on empty rows)."""
    indicator = indicator.float()
    if indicator.shape[1] == 1:
        return indicator.squeeze(1), torch.ones(indicator.shape[0], dtype=torch.bool, device=indicator.device)
    counts = mask.sum(-1)
    return (indicator * mask).sum(-1) / counts.clamp(min=1.0), counts > 0


def clip_sums(kind: str | None, info: dict, mask: torch.Tensor) -> tuple[dict, dict]:
    """Local sums for TRL's clip metrics from the objective's clip indicators.

    `kind` "clip_ratio" (clip surrogates): the share of tokens (of sequences for (B, 1) indicators) clipped below
    for A < 0 (`clipped_low`), above for A > 0 (`clipped_high`) or either, and the lowest / highest per-sequence
    share. "cispo_clip_ratio": the share of A > 0 tokens whose weight is capped (`clipped_high`).
    "vespo/phi_seq_mean": the mean over sequences of VESPO's weight (`phi`, (B, 1)). None (SAPO): no metric.
    """
    mask = mask.float()
    if kind is None:
        return {}, {}
    if kind == "vespo/phi_seq_mean":
        total, count = _share_sums(info["phi"], mask)
        return {"vespo_phi": total, "vespo_count": count}, {}
    if kind == "cispo_clip_ratio":
        total, count = _share_sums(info["clipped_high"], mask)
        return {"cispo_clipped": total, "cispo_count": count}, {}
    low, high = info["clipped_low"], info["clipped_high"]
    sums = {}
    for name, indicator in (("low", low), ("high", high), ("region", low | high)):
        sums[f"clip_{name}"], sums[f"clip_{name}_count"] = _share_sums(indicator, mask)
    low_share, low_rows = _row_shares(low, mask)
    high_share, high_rows = _row_shares(high, mask)
    # TRL gathers the per-sequence shares, which needs equal rows on every process; dynamic batching does not give
    # them, so each process sends its extreme instead.
    maxima = {"-clip_low_min": _masked_max(-low_share, low_rows), "clip_high_max": _masked_max(high_share, high_rows)}
    return sums, maxima


def clip_metrics(kind: str | None, sums: dict, maxima: dict) -> dict[str, float]:
    """The logged values from the reduced `clip_sums` (a share over no token is 0, as TRL's clamp gives)."""
    if kind is None:
        return {}
    if kind == "vespo/phi_seq_mean":
        return {kind: sums["vespo_phi"] / max(sums["vespo_count"], 1.0)}
    if kind == "cispo_clip_ratio":
        return {"cispo_clip_ratio": sums["cispo_clipped"] / max(sums["cispo_count"], 1.0)}
    out = {f"clip_ratio/{name}_mean": sums[f"clip_{name}"] / max(sums[f"clip_{name}_count"], 1.0)
           for name in ("low", "high", "region")}  # fmt: skip
    out["clip_ratio/low_min"] = _finite(-maxima["-clip_low_min"])
    out["clip_ratio/high_max"] = _finite(maxima["clip_high_max"])
    return out


# ------------------------------------------------------------------ batching and scalar metrics
def padding_sums(real: int, forwarded: int) -> dict:
    """`batching.padded_fraction`'s real and forwarded tokens of this process's training forwards, to be summed."""
    return {"padding_real": torch.tensor(float(real)), "padding_forwarded": torch.tensor(float(forwarded))}


def padding_fraction(sums: dict) -> float:
    """`batching/padding_fraction`: share of the forwarded tokens that are padding, all processes."""
    return 1.0 - sums["padding_real"] / max(sums["padding_forwarded"], 1.0)


def nan_mean_sums(name: str, value: torch.Tensor) -> dict:
    """Sum and count of the finite entries of `value`, for a mean over processes that skips NaN (TRL's nanmean)."""
    value = value.detach().float().reshape(-1)
    finite = ~torch.isnan(value)
    return {name: torch.where(finite, value, 0.0).sum(), f"{name}_count": finite.float().sum()}


def nan_mean(name: str, sums: dict) -> float:
    return _ratio(sums[name], sums[f"{name}_count"])


# ------------------------------------------------------------------ the "global" entropy normalisation range
def entropy_range_maxima(entropies: torch.Tensor, mask: torch.Tensor) -> dict:
    """(-min, max) of this process's valid entropies for a MAX over processes; -inf where it has none, so an
    all-padding micro-batch never drags the range."""
    valid = mask.bool()
    entropies = entropies.detach().float()
    return {"-entropy_min": _masked_max(-entropies, valid), "entropy_max": _masked_max(entropies, valid)}


def entropy_range(maxima: dict) -> tuple[float, float]:
    """(min, max) entropy over every process; (0, 0) when no process has a valid token (w = 0.5 everywhere)."""
    low, high = -maxima["-entropy_min"], maxima["entropy_max"]
    if not (math.isfinite(low) and math.isfinite(high)):
        return (0.0, 0.0)
    return (low, high)


def logged_loss_metrics(objective, info: dict, entropies, mask, per_token_kl, sums: dict, maxima: dict,
                        reduce: Callable) -> dict:  # fmt: skip
    """TRL's `entropy`, `kl`, clip metrics, `policy_loss`, `aux_loss` and the objective's `<prefix>/` metrics of one
    micro-batch, reduced over all processes in one sum and one max (`reduce(sums, maxima)`), as logged values."""
    loss_sums_, loss_maxima = loss_sums(info, entropies, mask, per_token_kl, objective.metric_prefix,
                                        objective.fractions)  # fmt: skip
    clip_sums_, clip_maxima = clip_sums(objective.clip_metrics, info, mask)
    totals, extremes = reduce({**sums, **loss_sums_, **clip_sums_}, {**maxima, **loss_maxima, **clip_maxima})
    return {
        **{name: nan_mean(name, totals) for name in ("policy_loss", "aux_loss") if name in totals},
        **loss_metrics(totals, extremes, objective.metric_prefix, objective.fractions),
        **clip_metrics(objective.clip_metrics, totals, extremes),
        **routing_metrics(totals),
    }


def routing_metrics(totals: dict) -> dict:
    """`moe/routing_flip_fraction`: the share of the policy pass's token-layer decisions where the live router's
    top-k differs from the recorded one (what replay overrode); `moe/replayed_fraction`: the share it forced."""
    if "moe_decisions" not in totals:
        return {}
    decisions = max(totals["moe_decisions"], 1.0)
    return {"moe/routing_flip_fraction": totals["moe_flipped"] / decisions,
            "moe/replayed_fraction": totals["moe_replayed"] / decisions}  # fmt: skip

