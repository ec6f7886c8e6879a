"""A fixed micro-batch whose importance ratios are chosen by hand, and the trainer metrics expected on it.

pi_old is set to pi_theta's own log-probs (a plain forward pass, no TRL helper) minus a chosen log-ratio per token,
so every ratio the trainer sees is exp(chosen value) up to float32 noise. The log-ratios, advantages and padding
are picked so that each clip flag fires on some tokens and not on others, and a row is all padding. The expected
metrics are computed below on Python floats, token by token, from the definitions (paper eqs. 2, 4, 8, 10, 11):
no code is shared with dhpo_trl.

Used by tests/test_metrics.py (one process) and tests/dist_scripts/metrics_distributed.py (two processes).
"""

from __future__ import annotations

import math
import statistics

import torch

SEED = 11
PROMPT_LEN, WIDTH = 4, 6
# Per-token log-ratios log(pi_theta / pi_old) of the valid tokens; the rest of each row is padding, whose
# pi_old is garbage (7.0 above pi_theta) that must never reach a metric.
LOG_RATIOS = [
    [0.40, 0.30, 0.35, -0.05, 0.50, 0.20],  # A > 0, s = 1.34: token-high and sequence-high clips
    [-0.40, -0.10, 0.20, -0.30],  # A < 0, s = 0.86: token-low and sequence-low clips
    [],  # all padding
    [0.60, -0.02],  # A < 0 with ratios above 1: the high clips do not bind for a negative advantage
    [0.05, -0.30, 0.10, 0.00, -0.08],  # A > 0, everything inside the trust regions
]
ADVANTAGES = [1.0, -0.5, 0.8, -1.5, 0.3]
# ref log-prob minus pi_theta's log-prob, per token (k3 KL estimator input); padding gets garbage too.
KL_SHIFTS = [[0.1 * (t + 1) * (-1) ** row for t in range(WIDTH)] for row in range(len(LOG_RATIOS))]
GARBAGE = 7.0
EPSILONS = dict(epsilon_low_token=0.2, epsilon_high_token=0.28, epsilon_low_seq=0.1, epsilon_high_seq=0.15)
GMPO_EPSILONS = dict(gmpo_epsilon_low=0.25, gmpo_epsilon_high=0.35)


def epsilons_for(overrides: dict) -> dict:
    """The clip settings the configured objective reads (DHPOConfig refuses the others): DHPO's token and, with branch
    clipping, sequence epsilons; none of them for GMPO."""
    if overrides.get("algorithm", "dhpo") != "dhpo":
        return {}
    if overrides.get("clipping") == "unified":
        return {k: v for k, v in EPSILONS.items() if k.endswith("_token")}
    return dict(EPSILONS)


def lengths(rows=None):
    rows = range(len(LOG_RATIOS)) if rows is None else rows
    return [len(LOG_RATIOS[r]) for r in rows]


def build_policy(tokenizer):
    """The tiny Qwen3 with its (tied) embeddings scaled up, so that token entropies spread over several nats
    instead of sitting near log(vocab): the min-max mixing weight is then well conditioned in float32."""
    from dhpo_trl.demo.tiny import build_tiny_qwen3

    model = build_tiny_qwen3(tokenizer, hidden_size=32, seed=SEED)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
    return model


def token_ids(vocab_size: int):
    generator = torch.Generator().manual_seed(SEED)
    prompt_ids = torch.randint(3, vocab_size, (len(LOG_RATIOS), PROMPT_LEN), generator=generator)
    completion_ids = torch.randint(3, vocab_size, (len(LOG_RATIOS), WIDTH), generator=generator)
    return prompt_ids, completion_ids


def reference_logps_and_entropies(model, prompt_ids, completion_ids, completion_mask):
    """Log-prob of each sampled completion token and the entropy of its distribution: log-softmax by hand."""
    with torch.no_grad():
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention = torch.cat([torch.ones_like(prompt_ids), completion_mask], dim=1)
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, PROMPT_LEN - 1 : -1].float()
        log_probs = logits.log_softmax(-1)
        logps = log_probs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        entropies = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropies


def _per_token(values, rows):
    """(len(rows), WIDTH) tensor of `values[row]` padded with GARBAGE."""
    table = [[*values[r], *[GARBAGE] * (WIDTH - len(values[r]))] for r in rows]
    return torch.tensor(table, dtype=torch.float32)


