"""`DHPOTrainer`: TRL's `GRPOTrainer` with the policy loss of the chosen objective (DHPO or a paper baseline).

Generation (vLLM included), rewards, advantages, distributed training and checkpointing are inherited. `_compute_loss`
is ours for every row: it takes the objective's pure per-token loss from `dhpo_trl.core.objectives`, applies TRL's masks
and corrections in TRL's order and aggregates by `loss_type`, so all seven rows share one code path. The model card
and the `dhpo/` / `gmpo/` metrics are ours too; TRL's metric keys keep their meaning.
"""

from __future__ import annotations

import os

import torch
from accelerate.utils import DistributedType
from trl import GRPOTrainer

from ..core import aggregation, entropy_control, metrics, paper
from ..core.config import DHPOConfig, as_dhpo_config, compiled_packing_reason, trl_batching_reason
from ..core.losses import masked_log_ratio
from ..core.objectives import get_objective
from .moe import maybe_set_zero3_leaf_modules, zero3_leaf_modules_for_trl_prepared_models
from .vllm_utils import check_vllm_setup
from . import batching, collectives, input_grad_hooks, nonfinite, resume, routing_replay, session, trl_mirror
from . import sampler, update_path
from ..scoring.rewards import pop_grading_counts
from .reward_checks import check_reward_functions


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
        "citation": paper.CITATION,
    }

    def __init__(self, model, reward_funcs=None, args: DHPOConfig | None = None, *pos, **kwargs):
        model_name = model if isinstance(model, str) else model.config._name_or_path
        args, note = as_dhpo_config(args, model_name)  # None: defaults; a GRPOConfig: TRL's objective, with a note
        if note and args.process_index == 0:
            print(note)
        args.validate()  # the config may have been changed since it was built: refuse what would not act
        # Fail now, before any model is loaded: vllm missing or server unreachable; planning an image run cannot serve.
        check_vllm_setup(args, model_name, is_main_process=args.process_index == 0)
        reward_funcs = check_reward_functions(reward_funcs, args.reward_weights)  # garbage, weights: named errors
        update_path.refuse_planning_passed(super().__init__, model, reward_funcs, args, *pos, **kwargs)
        with zero3_leaf_modules_for_trl_prepared_models(), routing_replay.building_engine(args):  # ref. model; R3
            super().__init__(model, reward_funcs, args, *pos, **kwargs)
        self.zero3_leaf_modules = maybe_set_zero3_leaf_modules(self.model, self.accelerator)  # ZeRO-3 + MoE: moe.py
        self._tag_names = ["trl", "dhpo", args.algorithm]
        self.graceful_stop, self._last_run, self._making_optimizer = None, None, False  # resume.py: stop; LastRun
        update_path.refuse_multimodal_planning(args, self.processing_class, self.train_dataset)  # one TRL loaded
        models, device = {"model": self.model, "ref_model": self.ref_model}, self.accelerator.device.type
        self._update = update_path.choose(args.padding_free, args.share_prompts, args.dynamic_batching, models, device,
                                          trl_batching_reason(args), compiled_packing_reason(args))  # fmt: skip
        if self._update.notes and self.accelerator.is_main_process:
            print(self._update.notes)
        self._routing = routing_replay.TrainerRouting.of(self)  # `routing_replay`: MoE only
        self._gradient_check = nonfinite.StepCheck.of(args, self.accelerator)  # fp16 + explicit True: refused here

    def _generate_and_score_completions(self, inputs):
        """TRL's generation batch (one input-embedding hook kept: `input_grad_hooks`); with `routing_replay` on, the
        routing to replay added as rows. Logs `reward/over_budget`: its math answers the budget cut, all ranks."""
        pop_grading_counts()  # process-wide: those graded before (an evaluation, a reward call cut short) are not its
        with self._routing.generation_batch(self) as recorded, input_grad_hooks.replaced_hooks_removed(self.model):
            batch = super()._generate_and_score_completions(inputs)
        counts, _ = self._reduce({key: float(count) for key, count in pop_grading_counts().items()}, {})
        if counts["answers"]:  # the same on every process: the math reward was called
            self._metrics["train" if self.model.training else "eval"]["reward/over_budget"].append(counts["over_budget"])
        return self._routing.attach(batch, recorded)

    # ------------------------------------------------- the update's forwards (dhpo_trl/training/update_path.py)
    def _prepare_inputs(self, generation_batch):
        """TRL's buffered micro-batches, planned by the update path once per generation batch."""
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
        """Plan the buffered generation batch and log the path's padding (and sharing) metrics, all processes."""
        buffered, sums = self._update.plan(buffered, self._run())
        sums, _ = self._reduce(sums, {})
        for name, value in self._update.logged(sums).items():
            self._metrics["train"][name].append(value)
        return buffered

    def _run(self) -> update_path.Run:
        share = self.args.gradient_accumulation_steps / self.args.steps_per_generation
        return update_path.Run(
            self.args.gradient_accumulation_steps, self.args.max_tokens_per_micro_batch, self._max_over_processes,
            batching.planned_windows(self.accelerator.num_processes, share), self.pad_to_multiple_of,
            self.accelerator.autocast,
        )  # fmt: skip

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):  # fmt: skip
        """TRL's forward, run by the update path (padded, dynamic, packed or shared-prompt rows)."""
        parent = super()._get_per_token_logps_and_entropies

        def trl(ids, mask, keep, rows, entropy, aux, **images):
            if images:  # TRL's own call with the images, as TRL's callers make it
                return parent(model, ids, mask, keep, rows, entropy, aux, **images)
            return parent(model, ids, mask, keep, batch_size=rows, compute_entropy=entropy, compute_aux_loss=aux)

        return self._update.forward(model, trl, input_ids, attention_mask, logits_to_keep, batch_size,
                                    compute_entropy, compute_aux_loss, multimodal, self._run())  # fmt: skip

    def _get_grad_norm(self, model, grad_norm=None):
        """transformers' global norm of the step's gradients, checked before `optimizer.step()` (nonfinite.py)."""
        return self._gradient_check(super()._get_grad_norm(model, grad_norm), self.state.global_step + 1)

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:  # every metric and agreement's collective
        return collectives.all_reduce(tensor, op, self.accelerator.device, self.accelerator.num_processes)

    def _reduce(self, sums: dict, maxima: dict) -> tuple[dict, dict]:
        return metrics.reduce_across(sums, maxima, self._all_reduce)

    def _max_over_processes(self, values: list[int]) -> list[int]:
        return collectives.max_over_processes(values, self._all_reduce)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's step in the update's attention context (its backward too: gradient checkpointing re-runs forwards)."""
        with self._update.attention():
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not isinstance(inputs, batching.Passes):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # Split by `max_tokens_per_micro_batch`: passes before the last run forward and backward here (no sync, no step)
        done = torch.zeros((), device=self.accelerator.device)
        for part in inputs[:-1]:
            done = done + self._pass_before_the_boundary(model, part, return_outputs, num_items_in_batch).detach()
        return super().compute_loss(model, inputs[-1], return_outputs, num_items_in_batch) + done

    def _pass_before_the_boundary(self, model, part, return_outputs, num_items_in_batch):
        """A pass before the step's last: `sync_gradients` False for its forward too (the once-per-step entropy update
        waits), the forward inside `no_sync` (DDP / FSDP), no DeepSpeed rescaling (the loss is normalised) or step."""
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

    # ------------------------------------------------------------------ loss
    def _window(self, inputs, mode) -> aggregation.Window:
        """The micro-batch's window: attached by a planned path, else TRL's slices, whose count (the Trainer's
        `current_gradient_accumulation_steps`, set by train(), shorter for an epoch's last window) is known only at
        the micro-step."""
        if batching.WINDOW in inputs:
            return inputs[batching.WINDOW]
        accumulation = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        return aggregation.trl_slice_window(inputs["completion_mask"].size(0), inputs.get("num_items_in_batch"),
                                            mode == "train", accumulation, self.args.steps_per_generation,
                                            self.accelerator.num_processes)  # fmt: skip

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        completion_ids, mask = inputs["completion_ids"], batching.loss_mask(inputs)
        multimodal = {key: inputs.get(key) for key in batching.UNSUPPORTED_KEYS}
        # Entropies come out of TRL's fused LM head with the log-probs: no (B, T, V) tensor is kept.
        ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attended = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with self._routing.policy_pass(inputs) as routing_stats:  # replays the batch's routing ("old", "rollout")
            per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model, ids, attended, completion_ids.size(1), compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled, **multimodal)
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        # TRL skips old log-probs when the batch is exactly on-policy; then pi_old = sg[pi_theta].
        old_per_token_logps = inputs.get("old_per_token_logps")
        old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
        # Only DHPO-E reads it (the config refuses "global" elsewhere); the same branch on every process.
        global_scope = self.args.entropy_norm_scope == "global"
        entropy_range = self._global_entropy_range(entropies, mask) if global_scope else None
        per_token_loss, kl_weight, info = get_objective(self.args.algorithm).compute(
            per_token_logps, old_per_token_logps, advantages, mask, entropies, self.args, entropy_range)  # fmt: skip
        log_ratio = masked_log_ratio(per_token_logps.detach(), old_per_token_logps, mask)  # drift from pi_old, any row
        info = {**info, "abs_log_ratio": log_ratio.abs(), "log_ratio": log_ratio}
        per_token_loss, entropy_mask, kl = trl_mirror.tail_corrections(
            self, inputs, per_token_loss, per_token_logps, old_per_token_logps, advantages, mask, entropies, kl_weight
        )
        window = self._window(inputs, mode)
        loss = aggregation.aggregate(self.loss_type, per_token_loss, mask, window, self.max_completion_length)
        sums, maxima = routing_replay.metric_sums(routing_stats), {}
        if self._entropy_bonus_enabled:  # TRL logs the policy loss only then, before the bonus
            policy_loss = aggregation.reported_policy_loss(self.loss_type, loss, window)
            sums.update(metrics.nan_mean_sums("policy_loss", policy_loss))
            bonus = aggregation.entropy_bonus(entropies, mask, entropy_mask, window)
            loss = loss - entropy_control.applied(self._entropy_state(), entropy_control.control_of(self.args)) * bonus
        if self.aux_loss_enabled:  # mean over the window's forward passes
            loss = loss + self.router_aux_loss_coef * aux_loss / window.passes
            sums.update(metrics.nan_mean_sums("aux_loss", aux_loss))
        self._log_loss_metrics(mode, info, entropies, mask, kl, sums, maxima)
        if self._entropy_bonus_enabled:
            self._update_entropy_coefficient(mode, entropies, mask, entropy_mask)
        return loss

    def _entropy_state(self) -> entropy_control.State:  # TRL's attributes (TRL saves and loads them)
        return entropy_control.State(self.entropy_coef, self._last_world_entropy, self._entropy_window_stats)

    def _update_entropy_coefficient(self, mode, entropies, mask, entropy_mask) -> None:
        """TRL's adaptive controller (core/entropy_control.py): accumulate the window, move once per step."""
        boundary = mode == "train" and self.accelerator.sync_gradients
        if self.use_adaptive_entropy and mode == "train":
            state = entropy_control.accumulate(self._entropy_state(),
                                               entropy_control.effective_entropy_stats(entropies, mask, entropy_mask))
            if boundary:
                sums, _ = self._reduce({"sum": state.window[0], "count": state.window[1]}, {})
                state = entropy_control.close_window(state, sums["sum"], sums["count"],
                                                     entropy_control.control_of(self.args))  # fmt: skip
            self.entropy_coef, self._last_world_entropy, self._entropy_window_stats = state
        if boundary:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    def _global_entropy_range(self, entropies, mask):
        """Min and max entropy over the valid tokens of every process (one reduction)."""
        _, maxima = self._reduce({}, metrics.entropy_range_maxima(entropies, mask))
        return metrics.entropy_range(maxima)

    def _log_loss_metrics(self, mode, info, entropies, mask, per_token_kl, sums=None, maxima=None):
        """TRL's `entropy`, `kl`, clip metrics, `policy_loss`, `aux_loss` and the objective's `<prefix>/` metrics,
        reduced over all processes in one sum and one max."""
        logged = metrics.logged_loss_metrics(get_objective(self.args.algorithm), info, entropies, mask, per_token_kl,
                                             sums or {}, maxima or {}, self._reduce)  # fmt: skip
        for name, value in logged.items():
            self._metrics[mode][name].append(value)

    # ---------------------------------------------- resume and graceful stop (the logic: dhpo_trl/training/resume.py)
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """TRL's `train()`, resuming exactly from any checkpoint (`True` / `"latest"`: the newest complete one in
        `output_dir`), and stopping gracefully on SIGTERM / SIGUSR1: after the optimizer step in progress, with a
        checkpoint (`self.graceful_stop` then names the signal, step and checkpoint; None otherwise)."""
        self.graceful_stop = None
        main, processes = session.check_accelerate_state(self.accelerator)  # a config built since: refused
        checkpoint = resume.resolve_for_run(resume_from_checkpoint, self.args, processes, main, **resume.decided(self))
        callbacks = resume.start_fresh(self) if checkpoint is None else resume.restore(self, checkpoint)
        with resume.stop_on_signals() as request:
            stop = resume.GracefulStopCallback(request, lambda flag: collectives.any_process(flag, self._all_reduce))
            callbacks.append(stop)
            for callback in callbacks:
                self.add_callback(callback)
            self._stop_callback = stop
            try:
                output = super().train(checkpoint, trial, ignore_keys_for_eval, **kwargs)
            finally:
                for callback in callbacks:
                    self.remove_callback(callback)
                self._stop_callback = None
        self.graceful_stop = stop.record(self.state.max_steps, self._get_output_dir(trial=trial))
        return output

    def _save_checkpoint(self, model, trial):
        """TRL's model card, then the checkpoint with our states (`resume.write_checkpoint`); TRL's own copy of the
        adaptive entropy state is not written (ours, in the generation state, is the one restored)."""
        name = os.path.basename(os.path.normpath(self.args.hub_model_id or self.args.output_dir))  # "org/name": name
        self.create_model_card(model_name=name)
        stop = getattr(self, "_stop_callback", None)
        resume.write_checkpoint(self, model, trial, full=stop is not None and stop.stopped_at == self.state.global_step)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):  # the weights in the model's layout
        if not resume.load_policy_weights(self, self.model if model is None else model, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self):  # `load_best_model_at_end`: the same conversion (dhpo_trl/training/resume.py)
        if not resume.load_policy_weights(self, self.model, self.state.best_model_checkpoint):
            super()._load_best_model()

    def _get_train_sampler(self, dataset=None):
        """TRL's sampler, with a shuffle that follows the epoch (`dhpo_trl/training/sampler.py`)."""
        self._epoch_sampler = sampler.EpochRepeatSampler.like(super()._get_train_sampler(dataset))
        return self._epoch_sampler

    def _run_epoch(self, *args, **kwargs):
        """transformers' epoch loop, the sampler told its epoch first (a batch skip hides it from accelerate)."""
        sampler.EpochRepeatSampler.tell(getattr(self, "_epoch_sampler", None), kwargs)
        return super()._run_epoch(*args, **kwargs)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card, naming DHPO, citing the paper and recording the objective's settings."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            paper.append_card_section(self.args, get_objective(self.args.algorithm).settings(self.args))
