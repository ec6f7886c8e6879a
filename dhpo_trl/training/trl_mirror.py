"""Every block of dhpo-trl that mirrors TRL's `GRPOTrainer` (trl 1.16, `trl/trainer/grpo_trainer.py`), in one place.

`MIRRORED` lists each mirrored TRL block: our function, TRL's method, the line range in trl 1.16's file, and the
text of the first and last line of that range. `tests/test_trl_mirror.py` checks the installed TRL still has that
text at those lines, so a TRL upgrade fails there, and the review is this list. The code below is the part of
TRL's `_compute_loss` tail we copy rather than call (TRL's loss is one method; we need its pieces around our
objective's per-token loss); aggregation and the entropy bonus are in `dhpo_trl.core.aggregation`, the metrics in
`dhpo_trl.core.metrics`, the adaptive entropy controller in `dhpo_trl.core.entropy_control`, the chunked forward and micro-batch cutting in `dhpo_trl.training.batching`, all listed here.

`PRIVATE` lists every private name of TRL, transformers and DeepSpeed that dhpo-trl reads, writes, overrides or
passes (the private surface a version upgrade can break), with the file and line range where the installed version
defines it; `tests/test_trl_mirror.py` checks each still exists there, so an upgrade fails one test with the list.
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
    Mirror("aggregation.entropy_bonus, entropy_control", "_compute_loss", (3189, 3245),
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


class Private(NamedTuple):
    owner: str  # the importable object that holds the name ("module:Object" or "module")
    name: str
    use: str  # "reads", "writes", "overrides", "passes" (a call argument or output field)
    file: str  # the defining file, relative to site-packages
    lines: tuple[int, int]  # where it is defined there (1-based, inclusive)
    where: str  # what in dhpo-trl uses it


_GRPO = "trl.trainer.grpo_trainer:GRPOTrainer"
_TRAINER = "transformers.trainer:Trainer"
_FUSED = "trl.trainer.utils:FusedCausalLMOutput"
_FLASH = "transformers.modeling_flash_attention_utils:_flash_attention_forward"

PRIVATE: tuple[Private, ...] = (
    Private(_GRPO, "_prepare_inputs", "overrides", TRL_FILE, (1522, 1551), "DHPOTrainer._prepare_inputs"),
    Private(_GRPO, "_get_per_token_logps_and_entropies", "overrides", TRL_FILE, (1419, 1508),
            "DHPOTrainer._get_per_token_logps_and_entropies (TRL's forward handed to the update path)"),
    Private(_GRPO, "_compute_loss", "overrides", TRL_FILE, (3020, 3293), "DHPOTrainer._compute_loss"),
    Private(_GRPO, "_save_checkpoint", "overrides", TRL_FILE, (3384, 3395),
            "DHPOTrainer._save_checkpoint (TRL's writes the adaptive entropy state)"),
    Private(_GRPO, "_step", "reads", TRL_FILE, (948, 948), "DHPOTrainer._prepare_inputs; resume.TRAINER_ATTRIBUTES"),
    Private(_GRPO, "_buffered_inputs", "writes", TRL_FILE, (951, 951),
            "DHPOTrainer._prepare_inputs (the planned micro-batches); resume.TRAINER_ATTRIBUTES"),
    Private(_GRPO, "_metrics", "writes", TRL_FILE, (1080, 1080), "DHPOTrainer metrics; resume"),
    Private(_GRPO, "_entropy_bonus_enabled", "reads", TRL_FILE, (850, 850), "DHPOTrainer._compute_loss"),
    Private(_GRPO, "_last_world_entropy", "writes", TRL_FILE, (853, 853),
            "DHPOTrainer._update_entropy_coefficient (core/entropy_control.State); resume"),
    Private(_GRPO, "_entropy_window_stats", "writes", TRL_FILE, (857, 857),
            "DHPOTrainer._update_entropy_coefficient (core/entropy_control.State); resume"),
    Private(_GRPO, "_pending_metrics", "writes", TRL_FILE, (1098, 1098), "resume.start_fresh (cleared: a new run's)"),
    Private(_GRPO, "_last_loaded_step", "writes", TRL_FILE, (1140, 1140), "resume.start_fresh (-1: a new run's)"),
    Private(_GRPO, "_tag_names", "overrides", TRL_FILE, (287, 287), "DHPOTrainer._tag_names (model card tags)"),
    Private(_GRPO, "_name", "overrides", TRL_FILE, (288, 288), "DHPOTrainer._name (model card)"),
    Private(_GRPO, "_paper", "overrides", TRL_FILE, (289, 289), "DHPOTrainer._paper (model card citation)"),
    Private("trl.trainer.grpo_trainer", "prepare_deepspeed", "overrides", TRL_FILE, (73, 73),
            "moe.zero3_leaf_modules_for_trl_prepared_models (replaced while GRPOTrainer.__init__ runs)"),
    Private(_TRAINER, "_save_checkpoint", "overrides", "transformers/trainer.py", (3215, 3282),
            "DHPOTrainer._save_checkpoint (super() chain)"),
    Private(_TRAINER, "_get_output_dir", "reads", "transformers/trainer.py", (3196, 3213),
            "DHPOTrainer.train / _save_checkpoint"),
    Private(_TRAINER, "current_gradient_accumulation_steps", "reads", "transformers/trainer.py", (1813, 1813),
            "DHPOTrainer._window (TRL's slices of an epoch's last, shorter window)"),
    Private(_TRAINER, "_load_from_checkpoint", "overrides", "transformers/trainer.py", (3462, 3589),
            "DHPOTrainer._load_from_checkpoint (resume.load_policy_weights: the weights in the model's layout)"),
    Private(_TRAINER, "_load_best_model", "overrides", "transformers/trainer.py", (3591, 3695),
            "DHPOTrainer._load_best_model (resume.load_policy_weights)"),
    Private(_TRAINER, "_issue_warnings_after_load", "reads", "transformers/trainer.py", (3912, 3926),
            "resume.load_policy_weights (transformers' warnings about missing and unexpected keys)"),
    Private("transformers.integrations.deepspeed", "_apply_weight_conversions_to_state_dict", "reads",
            "transformers/integrations/deepspeed.py", (328, 436),
            "resume.load_policy_weights (a checkpoint's state dict converted to the model's layout: MoE experts)"),
    Private("transformers.core_model_loading:convert_and_load_state_dict_in_model", "_weight_conversions", "reads",
            "transformers/core_model_loading.py", (1798, 1798),
            "resume.weight_conversions (the conversions `from_pretrained` used, which `save_pretrained` reverses)"),
    Private("transformers.configuration_utils:PretrainedConfig", "_attn_implementation", "writes",
            "transformers/configuration_utils.py", (332, 332),
            "packing.packed_attention (switches the model to the dispatching attention), attention_implementation"),
    Private("transformers.configuration_utils:PretrainedConfig", "_name_or_path", "reads",
            "transformers/configuration_utils.py", (327, 327), "DHPOTrainer.__init__ (default output_dir)"),
    Private("transformers.modeling_utils:PreTrainedModel", "_supports_attention_backend", "reads",
            "transformers/modeling_utils.py", (1148, 1148), "packing.unsupported_model_reason"),
    Private("trl.trainer.utils:add_fused_lm_head", "fused_lm_head", "passes", "trl/trainer/utils.py", (1600, 1600),
            "packing.forward_packed (model(..., fused_lm_head=True, shift_labels=...))"),
    Private("trl.trainer.utils:add_fused_lm_head", "shift_labels", "passes", "trl/trainer/utils.py", (1600, 1600),
            "packing.forward_packed (the scored tokens of a packed row)"),
    Private(_FUSED, "log_probs", "reads", "trl/trainer/utils.py", (1539, 1539), "packing.forward_packed"),
    Private(_FUSED, "entropy", "reads", "trl/trainer/utils.py", (1540, 1540), "packing.forward_packed"),
    Private(_FUSED, "aux_loss", "reads", "trl/trainer/utils.py", (1545, 1545), "packing.forward_packed"),
    Private(_FLASH, "cu_seq_lens_q", "passes", "transformers/modeling_flash_attention_utils.py", (708, 708),
            "packing.forward_packed (the varlen flash path's sequence bounds; the dispatching attention reads it)"),
    Private(_FLASH, "max_length_q", "passes", "transformers/modeling_flash_attention_utils.py", (710, 710),
            "packing.forward_packed"),
    Private("deepspeed.accelerator.cpu_accelerator:CPU_Accelerator", "_name", "reads",
            "deepspeed/accelerator/cpu_accelerator.py", (28, 28), "demo.tiny.use_deepspeed_on_cpu"),
    # resume.write_checkpoint repeats transformers' Trainer._save_checkpoint (3215-3282) step by step, with
    # save_only_model decided per checkpoint and the rotation after our completeness marker.
    Private(_TRAINER, "_save_optimizer_and_scheduler", "reads", "transformers/trainer.py", (3373, 3437),
            "resume.write_checkpoint"),
    Private(_TRAINER, "_save_scaler", "reads", "transformers/trainer.py", (3439, 3458), "resume.write_checkpoint"),
    Private(_TRAINER, "_save_rng_state", "reads", "transformers/trainer.py", (3322, 3371), "resume.write_checkpoint"),
    Private(_TRAINER, "_push_from_checkpoint", "reads", "transformers/trainer.py", (4259, 4326),
            "resume.write_checkpoint"),
    Private(_TRAINER, "_get_grad_norm", "overrides", "transformers/trainer.py", (2672, 2684),
            "DHPOTrainer._get_grad_norm (nonfinite.StepCheck: a NaN/inf norm stops the run before optimizer.step())"),
    Private(_TRAINER, "_run_epoch", "overrides", "transformers/trainer.py", (1755, 1924),
            "DHPOTrainer._run_epoch (the sampler told its epoch)"),
    # transformers' loss accumulators, reset by _inner_training_loop after the restore: put back when training begins
    *(Private(_TRAINER, name, "writes", "transformers/trainer.py", (1589, 1591),
              "resume.LOSS_ACCUMULATORS, resume.RestoreAtTrainBegin")
      for name in ("_tr_loss", "_total_loss_scalar", "_globalstep_last_logged")),
    Private(_GRPO, "_get_train_sampler", "overrides", TRL_FILE, (1280, 1316),
            "DHPOTrainer._get_train_sampler (the epoch-following RepeatSampler)"),
    Private("trl.generation.vllm_client:VLLMClient", "_post", "overrides", "trl/generation/vllm_client.py", (261, 265),
            "rollout_routing.RolloutRouting.install: wrapped on the instance to keep vLLM's routing of each reply"),
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


def tail_corrections(trainer, inputs: dict, per_token_loss, per_token_logps, old_per_token_logps, advantages, mask,
                     entropies, kl_weight):  # fmt: skip
    """TRL's off-policy mask, top-entropy mask, vLLM importance-sampling ratio and KL term on `per_token_loss`, in
    TRL's order, from the trainer's TRL settings. Returns (per-token loss, top-entropy mask or None, KL or None)."""
    off_policy_mask = entropy_mask = kl = None
    if trainer.off_policy_mask_threshold is not None:
        off_policy_mask = trainer.get_off_policy_mask(
            advantages=advantages, per_token_logps=per_token_logps,
            sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_per_token_logps),
            mask=mask, off_policy_threshold=trainer.off_policy_mask_threshold,
        )  # fmt: skip
    if trainer.top_entropy_quantile < 1.0:
        entropy_mask = trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
    if trainer.beta != 0.0:
        weight = kl_weight if trainer.args.use_bias_correction_kl else None
        kl = per_token_kl(inputs["ref_per_token_logps"], per_token_logps, mask, weight)
    vllm = trainer.use_vllm and trainer.vllm_importance_sampling_correction
    vllm_ratio = inputs["importance_sampling_ratio"] if vllm else None
    return apply_corrections(per_token_loss, off_policy_mask, entropy_mask, vllm_ratio, trainer.beta, kl), entropy_mask, kl