def inputs_for(model, rows=None, all_padding=False):
    """`_compute_loss` inputs for the given rows (all by default); `all_padding` masks every completion token."""
    rows = list(range(len(LOG_RATIOS))) if rows is None else list(rows)
    prompt_ids, completion_ids = (ids[rows] for ids in token_ids(model.config.vocab_size))
    mask = (torch.arange(WIDTH) < torch.tensor(lengths(rows)).unsqueeze(1)).long()
    if all_padding:
        mask = torch.zeros_like(mask)
    logps, _ = reference_logps_and_entropies(model, prompt_ids, completion_ids, mask)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": mask,
        "advantages": torch.tensor([ADVANTAGES[r] for r in rows]),
        "old_per_token_logps": logps - _per_token(LOG_RATIOS, rows),
        "ref_per_token_logps": logps
        + _per_token([shifts[: len(ratios)] for shifts, ratios in zip(KL_SHIFTS, LOG_RATIOS)], rows),
        "num_items_in_batch": mask.sum(),
    }


def full_batch_entropies(model):
    """Entropy of every valid token of the full batch, as {(row, t): H}."""
    prompt_ids, completion_ids = token_ids(model.config.vocab_size)
    mask = (torch.arange(WIDTH) < torch.tensor(lengths()).unsqueeze(1)).long()
    _, entropies = reference_logps_and_entropies(model, prompt_ids, completion_ids, mask)
    return {(r, t): entropies[r, t].item() for r in range(len(LOG_RATIOS)) for t in range(len(LOG_RATIOS[r]))}


