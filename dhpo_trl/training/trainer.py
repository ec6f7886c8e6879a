"""`DHPOTrainer`: TRL's `GRPOTrainer` with the policy loss of the chosen objective (DHPO or a paper baseline).

Generation (vLLM included), rewards, advantages, distributed training and checkpointing are inherited. `_compute_loss`
is ours for every row: it takes the objective's pure per-token loss from `dhpo_trl.core.objectives`, applies TRL's masks
and corrections in TRL's order and aggregates by `loss_type`, so all seven rows share one code path. The model card
and the `dhpo/` / `gmpo/` metrics are ours too; TRL's metric keys keep their meaning.
"""

from __future__ import annotations

import os
import shutil
import textwrap
import warnings

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from transformers.trainer_utils import rotate_checkpoints
from trl import GRPOConfig, GRPOTrainer

from ..core import aggregation, metrics
from ..core.config import DHPOConfig, from_grpo_config
from ..core.losses import masked_log_ratio
from ..core.objectives import get_objective
from .moe import maybe_set_zero3_leaf_modules, zero3_leaf_modules_for_trl_prepared_models
from .vllm_utils import check_vllm_setup
from . import batching, resume, shared_prompts, trl_mirror, update_path
from .reward_checks import check_reward_functions

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

    Takes the same arguments as `trl.GRPOTrainer`; `args` is a [`DHPOConfig`], whose `algorithm` selects the
    objective, or a plain `GRPOConfig`, converted (`from_grpo_config`) to run the objective TRL would run with it.
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
        if isinstance(args, GRPOConfig) and not isinstance(args, DHPOConfig):
            args, ignored = from_grpo_config(args)
            if args.process_index == 0:
                unread = f"; not read by it, as in TRL: {ignored}" if ignored else ""
                print(f"DHPOTrainer: a GRPOConfig runs TRL's objective (algorithm={args.algorithm!r}, loss_type="
                      f"{args.loss_type!r}{unread}); for DHPO pass a DHPOConfig (algorithm='dhpo', its default).")
        if not isinstance(args, DHPOConfig):
            raise TypeError(
                f"DHPOTrainer needs `args` to be a DHPOConfig or a trl.GRPOConfig, got {type(args).__name__}."
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
        self.graceful_stop = None  # set by train(): how a stop signal ended the run (see resume.py)
        # padded, dynamic, packed or shared-prompt forwards: decided once (dhpo_trl/training/update_path.py)
        path = update_path.choose(args.padding_free, args.share_prompts, args.dynamic_batching,
                                  {"model": self.model, "ref_model": self.ref_model}, self.accelerator.device.type)
        if path.note and self.accelerator.is_main_process:
            print(path.note)
        self._padding_free, self._packed, self._plan_packed = path.padding_free, path.forward, path.plan

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
        steps, budget, counter = self.args.gradient_accumulation_steps, self.args.max_tokens_per_micro_batch, None
        if reason is None:
            share = steps / self.args.steps_per_generation
            window_of = batching.planned_windows(self.accelerator.num_processes, share)
            if self._padding_free:  # rows of whole sequences, each row one packed forward (dhpo_trl/training/packing.py)
                buffered = self._plan_packed(buffered, steps, budget, self._max_over_processes, window_of)
                counter = batching.packed_fraction
            else:
                buffered = batching.plan_generation_batch(
                    buffered, steps, budget, self.pad_to_multiple_of, self._max_over_processes, window_of
                )
        elif reason != "off" and not self._batching_warned:
            which = "padding_free and dynamic_batching keep" if self._padding_free else "dynamic_batching keeps"
            warnings.warn(f"{which} TRL's micro-batches for this run: {reason}.", stacklevel=2)
            self._batching_warned = True
        counter = counter or batching.padded_fraction
        passes = batching.forward_passes(buffered)
        sums = metrics.padding_sums(*counter(passes))
        share = self._padding_free and self.args.share_prompts  # share_prompts needs padding_free (validated)
        if share:  # in the same all-reduce on every process (the setting is the same on all)
            sums.update(shared_prompts.prompt_sums(passes if reason is None else []))
        sums, _ = self._reduce(sums, {})
        self._metrics["train"]["batching/padding_fraction"].append(metrics.padding_fraction(sums))
        if share:
            self._metrics["train"]["batching/prompt_tokens_saved"].append(shared_prompts.saved_fraction(sums))
        return buffered

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """The one cross-process reduction ("sum" or "max") every metric and agreement goes through."""
        if self.accelerator.num_processes == 1 or not (dist.is_available() and dist.is_initialized()):
            return tensor
        tensor = tensor.to(self.accelerator.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor

    def _reduce(self, sums: dict, maxima: dict) -> tuple[dict, dict]:
        return metrics.reduce_across(sums, maxima, self._all_reduce)

    def _max_over_processes(self, values: list[int]) -> list[int]:
        """Element-wise maximum over processes (every process must run the same number of forward passes)."""
        _, maxima = self._reduce({}, {str(index): value for index, value in enumerate(values)})
        return [int(value) for value in maxima.values()]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not isinstance(inputs, batching.Passes):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # A micro-step split by `max_tokens_per_micro_batch`: every pass but the last runs forward and backward here,
        # accumulating gradients without synchronising or stepping; the Trainer backpropagates the last one as usual.
        done = torch.zeros((), device=self.accelerator.device)
        for part in inputs[:-1]:
            done = done + self._pass_before_the_boundary(model, part, return_outputs, num_items_in_batch).detach()
        return super().compute_loss(model, inputs[-1], return_outputs, num_items_in_batch) + done

    def _pass_before_the_boundary(self, model, part, return_outputs, num_items_in_batch):
        """One pass that is not the optimizer step's last: `sync_gradients` is False for its forward too, so what
        runs once per optimizer step (the adaptive entropy update, the `entropy_coef` log) waits for the last pass;
        DDP / FSDP need the forward inside `no_sync` as well; DeepSpeed must not rescale by accumulation (the loss is
        already normalised) nor step the engine (not the accumulation boundary)."""
        kwargs = {"scale_wrt_gas": False} if self.accelerator.distributed_type == DistributedType.DEEPSPEED else {}
        sync = self.accelerator.sync_gradients
        self.accelerator.sync_gradients = False
        try:
            with self.accelerator.no_sync(model):
                loss = super().compute_loss(model, part, return_outputs, num_items_in_batch)
                self.accelerator.backward(loss, **kwargs)
        finally:
            self.accelerator.sync_gradients = sync
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):  # fmt: skip
        """TRL's chunked forward; with `dynamic_batching`, the no-grad passes over the whole generation batch
        (`batch_size` given: old and reference log-probs) run on length-sorted, trimmed chunks instead; with
        `padding_free`, every forward runs on packed rows (`dhpo_trl/training/packing.py`)."""
        parent = super()._get_per_token_logps_and_entropies
        if self._padding_free and all(v is None for v in multimodal.values()):
            return self._packed.packed_forward(
                model, input_ids, attention_mask, logits_to_keep, batch_size, self.args.max_tokens_per_micro_batch,
                self._max_over_processes, compute_entropy, compute_aux_loss, self.accelerator.autocast,
            )  # fmt: skip
        if batch_size is None or not self.args.dynamic_batching or any(v is not None for v in multimodal.values()):
            return parent(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                          compute_aux_loss, **multimodal)  # fmt: skip

        def forward(ids, mask, keep, entropy, aux):
            return parent(model, ids, mask, keep, compute_entropy=entropy, compute_aux_loss=aux)

        return batching.chunked_forward(
            forward, input_ids, attention_mask, logits_to_keep, batch_size, self.args.max_tokens_per_micro_batch,
            self.pad_to_multiple_of, self._max_over_processes, compute_entropy, compute_aux_loss,
        )  # fmt: skip

    # ------------------------------------------------------------------ loss
    def _window(self, inputs, mode) -> aggregation.Window:
        """The micro-batch's window: attached by the dynamic plan, else TRL's fixed slices. Those are built here, at
        the micro-step, because TRL's accumulation count (`current_gradient_accumulation_steps`) is only known then
        (the Trainer shortens an epoch's last window)."""
        if batching.WINDOW in inputs:
            return inputs[batching.WINDOW]
        train = mode == "train"
        # The Trainer sets it when training starts; a loss computed in train mode before that takes the config's.
        accumulation = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        steps = accumulation if train else 1
        items = inputs.get("num_items_in_batch")
        share = steps / self.args.steps_per_generation if train else 1.0
        dapo = None if items is None else aggregation.dapo_tokens(items, self.accelerator.num_processes, share)
        return aggregation.fixed_slice_window(inputs["completion_mask"].size(0), steps, dapo)

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = batching.loss_mask(inputs)
        multimodal = {key: inputs.get(key) for key in batching.UNSUPPORTED_KEYS}
        # Entropies come out of TRL's fused LM head with the log-probs: no (B, T, V) tensor is kept.
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], dim=1), torch.cat([prompt_mask, completion_mask], dim=1),
            completion_ids.size(1), compute_entropy=True, compute_aux_loss=self.aux_loss_enabled, **multimodal,
        )  # fmt: skip
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

        off_policy_mask = entropy_mask = kl = None
        if self.off_policy_mask_threshold is not None:
            off_policy_mask = self.get_off_policy_mask(
                advantages=advantages, per_token_logps=per_token_logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_per_token_logps),
                mask=mask, off_policy_threshold=self.off_policy_mask_threshold,
            )  # fmt: skip
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        if self.beta != 0.0:
            weight = kl_weight if self.args.use_bias_correction_kl else None
            kl = trl_mirror.per_token_kl(inputs["ref_per_token_logps"], per_token_logps, mask, weight)
        vllm = self.use_vllm and self.vllm_importance_sampling_correction
        vllm_ratio = inputs["importance_sampling_ratio"] if vllm else None
        per_token_loss = trl_mirror.apply_corrections(
            per_token_loss, off_policy_mask, entropy_mask, vllm_ratio, self.beta, kl
        )

        window = self._window(inputs, mode)
        loss = aggregation.aggregate(self.loss_type, per_token_loss, mask, window, self.max_completion_length)
        sums, maxima = {}, {}
        if self._entropy_bonus_enabled:  # TRL logs the policy loss only then, before the bonus
            policy_loss = aggregation.reported_policy_loss(self.loss_type, loss, window)
            sums.update(metrics.nan_mean_sums("policy_loss", policy_loss))
            bonus = aggregation.entropy_bonus(entropies, mask, entropy_mask, window)
            loss = loss - self._entropy_coefficient() * bonus
        if self.aux_loss_enabled:  # mean over the window's forward passes
            loss = loss + self.router_aux_loss_coef * aux_loss / window.passes
            sums.update(metrics.nan_mean_sums("aux_loss", aux_loss))
        self._log_loss_metrics(mode, info, entropies, mask, kl, sums, maxima)
        if self._entropy_bonus_enabled:
            self._update_entropy_coefficient(mode, entropies, mask, entropy_mask)
        return loss

    def _entropy_coefficient(self) -> float:
        return aggregation.applied_coefficient(
            self.entropy_coef, self._last_world_entropy, self.args.entropy_target, self.use_adaptive_entropy
        )

    def _update_entropy_coefficient(self, mode, entropies, mask, entropy_mask) -> None:
        """TRL's adaptive controller: accumulate the window's entropy, update once at the optimizer step."""
        boundary = mode == "train" and self.accelerator.sync_gradients
        if self.use_adaptive_entropy and mode == "train":
            stats = aggregation.effective_entropy_stats(entropies, mask, entropy_mask)
            if self._entropy_window_stats is not None:
                stats = self._entropy_window_stats + stats
            self._entropy_window_stats = stats
            if boundary:
                sums, _ = self._reduce({"sum": stats[0], "count": stats[1]}, {})
                world_entropy = sums["sum"] / max(sums["count"], 1.0)
                self.entropy_coef = aggregation.next_coefficient(
                    self.entropy_coef, world_entropy, self.args.entropy_target, self.args.entropy_coef_delta,
                    self.args.entropy_coef_min, self.args.entropy_coef_max,
                )  # fmt: skip
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if boundary:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    def _global_entropy_range(self, entropies, mask):
        """Min and max entropy over the valid tokens of every process (one reduction)."""
        _, maxima = self._reduce({}, metrics.entropy_range_maxima(entropies, mask))
        return metrics.entropy_range(maxima)

    # --------------------------------------------------------------- metrics
    def _log_loss_metrics(self, mode, info, entropies, mask, per_token_kl, sums=None, maxima=None):
        """TRL's `entropy`, `kl`, clip metrics, `policy_loss`, `aux_loss` and the objective's `<prefix>/` metrics,
        reduced over all processes in one sum and one max."""
        objective = get_objective(self.args.algorithm)
        loss_sums, loss_maxima = metrics.loss_sums(info, entropies, mask, per_token_kl, objective.metric_prefix,
                                                   objective.fractions)  # fmt: skip
        clip_sums, clip_maxima = metrics.clip_sums(objective.clip_metrics, info, mask)
        totals, extremes = self._reduce({**(sums or {}), **loss_sums, **clip_sums},
                                        {**(maxima or {}), **loss_maxima, **clip_maxima})  # fmt: skip
        logged = {
            **{name: metrics.nan_mean(name, totals) for name in ("policy_loss", "aux_loss") if name in totals},
            **metrics.loss_metrics(totals, extremes, objective.metric_prefix, objective.fractions),
            **metrics.clip_metrics(objective.clip_metrics, totals, extremes),
        }
        for name, value in logged.items():
            self._metrics[mode][name].append(value)

    # ---------------------------------------------- resume and graceful stop (the logic: dhpo_trl/training/resume.py)
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """TRL's `train()`, resuming exactly from any checkpoint (`True` / `"latest"`: the newest complete one in
        `output_dir`), and stopping gracefully on SIGTERM / SIGUSR1: after the optimizer step in progress, with a
        checkpoint (`self.graceful_stop` then names the signal, step and checkpoint; None otherwise)."""
        self.graceful_stop = None
        main = self.accelerator.is_main_process
        warn = (lambda message: warnings.warn(message, stacklevel=4)) if main else (lambda message: None)
        checkpoint = resume.resolve_checkpoint(resume_from_checkpoint, self.args.output_dir, warn)
        if checkpoint is not None:
            resume.check_resumable(checkpoint, resume.run_settings(self.args, self.accelerator.num_processes))
            resume.restore_generation_state(self, checkpoint, self.accelerator.process_index, self.accelerator.device,
                                            warn=main)  # fmt: skip
        elif main and str(resume_from_checkpoint).strip().lower() == "latest":
            print(f"resume_from_checkpoint={resume_from_checkpoint}: no checkpoint in {self.args.output_dir} yet, "
                  "training from step 0.")  # fmt: skip
        with resume.stop_on_signals() as request:
            callback = resume.GracefulStopCallback(request, lambda flag: resume.agree_any(flag, self.accelerator.device))
            self.add_callback(callback)
            self._stop_callback = callback
            try:
                output = super().train(checkpoint, trial, ignore_keys_for_eval, **kwargs)
            finally:
                self.remove_callback(callback)
                self._stop_callback = None
        if callback.stopped_at is not None and callback.stopped_at < self.state.max_steps:  # not if it had finished
            path = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{callback.stopped_at}")
            signalled = request.name if request is not None and request.requested else "a signal to another process"
            self.graceful_stop = {"signal": signalled, "step": callback.stopped_at,
                                  "checkpoint": path}  # fmt: skip
        return output

    def _save_checkpoint(self, model, trial):
        run_dir = self._get_output_dir(trial=trial)
        checkpoint = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
        # Our file first: a folder holding it without the marker is recognisably half-written.
        if self.args.should_save:
            resume.unmark(checkpoint)
        resume.save_generation_state(checkpoint, self.accelerator.process_index, resume.capture(self))
        limit, self.args.save_total_limit = self.args.save_total_limit, None  # delete old checkpoints only once
        # The checkpoint of a graceful stop is the run's only way back: it is always a full one (optimizer, RNG and
        # generation states), also where `save_only_model` keeps the periodic ones small.
        stop = getattr(self, "_stop_callback", None)
        weights_only = self.args.save_only_model and not (stop is not None and stop.stopped_at == self.state.global_step)
        only_model, self.args.save_only_model = self.args.save_only_model, weights_only
        try:  # this one is marked complete, never before
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit, self.args.save_only_model = limit, only_model
        # TRL writes the card to output_dir only; copy it so every checkpoint (and every Hub push of one) carries it.
        card = os.path.join(self.args.output_dir, "README.md")
        if self.args.should_save and os.path.isfile(card) and os.path.isdir(checkpoint):
            shutil.copyfile(card, os.path.join(checkpoint, "README.md"))
        self.accelerator.wait_for_everyone()  # every process's files are written
        if self.args.should_save:
            settings = resume.run_settings(self.args, self.accelerator.num_processes)
            resume.mark_complete(checkpoint, settings, self.state.global_step, weights_only)
            rotate_checkpoints(run_dir, save_total_limit=limit, best_model_checkpoint=self.state.best_model_checkpoint,
                               use_mtime=True)  # fmt: skip

    # ------------------------------------------------------------ model card
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
