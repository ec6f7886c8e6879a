"""`DHPOTrainer`: TRL's `GRPOTrainer` with the policy loss of the chosen objective (DHPO or a paper baseline).

Generation (vLLM included), rewards, advantages, distributed training and checkpointing are inherited. `_compute_loss`
is ours for every row: it takes the objective's pure per-token loss from `dhpo_trl.objectives`, applies TRL's masks
and corrections in TRL's order and aggregates by `loss_type`, so all seven rows share one code path. The model card
and the `dhpo/` / `gmpo/` metrics are ours too; TRL's metric keys keep their meaning.
"""

from __future__ import annotations

import math
import os
import shutil
import textwrap
import warnings

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from trl import GRPOTrainer

from . import batching, packing
from .config import DHPOConfig
from .moe import maybe_set_zero3_leaf_modules, zero3_leaf_modules_for_trl_prepared_models
from .losses import masked_log_ratio
from .objectives import get_objective
from .reward_checks import check_reward_functions
from .vllm_utils import check_vllm_setup

CITATION = textwrap.dedent("""\
    @inproceedings{min-etal-2026-orchestrating,
        title     = {Orchestrating Tokens and Sequences: Dynamic Hybrid Policy Optimization for {RLVR}},
        author    = {Min, Zijun and Liu, Bingshuai and Wang, Ante and Zhang, Long and Zeng, Anxiang and Zhang, Haibo and Su, Jinsong},
        booktitle = {Findings of the Association for Computational Linguistics: ACL 2026},
        year      = {2026},
    }""")

# Settings recorded in the model card of every checkpoint, after `algorithm` and the objective's own settings.
CARD_FIELDS = (
    "loss_type", "beta", "num_generations", "steps_per_generation", "gradient_accumulation_steps", "num_iterations",
    "learning_rate", "temperature", "max_completion_length",
)  # fmt: skip


