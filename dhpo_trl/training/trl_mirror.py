"""Every block of dhpo-trl that mirrors TRL's `GRPOTrainer` (trl 1.16, `trl/trainer/grpo_trainer.py`), in one place.

`MIRRORED` lists each mirrored TRL block: our function, TRL's method, the line range in trl 1.16's file, and the
text of the first and last line of that range. `tests/test_trl_mirror.py` checks the installed TRL still has that
text at those lines, so a TRL upgrade fails there, and the review is this list. The code below is the part of
TRL's `_compute_loss` tail we copy rather than call (TRL's loss is one method; we need its pieces around our
objective's per-token loss); aggregation and the entropy bonus are in `dhpo_trl.core.aggregation`, the metrics in
`dhpo_trl.core.metrics`, the chunked forward and micro-batch cutting in `dhpo_trl.training.batching`, all listed here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

TRL_VERSION = "1.16"
TRL_FILE = "trl/trainer/grpo_trainer.py"


class Mirror(NamedTuple):
    ours: str  # module.function in dhpo_trl
    trl: str  # GRPOTrainer method
    lines: tuple[int, int]  # first and last line, 1-based, inclusive
    first: str  # that first line's text, stripped
    last: str  # that last line's text, stripped
    what: str  # what is mirrored, and how ours differs


MIRRORED: tuple[Mirror, ...] = (
    Mirror("trl_mirror.apply_corrections", "_compute_loss", (3140, 3150),
           "if self.off_policy_mask_threshold is not None:",
           "per_token_loss = per_token_loss + self.beta * per_token_kl",
           "the order of the masks and corrections on the per-token loss: off-policy mask, top-entropy mask, vLLM "
           "importance-sampling ratio, then + beta x KL"),
    Mirror("losses.importance_weight", "_compute_loss", (3083, 3095),
           "log_ratio = per_token_logps - old_per_token_logps", "coef_1 = torch.exp(log_importance_weights)",
           "TRL's ratio at importance_sampling_level (token, or the sequence's geometric mean), with its gradient; "
           "ours masks and clamps the log-ratio"),
    Mirror("losses.cispo_per_token_loss, sapo_per_token_loss, vespo_per_token_loss", "_compute_loss", (3109, 3136),
           'if self.loss_type == "cispo":', "per_token_loss = -phi_seq * advantages * per_token_logps",
           "the per-token losses of TRL's cispo, clipped surrogate, sapo and vespo; ours zero log pi on padding"),
    Mirror("losses.vespo_weight", "get_gamma_weights", (2972, 3018),
           "def get_gamma_weights(", "return phi_seq  # (B, 1)",
           "VESPO's gamma weight of the summed sequence log-ratio, detached; ours leaves out the vLLM ratio, which "
           "the config refuses with VESPO"),
    Mirror("aggregation.aggregate (luspo)", "_compute_loss", (3175, 3181),
           'elif self.loss_type == "luspo":', "policy_loss = loss.detach()",
           "LUSPO's per-response token sum averaged over responses, divided for accumulation (the Window's rows)"),
    Mirror("trl_mirror.per_token_kl", "_compute_loss", (3098, 3105),
           "if self.beta != 0.0:", "per_token_kl = per_token_kl * coef_1",
           "k3 KL to the reference, optionally weighted by the ratio; ours masks the log-ratio before exp() and "
           "weights by the objective's ratio"),
    Mirror("aggregation.aggregate", "_compute_loss", (3152, 3174),
           'mode = "train" if self.model.training else "eval"', "policy_loss = loss.detach()",
           "grpo / bnpo / dr_grpo / dapo and their accumulation normalisers; ours divides by the Window's counts "
           "(TRL's when the slices are TRL's)"),
    Mirror("aggregation.entropy_bonus, applied_coefficient, next_coefficient", "_compute_loss", (3189, 3245),
           "if self._entropy_bonus_enabled:", 'self._metrics[mode]["entropy_coef"].append(self.entropy_coef)',
           "the entropy bonus, the adaptive controller and its once-per-step update; ours weighs a planned "
           "micro-batch by its share of the window's tokens"),
    Mirror("DHPOTrainer._compute_loss (aux loss)", "_compute_loss", (3248, 3251),
           "if self.aux_loss_enabled:",
           'self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())',
           "the MoE router aux loss divided for accumulation; ours by the Window's passes"),
    Mirror("metrics.loss_sums, clip_sums", "_compute_loss", (3254, 3286),
           "def masked_seq_mean(x):",
           'self._metrics[mode]["cispo_clip_ratio"].append(global_masked_mean(is_cispo_clipped.float()))',
           "entropy, kl and clip metrics; ours reduces extremes instead of gathering rows (rows differ per process)"),
    Mirror("batching.chunked_forward", "_get_per_token_logps_and_entropies", (1440, 1508),
           "batch_size = batch_size or input_ids.size(0)  # Chunk inputs into smaller batches to reduce memory peak",
           "return logps, entropies, aux_loss",
           "the chunked forward: ours runs TRL's method on length-sorted, trimmed chunks and scatters them back"),
    Mirror("DHPOTrainer._prepare_inputs", "_prepare_inputs", (1536, 1551),
           'mode = "train" if self.model.training else "eval"', "return inputs",
           "when a generation batch is fresh (the same test as TRL's) and which buffered micro-batch a step takes"),
)  # fmt: skip


def per_token_kl(ref_per_token_logps: torch.Tensor, per_token_logps: torch.Tensor, mask: torch.Tensor,
                 weight: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """TRL's k3 estimator exp(ref - logp) - (ref - logp) - 1, times `weight` (`use_bias_correction_kl`).

    The log-ratio is masked before exp(): padding holds no reference log-prob (dynamic batching leaves it 0).
    """
    log_ratio = torch.where(mask.bool(), ref_per_token_logps - per_token_logps, 0.0)
    kl = torch.exp(log_ratio) - log_ratio - 1
    return kl if weight is None else kl * weight


def apply_corrections(per_token_loss: torch.Tensor, off_policy_mask: torch.Tensor | None = None,
                      entropy_mask: torch.Tensor | None = None, importance_sampling_ratio: torch.Tensor | None = None,
                      beta: float = 0.0, kl: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """TRL's masks and corrections on a per-token loss, in TRL's order; None leaves a factor out."""
    if off_policy_mask is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    # vLLM sampled from pi_sampler, not pi_old: TRL's (detached) pi_old / pi_sampler correction multiplies the loss,
    # while the objective's ratios correct pi_theta against pi_old.
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * kl
    return per_token_loss
