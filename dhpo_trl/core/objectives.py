"""The policy objectives by name, as VERL's `core_algos` registry: `algorithm` -> loss, settings, metrics.

The rows are DHPO, the paper's baselines (GRPO, GSPO, GMPO, CISPO) and TRL 1.16's other objectives (SAPO, LUSPO,
VESPO). `TRL_LOSS_TYPES` says which row and aggregation TRL's `GRPOTrainer` runs for each of its `loss_type`
values, so a TRL configuration selects the same objective here.

Each `Objective` names the pure loss of `dhpo_trl.core.losses` it computes, the `DHPOConfig` fields that loss reads
(the config refuses the others when set, the model card lists only these) and how its metrics are logged. The
trainer looks the objective up and never branches on the algorithm itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .aggregation import AGGREGATIONS, BASE_AGGREGATIONS  # noqa: F401 - re-exported for core.config
from .losses import (
    cispo_per_token_loss,
    dhpo_per_token_loss,
    gmpo_per_token_loss,
    grpo_per_token_loss,
    gspo_per_token_loss,
    importance_weight,
    masked_log_ratio,
    sapo_per_token_loss,
    sequence_log_ratio,
    unit_ratio,
    vespo_per_token_loss,
)

# TRL's loss_type values that name an objective as well as an aggregation: the row and the aggregation TRL runs.
# (TRL's other loss types, "grpo", "bnpo", "dr_grpo" and "dapo", are aggregations of its clipped surrogate: the "grpo"
# row, or "gspo" with importance_sampling_level="sequence".)
TRL_LOSS_TYPES = {"cispo": ("cispo", "dapo"), "sapo": ("sapo", "grpo"), "luspo": ("luspo", "luspo"),
                  "vespo": ("vespo", "dapo")}  # fmt: skip

# Where each objective-specific setting acts, for the message that refuses it elsewhere.
SETTING_SCOPES = {
    "mixing": "algorithm='dhpo'",
    "token_weight": "algorithm='dhpo' with mixing='averaged'",
    "clipping": "algorithm='dhpo'",
    "epsilon_low_token": "algorithm='dhpo' (with clipping='branch' and mixing='averaged': token_weight > 0)",
    "epsilon_high_token": "algorithm='dhpo' (with clipping='branch' and mixing='averaged': token_weight > 0)",
    "epsilon_low_seq": "algorithm='dhpo' with clipping='branch' (and mixing='averaged': token_weight < 1)",
    "epsilon_high_seq": "algorithm='dhpo' with clipping='branch' (and mixing='averaged': token_weight < 1)",
    "entropy_norm_scope": "algorithm='dhpo' with mixing='entropy'",
    "gmpo_epsilon_low": "algorithm='gmpo'",
    "gmpo_epsilon_high": "algorithm='gmpo'",
    "epsilon": "algorithm='grpo', 'gspo' or 'luspo' (DHPO's lower clips are epsilon_low_token and epsilon_low_seq, "
               "GMPO's gmpo_epsilon_low)",
    "epsilon_high": "algorithm='grpo', 'gspo' or 'luspo' (upper clip) and 'cispo' (the weight cap); DHPO's upper "
                    "clips are epsilon_high_token and epsilon_high_seq, GMPO's gmpo_epsilon_high",
    "delta": "algorithm='grpo', 'gspo', 'luspo' or 'dhpo'",
    "importance_sampling_level": "algorithm='gspo' (which sets 'sequence'; with algorithm='grpo' or the default "
                                 "'sequence' selects it), 'sapo', 'luspo', 'cispo', and 'vespo' with a bias-corrected "
                                 "KL (beta != 0); DHPO mixes both levels itself",
    "sapo_temperature_pos": "algorithm='sapo'",
    "sapo_temperature_neg": "algorithm='sapo'",
    "vespo_k_pos": "algorithm='vespo'",
    "vespo_lambda_pos": "algorithm='vespo'",
    "vespo_k_neg": "algorithm='vespo'",
    "vespo_lambda_neg": "algorithm='vespo'",
}


@dataclass(frozen=True)
class Objective:
    """One row of the registry.

    `compute(per_token_logps, old_per_token_logps, advantages, mask, entropies, args, entropy_range)` returns
    `(per_token_loss, kl_weight, info)`: the (B, T) loss, TRL's importance weight for `use_bias_correction_kl` (with
    the gradient TRL's weight has) and the loss's detached diagnostics. `settings(args)` lists the config fields the
    loss reads for this config. `metric_prefix` names the `<prefix>/` metrics (None: TRL's keys only), `fractions`
    the (metric suffix, info key) pairs logged as token fractions under it, `clip_metrics` TRL's key family for the
    clip indicators ("clip_ratio", "cispo_clip_ratio", "vespo/phi_seq_mean" or None for none), `loss_types` the
    aggregations it accepts (the first is its own where DHPO's default, "grpo", is not among them).
    """

    compute: Callable
    settings: Callable
    metric_prefix: str | None = None
    fractions: tuple[tuple[str, str], ...] = ()
    clip_metrics: str | None = "clip_ratio"
    loss_types: tuple[str, ...] = BASE_AGGREGATIONS


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
    averaged, branch = args.mixing == "averaged", args.clipping == "branch"
    weight = ("token_weight",) if averaged else ("entropy_norm_scope",)
    # Branch clipping at w = 0 or w = 1 clips a ratio that carries no weight; the unified clip uses the token epsilons.
    token = () if branch and averaged and args.token_weight == 0 else ("epsilon_low_token", "epsilon_high_token")
    sequence = ("epsilon_low_seq", "epsilon_high_seq") if branch and not (averaged and args.token_weight == 1) else ()
    return ("mixing", *weight, "clipping", *token, *sequence, "delta")


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
    level = args.importance_sampling_level
    per_token_loss, info = cispo_per_token_loss(
        per_token_logps, old_per_token_logps, advantages, mask, cap=args.epsilon_high, level=level
    )
    return per_token_loss, importance_weight(per_token_logps, old_per_token_logps, mask, level), info


def _sapo(per_token_logps, old_per_token_logps, advantages, mask, entropies, args, entropy_range):
    level = args.importance_sampling_level
    per_token_loss, info = sapo_per_token_loss(
        per_token_logps, old_per_token_logps, advantages, mask, temperature_pos=args.sapo_temperature_pos,
        temperature_neg=args.sapo_temperature_neg, level=level,
    )  # fmt: skip
    return per_token_loss, importance_weight(per_token_logps, old_per_token_logps, mask, level), info


def _luspo(per_token_logps, old_per_token_logps, advantages, mask, entropies, args, entropy_range):
    # TRL's clipped surrogate at the chosen level; the length weighting is the "luspo" aggregation's.
    surrogate = _gspo if args.importance_sampling_level == "sequence" else _grpo
    return surrogate(per_token_logps, old_per_token_logps, advantages, mask, entropies, args, entropy_range)


def _vespo(per_token_logps, old_per_token_logps, advantages, mask, entropies, args, entropy_range):
    per_token_loss, info = vespo_per_token_loss(
        per_token_logps, old_per_token_logps, advantages, mask, k_pos=args.vespo_k_pos,
        lambda_pos=args.vespo_lambda_pos, k_neg=args.vespo_k_neg, lambda_neg=args.vespo_lambda_neg,
    )  # fmt: skip
    # The level acts on the KL's importance weight only (TRL's coef_1); VESPO's own weight is the sequence's.
    kl_weight = importance_weight(per_token_logps, old_per_token_logps, mask, args.importance_sampling_level)
    return per_token_loss, kl_weight, info


def _vespo_settings(args) -> tuple[str, ...]:
    kl_weighted = args.beta != 0.0 and args.use_bias_correction_kl
    level = ("importance_sampling_level",) if kl_weighted else ()
    return ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", *level)


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
    "cispo": Objective(
        _cispo, lambda args: ("epsilon_high", "importance_sampling_level"), clip_metrics="cispo_clip_ratio"
    ),
    # TRL 1.16's own objectives (its loss_type="sapo", "luspo", "vespo"), TRL's metrics only.
    "sapo": Objective(
        _sapo,
        lambda args: ("sapo_temperature_pos", "sapo_temperature_neg", "importance_sampling_level"),
        clip_metrics=None,
    ),
    # LUSPO's length weighting is its aggregation: each sequence's token sum, averaged over sequences.
    "luspo": Objective(
        _luspo, lambda args: ("importance_sampling_level", "epsilon", "epsilon_high", "delta"), loss_types=("luspo",)
    ),
    "vespo": Objective(_vespo, _vespo_settings, clip_metrics="vespo/phi_seq_mean"),
}
OBJECTIVE_SETTINGS = tuple(SETTING_SCOPES)


def get_objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise ValueError(f"algorithm={name!r} is not supported: use one of {list(OBJECTIVES)}.")
    return OBJECTIVES[name]