class DHPOTrainer(GRPOTrainer):
    """GRPOTrainer whose policy loss is DHPO (Min et al., 2026) or one of the paper's baselines.

    Takes the same arguments as `trl.GRPOTrainer`; `args` must be a [`DHPOConfig`] (a plain `GRPOConfig` is
    rejected so that no DHPO default is silently missing). `args.algorithm` selects the objective.
    """

    _tag_names = ["trl", "dhpo"]
    _name = "DHPO"
    _paper = {
        "title": "Orchestrating Tokens and Sequences: Dynamic Hybrid Policy Optimization for RLVR",
        "id": None,
        "citation": CITATION,
    }

    def __init__(self, model, reward_funcs=None, args: DHPOConfig | None = None, *pos, **kwargs):
        model_name = model if isinstance(model, str) else model.config._name_or_path
        if args is None:
            args = DHPOConfig(f"{str(model_name).rstrip('/').split('/')[-1]}-DHPO")
        if not isinstance(args, DHPOConfig):
            raise TypeError(
                f"DHPOTrainer needs `args` to be a DHPOConfig, got {type(args).__name__}. Build one with "
                "DHPOConfig(**your_grpo_config.to_dict()) or use trl.GRPOTrainer."
            )
        args.validate()  # the config may have been changed since it was built: refuse what would not act
        # vllm missing or server unreachable: fail now, before any model is loaded.
        check_vllm_setup(args, model_name, is_main_process=args.process_index == 0)
        reward_funcs = check_reward_functions(reward_funcs)  # garbage rewards: a named error on the first batch
        with zero3_leaf_modules_for_trl_prepared_models():  # the reference model is wrapped inside __init__
            super().__init__(model, reward_funcs, args, *pos, **kwargs)
        # ZeRO-3 + MoE: mark the MoE blocks as leaves (logged). DeepSpeed wraps the policy later, in train().
        self.zero3_leaf_modules = maybe_set_zero3_leaf_modules(self.model, self.accelerator)
        self._tag_names = ["trl", "dhpo", args.algorithm]
        self._batching_warned = False
        # ---- padding_free (issue 27; dhpo_trl/packing.py): refuse a model packed rows would give wrong outputs
        self._padding_free = args.padding_free
        for name, checked in (("model", self.model), ("ref_model", self.ref_model)) if args.padding_free else ():
            reason = checked is not None and packing.unsupported_model_reason(checked)
            if reason:
                raise ValueError(f"DHPOConfig.padding_free=True cannot run on this {name}: {reason}. Set "
                                 "padding_free=False (dynamic batching) or change the model.")  # fmt: skip
        # ---- end padding_free

    # --------------------------------------------------------------- batching
    def _prepare_inputs(self, generation_batch):
        """TRL's buffered micro-batches, re-cut by length within each accumulation window (`dynamic_batching`)."""
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        regenerate = self._step % generate_every == 0 or self._buffered_inputs is None  # as TRL decides
        inputs = super()._prepare_inputs(generation_batch)
        if regenerate:  # a fresh generation batch: plan its micro-batches once, for all its iterations
            self._buffered_inputs = self._plan_micro_batches(self._buffered_inputs)
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    def _plan_micro_batches(self, buffered: list) -> list:
        """Cut every accumulation window of the buffered generation batch into length-sorted micro-batches."""
        reason = batching.unsupported_reason(buffered[0]) if self.args.dynamic_batching else "off"
        if reason is not None:
            if reason != "off" and not self._batching_warned:
                which = "padding_free and dynamic_batching keep" if self._padding_free else "dynamic_batching keeps"
                warnings.warn(f"{which} TRL's micro-batches for this run: {reason}.", stacklevel=2)
                self._batching_warned = True
            self._log_padding(buffered)
            return buffered
        steps = self.args.gradient_accumulation_steps
        windows = [batching.concat(buffered[i : i + steps]) for i in range(0, len(buffered), steps)]
        if self._padding_free:  # ---- padding_free (issue 27): rows of whole sequences, see dhpo_trl/packing.py
            lengths = [packing.token_counts(window["prompt_mask"], window["completion_mask"]) for window in windows]
            budget = self.args.max_tokens_per_micro_batch
            plans = packing.plan_windows(lengths, steps, budget, self._max_over_processes)
            planned = [micro for window, plan in zip(windows, plans, strict=True)
                       for micro in packing.split_window(window, plan)]  # fmt: skip
            parts = [part for micro in planned for part in (micro if isinstance(micro, list) else [micro])]
            self._log_padding(parts, counter=packing.packed_fraction)
            return planned
        plans = [batching.plan_for(window, self.pad_to_multiple_of) for window in windows]
        passes = [1] * len(windows)
        if self.args.max_tokens_per_micro_batch is not None:
            needed = [plan.groups_needed(self.args.max_tokens_per_micro_batch) for plan in plans]
            passes = [math.ceil(count / steps) for count in self._max_over_processes(needed)]
        planned = [
            micro
            for window, plan, count in zip(windows, plans, passes, strict=True)
            for micro in batching.split_window(window, steps, count, plan=plan)
        ]
        self._log_padding([part for micro in planned for part in (micro if isinstance(micro, list) else [micro])])
        return planned

    def _max_over_processes(self, values: list[int]) -> list[int]:
        """Element-wise maximum over processes (every process must run the same number of forward passes)."""
        if self.accelerator.num_processes == 1:
            return values
        tensor = torch.tensor(values, device=self.accelerator.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def _log_padding(self, micro_batches: list[dict], counter=batching.padded_fraction) -> None:
        """`batching/padding_fraction`: share of the training forwards' tokens that are padding, all processes."""
        real, forwarded = counter(micro_batches)
        totals = self.accelerator.gather(torch.tensor([[real, forwarded]], device=self.accelerator.device)).sum(0)
        self._metrics["train"]["batching/padding_fraction"].append(1.0 - totals[0].item() / max(totals[1].item(), 1))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not isinstance(inputs, batching.Passes):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # A micro-step split by `max_tokens_per_micro_batch`: backward every pass but the last here, accumulating
        # gradients without synchronising or stepping; the Trainer backpropagates the last one as usual.
        done = torch.zeros((), device=self.accelerator.device)
        for part in inputs[:-1]:
            loss = super().compute_loss(model, part, return_outputs, num_items_in_batch)
            self._backward_without_sync(model, loss)
            done = done + loss.detach()
        return super().compute_loss(model, inputs[-1], return_outputs, num_items_in_batch) + done

    def _backward_without_sync(self, model, loss) -> None:
        kwargs = {"scale_wrt_gas": False} if self.accelerator.distributed_type == DistributedType.DEEPSPEED else {}
        sync = self.accelerator.sync_gradients
        self.accelerator.sync_gradients = False  # DeepSpeed: not the accumulation boundary, so no engine.step()
        try:
            with self.accelerator.no_sync(model):  # DDP / FSDP: gradients all-reduce with the step's last pass
                self.accelerator.backward(loss, **kwargs)
        finally:
            self.accelerator.sync_gradients = sync

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):  # fmt: skip
        """TRL's chunked forward; with `dynamic_batching`, the no-grad passes over the whole generation batch
        (`batch_size` given: old and reference log-probs) run on length-sorted, trimmed chunks instead; with
        `padding_free`, every forward runs on packed rows (`dhpo_trl/packing.py`)."""
        # ---- padding_free (issue 27): a policy pass is one packed row (its micro-batch was planned to fit the
        # budget); the generation-batch passes run TRL's number of rows, or more under the budget, agreed.
        if self._padding_free and all(v is None for v in multimodal.values()):
            lengths = attention_mask.sum(1).clamp(min=1).tolist()
            count = 1
            if batch_size is not None:
                count = math.ceil(input_ids.size(0) / batch_size)
                if self.args.max_tokens_per_micro_batch is not None:
                    needed = packing.rows_needed(lengths, self.args.max_tokens_per_micro_batch)
                    count = self._max_over_processes([max(count, needed)])[0]
            rows = packing.plan_rows(lengths, count, self.args.max_tokens_per_micro_batch if count > 1 else None)
            packed = packing.pack(input_ids, attention_mask, logits_to_keep, rows)
            return packing.forward_packed(model, packed, (input_ids.size(0), logits_to_keep), compute_entropy,
                                          compute_aux_loss, self.accelerator.autocast)  # fmt: skip
        # ---- end padding_free
        if batch_size is None or not self.args.dynamic_batching or any(v is not None for v in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal,
            )  # fmt: skip
        plan = batching.forward_plan(attention_mask, logits_to_keep, self.pad_to_multiple_of)
        count = math.ceil(input_ids.size(0) / batch_size)  # TRL's number of forwards, the same on every process
        if self.args.max_tokens_per_micro_batch is not None:
            count = self._max_over_processes([max(count, plan.groups_needed(self.args.max_tokens_per_micro_batch))])[0]
        prompt_width = input_ids.size(1) - logits_to_keep
        logps = entropies = None
        aux_losses = []
        for start, end in plan.partition(count):
            rows = torch.as_tensor(plan.rows(start, end), device=input_ids.device)
            prompt, completion = plan.widths(start, end)
            columns = slice(prompt_width - prompt, prompt_width + completion)
            chunk_logps, chunk_entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids[rows, columns], attention_mask[rows, columns], completion,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss,
            )  # fmt: skip
            if logps is None:  # padding beyond a row's own length stays 0; every consumer masks it
                logps = chunk_logps.new_zeros(input_ids.size(0), logits_to_keep)
                entropies = chunk_logps.new_zeros(input_ids.size(0), logits_to_keep) if compute_entropy else None
            logps[rows, :completion] = chunk_logps
            if compute_entropy:
                entropies[rows, :completion] = chunk_entropies
            if compute_aux_loss:
                aux_losses.append(aux)
        return logps, entropies, (torch.stack(aux_losses).mean() if compute_aux_loss else None)

    # ------------------------------------------------------------------ loss
    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        multimodal = {
            key: inputs.get(key)
            for key in (
                "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
            )
        }  # fmt: skip
        # Entropies come out of TRL's fused LM head with the log-probs: no (B, T, V) tensor is kept.
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, completion_mask], dim=1),
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **multimodal,
        )
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        # TRL skips old log-probs when the batch is exactly on-policy; then pi_old = sg[pi_theta].
        old_per_token_logps = inputs.get("old_per_token_logps")
        if old_per_token_logps is None:
            old_per_token_logps = per_token_logps.detach()

        objective = get_objective(self.args.algorithm)
        # Only DHPO-E reads it (the config refuses "global" elsewhere); the same branch on every process.
        global_scope = self.args.entropy_norm_scope == "global"
        entropy_range = self._global_entropy_range(entropies, mask) if global_scope else None
        per_token_loss, kl_weight, info = objective.compute(
            per_token_logps, old_per_token_logps, advantages, mask, entropies, self.args, entropy_range
        )
        # How far pi_theta has drifted from pi_old on the trained tokens, for every objective (staleness).
        info = {**info, "abs_log_ratio": masked_log_ratio(per_token_logps.detach(), old_per_token_logps, mask).abs()}

        # The masks and corrections below are TRL's, applied to the objective's per-token loss in TRL's order.
        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_per_token_logps),
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            per_token_loss = per_token_loss * entropy_mask
        # vLLM sampled from pi_sampler, not pi_old: TRL's (detached) pi_old / pi_sampler correction multiplies
        # the loss, while the objective's ratios correct pi_theta against pi_old.
        if self.use_vllm and self.vllm_importance_sampling_correction:
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
        per_token_kl = None
        if self.beta != 0.0:
            # Masked before exp(): padding holds no reference log-prob (dynamic batching leaves it 0).
            log_ratio = torch.where(mask.bool(), inputs["ref_per_token_logps"] - per_token_logps, 0.0)
            per_token_kl = torch.exp(log_ratio) - log_ratio - 1
            if self.args.use_bias_correction_kl:  # scaled by the objective's ratio, with TRL's gradient
                per_token_kl = per_token_kl * kl_weight
            per_token_loss = per_token_loss + self.beta * per_token_kl

        loss = self._aggregate(per_token_loss, mask, inputs, mode)
        policy_loss = loss.detach() * self._micro_batches_per_window(inputs, mode, scaled=self._scales_by_accumulation(mode))
        if self._entropy_bonus_enabled:
            loss = self._add_entropy_bonus(loss, entropies, mask, entropy_mask, policy_loss, mode, inputs)
        if self.aux_loss_enabled:  # mean over the window's forward passes
            loss = loss + self.router_aux_loss_coef * aux_loss / self._micro_batches_per_window(inputs, mode)
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        self._log_loss_metrics(mode, info, entropies, mask, per_token_kl)
        self._log_trl_clip_metrics(mode, info, mask)
        return loss

    def _scales_by_accumulation(self, mode: str) -> bool:
        return mode == "train" and self.loss_type in ("grpo", "bnpo", "dr_grpo")

    def _micro_batches_per_window(self, inputs, mode, scaled=True) -> float:
        """How many micro-batches (forward passes) share the window: TRL divides each one's loss by this."""
        if batching.WINDOW_PASSES in inputs:
            return inputs[batching.WINDOW_PASSES].item()
        return self.current_gradient_accumulation_steps if mode == "train" and scaled else 1.0

    def _aggregate(self, per_token_loss, mask, inputs, mode):
        """TRL's aggregation for `loss_type`, with its gradient-accumulation normalisation.

        Under dynamic batching a micro-batch's rows and tokens vary, so "grpo" and "dr_grpo" divide by the rows of
        the whole accumulation window instead of (rows of this micro-batch x accumulation steps): the same window
        gradient as TRL's equal slices. "dapo" already normalises by the window's tokens.
        """
        mask = mask.to(per_token_loss.dtype)
        window_rows = inputs.get(batching.WINDOW_SEQUENCES)
        rows = per_token_loss.size(0) if window_rows is None else window_rows
        if self.loss_type == "grpo":  # eq. 7: mean over responses of the per-response token mean
            loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / rows
        elif self.loss_type == "bnpo":
            loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        elif self.loss_type == "dr_grpo":
            loss = (per_token_loss * mask).sum() / (rows * self.max_completion_length)
        elif self.loss_type == "dapo":  # normalise by the active tokens of the accumulation window on all processes
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            return (per_token_loss * mask).sum() / normalizer
        else:
            raise ValueError(f"loss_type={self.loss_type!r} is not an aggregation: use grpo, bnpo, dr_grpo or dapo.")
        if self._scales_by_accumulation(mode) and window_rows is None:
            loss = loss / self.current_gradient_accumulation_steps
        return loss

    def _add_entropy_bonus(self, loss, entropies, mask, entropy_mask, policy_loss, mode, inputs):
        """TRL's entropy bonus (static or adaptive coefficient); under dynamic batching, the mean entropy over the
        accumulation window's tokens (TRL's per-micro-batch mean would change with the grouping)."""
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        if batching.WINDOW_TOKENS in inputs:
            entropy_loss = (entropies * effective_mask).sum() / inputs[batching.WINDOW_TOKENS].clamp(min=1.0)
        else:
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
        if self.use_adaptive_entropy:
            coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        else:
            coef = self.entropy_coef
        loss = loss - coef * entropy_loss
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
            if self.accelerator.sync_gradients:
                window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
                step = self.args.entropy_coef_delta
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + step, self.args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - step, self.args.entropy_coef_min)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return loss

    def _global_entropy_range(self, entropies, mask):
        """Min and max entropy over the valid tokens of every process (one all-reduce)."""
        valid = mask.bool()
        entropies = entropies.detach().float()
        if valid.any():
            local = torch.stack([-entropies[valid].min(), entropies[valid].max()])
        else:  # an all-padding micro-batch must not drag the global range
            local = torch.full((2,), float("-inf"), device=entropies.device)
        if dist.is_available() and dist.is_initialized() and self.accelerator.num_processes > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        if not torch.isfinite(local).all():  # no valid token anywhere
            return (0.0, 0.0)
        return (-local[0], local[1])

    # --------------------------------------------------------------- metrics
    def _log_loss_metrics(self, mode, info, entropies, mask, per_token_kl):
        """TRL's `entropy` and `kl`, and the objective's `<prefix>/` metrics, reduced over all processes."""
        objective = get_objective(self.args.algorithm)
        valid = mask.bool()
        fmask = valid.float()
        seq_valid = valid.any(-1)
        prefix = objective.metric_prefix
        sums = {  # each entry is summed over processes
            "tokens": fmask.sum(),
            "sequences": seq_valid.float().sum(),
            "entropy": (entropies.detach().float() * fmask).sum(),
            "abs_log_ratio": (info["abs_log_ratio"].float() * fmask).sum(),
        }
        if per_token_kl is not None:
            sums["kl"] = (per_token_kl.detach().float() * fmask).sum()
        extremes = torch.zeros(0, device=fmask.device)
        fractions = []
        if prefix is not None:
            token_ratio, sequence_ratio = info["token_ratio"].float(), info["sequence_ratio"].float()
            sums["token_ratio"] = (token_ratio * fmask).sum()
            sums["sequence_ratio"] = (sequence_ratio * seq_valid).sum()
            if "mixing_weight" in info:
                weight = info["mixing_weight"].float()
                sums["mixing_weight"] = (weight * fmask).sum()
                sums["mixing_weight_sq"] = (weight.square() * fmask).sum()
            fractions = [(name, key) for name, key in objective.fractions if key in info]
            for _, key in fractions:
                sums[key] = (info[key].float() * fmask).sum()
            big = torch.tensor(float("inf"), device=fmask.device)
            extremes = torch.stack([  # reduced with max; minima are negated
                -torch.where(valid, token_ratio, big).min(),
                torch.where(valid, token_ratio, -big).max(),
                -torch.where(seq_valid, sequence_ratio, big).min(),
                torch.where(seq_valid, sequence_ratio, -big).max(),
            ])  # fmt: skip
        keys = list(sums)
        local = torch.cat([torch.stack([sums[k].float() for k in keys]), extremes])
        gathered = self.accelerator.gather(local.unsqueeze(0)).reshape(-1, local.numel())
        totals = dict(zip(keys, gathered[:, : len(keys)].sum(0).tolist(), strict=True))
        # No valid token on any process (e.g. every completion masked): NaN, which TRL's `log` skips, instead of
        # 0 means and +-inf extremes that would corrupt the step's averages.
        tokens = totals["tokens"] if totals["tokens"] > 0 else math.nan
        sequences = totals["sequences"] if totals["sequences"] > 0 else math.nan
        metrics = self._metrics[mode]
        metrics["entropy"].append(totals["entropy"] / tokens)
        metrics["off_policy/abs_log_ratio"].append(totals["abs_log_ratio"] / tokens)
        if per_token_kl is not None:
            metrics["kl"].append(totals["kl"] / tokens)
        if prefix is None:
            return
        ext = [v if math.isfinite(v) else math.nan for v in gathered[:, len(keys) :].max(0).values.tolist()]
        metrics[f"{prefix}/token_ratio/mean"].append(totals["token_ratio"] / tokens)
        metrics[f"{prefix}/token_ratio/min"].append(-ext[0])
        metrics[f"{prefix}/token_ratio/max"].append(ext[1])
        metrics[f"{prefix}/sequence_ratio/mean"].append(totals["sequence_ratio"] / sequences)
        metrics[f"{prefix}/sequence_ratio/min"].append(-ext[2])
        metrics[f"{prefix}/sequence_ratio/max"].append(ext[3])
        if "mixing_weight" in info:
            mean_w = totals["mixing_weight"] / tokens
            metrics[f"{prefix}/mixing_weight/mean"].append(mean_w)
            variance = max(totals["mixing_weight_sq"] / tokens - mean_w**2, 0.0)
            metrics[f"{prefix}/mixing_weight/std"].append(variance**0.5)
        for name, key in fractions:
            metrics[f"{prefix}/{name}"].append(totals[key] / tokens)

    def _log_trl_clip_metrics(self, mode, info, mask):
        """TRL's clip metrics, computed as TRL computes them, from the objective's clip indicators.

        `clip_ratio/*` (clip-surrogate rows): the share of tokens (sequences for GSPO's (B, 1) indicators) where the
        clip binds below for A < 0 (`low_mean`), above for A > 0 (`high_mean`) or either (`region_mean`), and the
        lowest / highest per-sequence share over all processes (`low_min`, `high_max`). `cispo_clip_ratio`: the share
        of A > 0 tokens whose weight is capped.
        """
        mask = mask.float()

        def global_masked_mean(x):
            x = x.float()
            if x.shape[1] == 1:  # one value per sequence
                local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
            else:
                local = torch.stack([(x * mask).sum(), mask.sum()])
            totals = self.accelerator.reduce(local, reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def masked_seq_mean(x):
            x = x.float()
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        metrics = self._metrics[mode]
        if get_objective(self.args.algorithm).clip_metrics == "cispo_clip_ratio":
            metrics["cispo_clip_ratio"].append(global_masked_mean(info["clipped_high"]))
            return
        low, high = info["clipped_low"], info["clipped_high"]
        metrics["clip_ratio/low_mean"].append(global_masked_mean(low))
        metrics["clip_ratio/high_mean"].append(global_masked_mean(high))
        metrics["clip_ratio/region_mean"].append(global_masked_mean(low | high))
        # TRL gathers the per-sequence shares, which needs the same number of rows on every process; dynamic
        # batching gives processes micro-batches of different sizes, so reduce each process's extreme instead.
        def nan_max(x):  # -inf when every sequence is empty (NaN share)
            x = x[~torch.isnan(x)]
            return x.max() if x.numel() else torch.tensor(-math.inf, device=mask.device)

        extremes = torch.stack([nan_max(-masked_seq_mean(low)), nan_max(masked_seq_mean(high))])
        if self.accelerator.num_processes > 1:
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        low_min, high_max = (-extremes[0]).item(), extremes[1].item()
        metrics["clip_ratio/low_min"].append(low_min if math.isfinite(low_min) else math.nan)
        metrics["clip_ratio/high_max"].append(high_max if math.isfinite(high_max) else math.nan)

    # ------------------------------------------------------------ model card
    def _save_checkpoint(self, model, trial):
        # TRL writes the card to output_dir only; copy it so every checkpoint (and every Hub push of one) carries it.
        super()._save_checkpoint(model, trial)
        card = os.path.join(self.args.output_dir, "README.md")
        checkpoint = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        if self.args.should_save and os.path.isfile(card) and os.path.isdir(checkpoint):
            shutil.copyfile(card, os.path.join(checkpoint, "README.md"))

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card, naming DHPO, citing the paper and recording the objective's settings."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        path = os.path.join(self.args.output_dir, "README.md")
        names = ("algorithm", *get_objective(self.args.algorithm).settings(self.args), *CARD_FIELDS)
        rows = "\n".join(f"| `{name}` | `{getattr(self.args, name)}` |" for name in names)
        section = (
            "\n\n## DHPO settings\n\n"
            f"Trained with `dhpo_trl.DHPOTrainer` (Dynamic Hybrid Policy Optimization), objective "
            f"`algorithm={self.args.algorithm}` (the DHPO citation is above).\n\n"
            f"| setting | value |\n|---|---|\n{rows}\n"
        )
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(section)