def expected_metrics(
    entropies, algorithm="dhpo", mixing="entropy", token_weight=0.5, clipping="branch", scope="batch",
    bias_corrected_kl=True,
):  # fmt: skip
    """The `dhpo/` (or `gmpo/`), `entropy` and `kl` metrics of the full batch, token by token on floats.

    Means are over valid tokens, except the sequence ratio's, which is over sequences with a valid token; clip
    fractions count valid tokens (a clipped sequence counts each of its tokens). Minima and maxima are over the
    same populations. `entropies` is {(row, t): H} as `full_batch_entropies` returns it. `scope="sequence"`
    normalises the entropy of each row by that row's own range; a one-token row then gets w = 0.5.
    """
    tokens = [(r, t) for r in range(len(LOG_RATIOS)) for t in range(len(LOG_RATIOS[r]))]
    sequences = [r for r in range(len(LOG_RATIOS)) if LOG_RATIOS[r]]
    token_ratio = {(r, t): math.exp(LOG_RATIOS[r][t]) for r, t in tokens}
    kl = {(r, t): math.exp(KL_SHIFTS[r][t]) - KL_SHIFTS[r][t] - 1 for r, t in tokens}

    def mean(values):
        return sum(values) / len(values)

    metrics = {"entropy": mean([entropies[k] for k in tokens])}
    # How far pi_theta is from pi_old, for every objective: the token mean of |log r|.
    metrics["off_policy/abs_log_ratio"] = mean([abs(LOG_RATIOS[r][t]) for r, t in tokens])
    # ... and per sequence: the spread of its token log-ratios (population std) and |its mean|, over sequences.
    metrics["off_policy/log_ratio_spread"] = mean([statistics.pstdev(LOG_RATIOS[r]) for r in sequences])
    metrics["off_policy/abs_sequence_log_ratio"] = mean([abs(mean(LOG_RATIOS[r])) for r in sequences])
    if algorithm == "gmpo":
        low, high = -GMPO_EPSILONS["gmpo_epsilon_low"], GMPO_EPSILONS["gmpo_epsilon_high"]
        clipped, sequence_ratio = set(), {}
        for r in sequences:
            kept = []
            for t, x in enumerate(LOG_RATIOS[r]):
                # the clip only binds where it lowers the objective: above for A > 0, below for A < 0
                bound = min(x, high) if ADVANTAGES[r] > 0 else max(x, low)
                if bound != x:
                    clipped.add((r, t))
                kept.append(bound)
            sequence_ratio[r] = math.exp(mean(kept))
        metrics["gmpo/clip_fraction"] = len(clipped) / len(tokens)
        metrics["kl"] = mean([kl[k] * (token_ratio[k] if bias_corrected_kl else 1.0) for k in tokens])
        prefix = "gmpo"
    else:
        sequence_ratio = {r: math.exp(mean(LOG_RATIOS[r])) for r in sequences}
        weight = {}
        for r, t in tokens:
            pool = tokens if scope == "batch" else [(r, u) for u in range(len(LOG_RATIOS[r]))]
            low, high = min(entropies[k] for k in pool), max(entropies[k] for k in pool)
            if mixing == "averaged":
                weight[r, t] = token_weight
            else:
                weight[r, t] = (entropies[r, t] - low) / (high - low) if high > low else 0.5
        eps = EPSILONS
        flags = {"token_low": 0, "token_high": 0, "sequence_low": 0, "sequence_high": 0, "clipped_term": 0}
        mixed = {}
        for r, t in tokens:
            a, ratio, seq, w = ADVANTAGES[r], token_ratio[r, t], sequence_ratio[r], weight[r, t]
            mixed[r, t] = m = w * ratio + (1 - w) * seq
            token_low, token_high = 1 - eps["epsilon_low_token"], 1 + eps["epsilon_high_token"]
            if clipping == "branch":  # each ratio in its own trust region, then mixed (eq. 11)
                flags["token_low"] += a < 0 and ratio < token_low
                flags["token_high"] += a > 0 and ratio > token_high
                flags["sequence_low"] += a < 0 and seq < 1 - eps["epsilon_low_seq"]
                flags["sequence_high"] += a > 0 and seq > 1 + eps["epsilon_high_seq"]
                clip_token = min(max(ratio, token_low), token_high)
                clip_seq = min(max(seq, 1 - eps["epsilon_low_seq"]), 1 + eps["epsilon_high_seq"])
                clipped = w * clip_token + (1 - w) * clip_seq
            else:  # one clip of m with the token epsilons, reported under the token branch
                flags["token_low"] += a < 0 and m < token_low
                flags["token_high"] += a > 0 and m > token_high
                clipped = min(max(m, token_low), token_high)
            flags["clipped_term"] += clipped * a < m * a - 1e-9
        mean_w = mean([weight[k] for k in tokens])
        metrics["dhpo/mixing_weight/mean"] = mean_w
        metrics["dhpo/mixing_weight/std"] = math.sqrt(mean([(weight[k] - mean_w) ** 2 for k in tokens]))
        for name in ("token_low", "token_high", "sequence_low", "sequence_high"):
            metrics[f"dhpo/clip_fraction/{name}"] = flags[name] / len(tokens)
        metrics["dhpo/clipped_term_fraction"] = flags["clipped_term"] / len(tokens)
        metrics["kl"] = mean([kl[k] * (mixed[k] if bias_corrected_kl else 1.0) for k in tokens])
        prefix = "dhpo"
    metrics[f"{prefix}/token_ratio/mean"] = mean(list(token_ratio.values()))
    metrics[f"{prefix}/token_ratio/min"] = min(token_ratio.values())
    metrics[f"{prefix}/token_ratio/max"] = max(token_ratio.values())
    metrics[f"{prefix}/sequence_ratio/mean"] = mean(list(sequence_ratio.values()))
    metrics[f"{prefix}/sequence_ratio/min"] = min(sequence_ratio.values())
    metrics[f"{prefix}/sequence_ratio/max"] = max(sequence_ratio.values())
    return metrics


# TRL's clip metrics (`_log_trl_clip_metrics`) on hand-made indicators. Valid tokens per row: 3, 2, 0, 4; the
# indicators are also True on some padding, which must not count.
CLIP_MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
CLIP_LOW = [[1, 0, 0, 1], [1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 0, 0]]
CLIP_HIGH = [[0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 1, 0]]
# Valid tokens clipped below: 1 + 2 + 0 + 2 = 5 of 9; above: 1 + 0 + 0 + 1 = 2; either: 2 + 2 + 0 + 3 = 7.
# Per-row shares below 1/3, 1, (none), 1/2: the lowest is 1/3, a row with padding; above 1/3, 0, (none), 1/4.
CLIP_EXPECTED = {
    "clip_ratio/low_mean": 5 / 9, "clip_ratio/high_mean": 2 / 9, "clip_ratio/region_mean": 7 / 9,
    "clip_ratio/low_min": 1 / 3, "clip_ratio/high_max": 1 / 3,
}  # fmt: skip


def clip_info(rows):
    """(info, mask) for `_log_trl_clip_metrics` on the given rows of the CLIP_ tables."""
    def table(values):
        return torch.tensor([values[r] for r in rows], dtype=torch.bool)

    return {"clipped_low": table(CLIP_LOW), "clipped_high": table(CLIP_HIGH)}, table(CLIP_MASK).float()
