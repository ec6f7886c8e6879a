"""The policy objectives by name, as VERL's `core_algos` registry: `algorithm` -> loss, settings, metrics.

Each `Objective` names the pure loss of `dhpo_trl.core.losses` it computes, the `DHPOConfig` fields that loss reads
(the config refuses the others when set, the model card lists only these) and how its metrics are logged. The
trainer looks the objective up and never branches on the algorithm itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .aggregation import AGGREGATIONS
from .losses import (
    cispo_per_token_loss,
    dhpo_per_token_loss,
    gmpo_per_token_loss,
    grpo_per_token_loss,
    gspo_per_token_loss,
    masked_log_ratio,
    sequence_log_ratio,
    unit_ratio,
)

# Where each objective-specific setting acts, for the message that refuses it elsewhere.
SETTING_SCOPES = {
    "mixing": "algorithm='dhpo'",
    "token_weight": "algorithm='dhpo' with mixing='averaged'",
    "clipping": "algorithm='dhpo'",
    "epsilon_low_token": "algorithm='dhpo'",
    "epsilon_high_token": "algorithm='dhpo'",
    "epsilon_low_seq": "algorithm='dhpo' with clipping='branch'",
    "epsilon_high_seq": "algorithm='dhpo' with clipping='branch'",
    "entropy_norm_scope": "algorithm='dhpo' with mixing='entropy'",
    "gmpo_epsilon_low": "algorithm='gmpo'",
    "gmpo_epsilon_high": "algorithm='gmpo'",
    "epsilon": "algorithm='grpo' or 'gspo' (DHPO's epsilons are epsilon_low/high_token/seq, GMPO's gmpo_epsilon_*)",
    "epsilon_high": "algorithm='grpo' or 'gspo' (upper clip) and 'cispo' (the weight cap)",
    "delta": "algorithm='grpo', 'gspo' or 'dhpo'",
    "importance_sampling_level": "algorithm='gspo', which sets it to 'sequence' (DHPO mixes both levels itself)",
}


@dataclass(frozen=True)
class Objective:
    """One row of the registry.

    `compute(per_token_logps, old_per_token_logps, advantages, mask, entropies, args, entropy_range)` returns
    `(per_token_loss, kl_weight, info)`: the (B, T) loss, TRL's importance weight for `use_bias_correction_kl` (with
    the gradient TRL's weight has) and the loss's detached diagnostics. `settings(args)` lists the config fields the
    loss reads for this config. `metric_prefix` names the `<prefix>/` metrics (None: TRL's keys only), `fractions`
    the (metric suffix, info key) pairs logged as token fractions under it, `clip_metrics` TRL's key family for the
    clip indicators ("clip_ratio" or "cispo_clip_ratio"), `loss_types` the aggregations it accepts.
    """

    compute: Callable
    settings: Callable
    metric_prefix: str | None = None
    fractions: tuple[tuple[str, str], ...] = ()
    clip_metrics: str = "clip_ratio"
    loss_types: tuple[str, ...] = AGGREGATIONS


def _token_kl_weight(per_token_logps, token_ratio, mask):
    """r with TRL's gradient for its token-level weight: value r, gradient r grad log pi."""
    return token_ratio.detach() * unit_ratio(per_token_logps, mask)


def _dhpo(per_token_logps, old_per_token_logps, advantages, mask, entropies, args, entropy_range):
    per_token_loss, info = dhpo_per_token_loss(
        per_token_logps, old_per_token_logps, advantages, mask, entropies,
        mixing=args.mixing, token_weight=args.token_weight, clipping=args.clipping,
        epsilon_low_token=args.epsilon_low_token, epsilon_high_token=args.epsilon_high_token,
        epsilon_low_seq=args.epsilon_low_seq, epsilon_high_seq=args.epsilon_high_seq,
        entropy_scope=args.entropy_norm_scope,
        entropy_range=entropy_range, delta=args.delta,
    )  # fmt: skip
    # Scaled like TRL's ratio: value m, gradient m grad log pi (eq. 16); at w = 1 exactly TRL's.
    return per_token_loss, _token_kl_weight(per_token_logps, info["mixed_ratio"], mask), info


def _dhpo_settings(args) -> tuple[str, ...]:
    weight = ("token_weight",) if args.mixing == "averaged" else ("entropy_norm_scope",)
    sequence = ("epsilon_low_seq", "epsilon_high_seq") if args.clipping == "branch" else ()
    return ("mixing", *weight, "clipping", "epsilon_low_token", "epsilon_high_token", *sequence, "delta")


def _gmpo(per_token_logps, old_per_token_logps, advantages, mask, entropies, args, entropy_range):
    per_token_loss, info = gmpo_per_token_loss(
        per_token_logps, old_per_token_logps, advantages, mask,
        epsilon_low=args.gmpo_epsilon_low, epsilon_high=args.gmpo_epsilon_high,
    )  # fmt: skip
    return per_token_loss, _token_kl_weight(per_token_logps, info["token_ratio"], mask), info


def _trl_epsilons(args) -> tuple[float, float]:
    return args.epsilon, args.epsilon if args.epsilon_high is None else args.epsilon_high


def _grpo(per_token_logps, old_per_token_logps, advantages, mask, entropies, args, entropy_range):
    low, high = _trl_epsilons(args)
    per_token_loss, info = grpo_per_token_loss(
        per_token_logps, old_per_token_logps, advantages, mask, epsilon_low=low, epsilon_high=high, delta=args.delta
    )
    return per_token_loss, _token_kl_weight(per_token_logps, info["token_ratio"], mask), info


def _gspo(per_token_logps, old_per_token_logps, advantages, mask, entropies, args, entropy_range):
    low, high = _trl_epsilons(args)
    per_token_loss, info = gspo_per_token_loss(
        per_token_logps, old_per_token_logps, advantages, mask, epsilon_low=low, epsilon_high=high, delta=args.delta
    )
    # TRL scales the KL by its sequence ratio with its full gradient (through the mean of the log-ratios)
    log_ratio = masked_log_ratio(per_token_logps, old_per_token_logps, mask)
    return per_token_loss, torch.exp(sequence_log_ratio(log_ratio, mask)).unsqueeze(1), info


def _cispo(per_token_logps, old_per_token_logps, advantages, mask, entropies, args, entropy_range):
    per_token_loss, info = cispo_per_token_loss(
        per_token_logps, old_per_token_logps, advantages, mask, cap=args.epsilon_high
    )
    return per_token_loss, _token_kl_weight(per_token_logps, info["token_ratio"], mask), info


DHPO_FRACTIONS = (
    ("clip_fraction/token_low", "token_clipped_low"), ("clip_fraction/token_high", "token_clipped_high"),
    ("clip_fraction/sequence_low", "sequence_clipped_low"), ("clip_fraction/sequence_high", "sequence_clipped_high"),
    ("clipped_term_fraction", "uses_clipped_term"), ("clip_fraction/dual", "dual_clipped"),
)  # fmt: skip

OBJECTIVES: dict[str, Objective] = {
    "dhpo": Objective(_dhpo, _dhpo_settings, metric_prefix="dhpo", fractions=DHPO_FRACTIONS),
    # VERL's geo_mean is a mean over sequences whatever its aggregation mode: only the per-response mean keeps it so.
    "gmpo": Objective(
        _gmpo,
        lambda args: ("gmpo_epsilon_low", "gmpo_epsilon_high"),
        metric_prefix="gmpo",
        fractions=(("clip_fraction", "token_clipped"),),
        loss_types=("grpo",),
    ),
    "grpo": Objective(_grpo, lambda args: ("epsilon", "epsilon_high", "delta")),
    "gspo": Objective(_gspo, lambda args: ("importance_sampling_level", "epsilon", "epsilon_high", "delta")),
    "cispo": Objective(_cispo, lambda args: ("epsilon_high",), clip_metrics="cispo_clip_ratio"),
}
OBJECTIVE_SETTINGS = tuple(SETTING_SCOPES)


def get_objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise ValueError(f"algorithm={name!r} is not supported: use one of {list(OBJECTIVES)}.")
    return OBJECTIVES[name]
