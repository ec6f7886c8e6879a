"""Loop-based reference losses: the paper's equations and VERL's definitions of the baselines, token by token.

Nothing here shares code with `dhpo_trl`: each function walks over the sequences and their valid tokens with Python
loops and builds every term from scalar torch ops (so autograd gives the reference gradient too). The VERL
definitions are those of `verl/trainer/ppo/core_algos.py` (`compute_policy_loss_vanilla`, `_gspo`, `_geo_mean`,
`_cispo`, `agg_loss`), restated from their equations, not copied.
"""

import torch


def valid_positions(mask, i):
    return [t for t in range(mask.size(1)) if mask[i, t] > 0]


def _ratio(logp, old):
    return torch.exp(torch.clamp(logp - old, -20.0, 20.0))  # VERL clamps the log-ratio to +-20


def _clip(x, low, high):
    return torch.clamp(x, low, high)


def _advantage(advantages, i):
    return advantages.reshape(-1)[i]


# ------------------------------------------------------------------------------------------- aggregations
def seq_mean_token_mean(terms, mask):
    """VERL's "seq-mean-token-mean" (TRL's loss_type="grpo"): mean over responses of the per-response token mean."""
    per_sequence = []
    for i in range(mask.size(0)):
        valid = valid_positions(mask, i)
        if valid:
            per_sequence.append(sum(terms[i, t] for t in valid) / len(valid))
    return sum(per_sequence) / len(per_sequence)


def token_mean(terms, mask):
    """VERL's "token-mean": every valid token of the micro-batch weighted equally."""
    values = [terms[i, t] for i in range(mask.size(0)) for t in valid_positions(mask, i)]
    return sum(values) / len(values)


# ------------------------------------------------------------------------------------------- VERL's losses
def verl_vanilla_terms(logps, old, advantages, mask, clip_low, clip_high, clip_ratio_c=3.0):
    """PPO clip with the dual clip for A < 0: min(-A c, max(-A r, -A clip(r))); max(-A r, -A clip(r)) for A >= 0."""
    terms = {}
    for i in range(logps.size(0)):
        a = _advantage(advantages, i)
        for t in valid_positions(mask, i):
            r = _ratio(logps[i, t], old[i, t])
            clipped = torch.maximum(-a * r, -a * _clip(r, 1 - clip_low, 1 + clip_high))
            terms[i, t] = torch.minimum(-a * clip_ratio_c, clipped) if a < 0 else clipped
    return terms


def verl_gspo_terms(logps, old, advantages, mask, clip_low, clip_high):
    """Per-token s_{i,t} = sg[s_i] pi / sg[pi] (log clamped at 10), loss max(-A s_t, -A clip(s_t))."""
    terms = {}
    for i in range(logps.size(0)):
        valid = valid_positions(mask, i)
        if not valid:
            continue
        a = _advantage(advantages, i)
        log_s = (sum(logps[i, t] - old[i, t] for t in valid) / len(valid)).detach()
        for t in valid:
            s_t = torch.exp(torch.clamp(logps[i, t] - logps[i, t].detach() + log_s, max=10.0))
            terms[i, t] = torch.maximum(-a * s_t, -a * _clip(s_t, 1 - clip_low, 1 + clip_high))
    return terms


def verl_geo_mean_loss(logps, old, advantages, mask, clip_low, clip_high):
    """GMPO: per sequence -A exp(mean_t sgn(A) min(sgn(A) x_t, sgn(A) clip(x_t, -low, high))), x = log r; then a
    plain mean over the sequences of the micro-batch, whatever the aggregation mode."""
    losses = []
    for i in range(logps.size(0)):
        valid = valid_positions(mask, i)
        a = _advantage(advantages, i)
        sign = float(torch.sign(a))
        total = 0.0
        for t in valid:
            x = logps[i, t] - old[i, t]
            total = total + sign * torch.minimum(sign * x, sign * _clip(x, -clip_low, clip_high))
        losses.append(-a * torch.exp(total / (len(valid) + 1e-8)))
    return sum(losses) / len(losses)


def verl_cispo_terms(logps, old, advantages, mask, clip_low, clip_high):
    """CISPO: -sg[clip(r, 1 - low, 1 + high)] A log pi."""
    terms = {}
    for i in range(logps.size(0)):
        a = _advantage(advantages, i)
        for t in valid_positions(mask, i):
            weight = _clip(_ratio(logps[i, t], old[i, t]), 1 - clip_low, 1 + clip_high).detach()
            terms[i, t] = -weight * a * logps[i, t]
    return terms


# ------------------------------------------------------------------------------------------- the paper's DHPO
def reference_entropy_weights(entropies, mask, scope="batch", entropy_range=None):
    """Eq. 10 with g = min-max normalisation, on Python floats. Padding gets 0.5."""
    weights = [[0.5] * mask.size(1) for _ in range(mask.size(0))]
    all_valid = [float(entropies[i, t]) for i in range(mask.size(0)) for t in valid_positions(mask, i)]
    for i in range(mask.size(0)):
        row = [float(entropies[i, t]) for t in valid_positions(mask, i)]
        if entropy_range is not None:
            low, high = entropy_range
        elif scope == "batch":
            low, high = min(all_valid), max(all_valid)
        else:
            low, high = (min(row), max(row)) if row else (0.0, 0.0)
        for t in valid_positions(mask, i):
            h = float(entropies[i, t])
            weights[i][t] = 0.5 if high - low <= 1e-8 else min(max((h - low) / (high - low), 0.0), 1.0)
    return weights


def reference_dhpo(logps, old, advantages, mask, weights, clipping, eps, dual_clip=None):
    """Per-token terms -min(m A, m~ A) of eq. 7 built token by token (with VERL's dual clip min(-c A, term) for
    A < 0 when `dual_clip` is given). Returns {(i, t): loss term}."""
    terms = {}
    for i in range(logps.size(0)):
        valid = valid_positions(mask, i)
        if not valid:
            continue
        a = _advantage(advantages, i)
        s = torch.exp(sum(logps[i, t] - old[i, t] for t in valid) / len(valid)).detach()  # eq. 4, sg[s_i]
        for t in valid:
            w = weights[i][t]
            r = torch.exp(logps[i, t] - old[i, t])  # eq. 2
            s_t = s * torch.exp(logps[i, t] - logps[i, t].detach())  # eq. 5
            m = w * r + (1 - w) * s_t  # eq. 8
            if clipping == "branch":  # eq. 11
                m_tilde = w * _clip(r, 1 - eps["epsilon_low_token"], 1 + eps["epsilon_high_token"]) + (1 - w) * _clip(
                    s_t, 1 - eps["epsilon_low_seq"], 1 + eps["epsilon_high_seq"]
                )
            else:
                m_tilde = _clip(m, 1 - eps["epsilon_low_token"], 1 + eps["epsilon_high_token"])
            terms[i, t] = -torch.minimum(m * a, m_tilde * a)
            if dual_clip is not None and a < 0:
                terms[i, t] = torch.minimum(-a * dual_clip, terms[i, t])
    return terms


def constant_weights(mask, w):
    return [[w] * mask.size(1) for _ in range(mask.size(0))]
