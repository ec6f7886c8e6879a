"""`DHPOConfig`: TRL's `GRPOConfig` plus the knobs of DHPO and of the paper's baselines."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields
from datetime import timedelta
from functools import cached_property
from types import SimpleNamespace

from trl import GRPOConfig

from ..user_errors import SEED_MAX
from .aggregation import BASE_AGGREGATIONS
from .losses import CLIPPINGS, ENTROPY_NORM_SCOPES, IMPORTANCE_SAMPLING_LEVELS, MIXINGS, VESPO_LAMBDA_MIN, is_number
from .objectives import AGGREGATIONS, OBJECTIVE_SETTINGS, OBJECTIVES, SETTING_SCOPES, TRL_LOSS_TYPES
from .paper import AVERAGED_TOKEN_WEIGHT, CISPO_CAP, EPSILON_HIGH, EPSILON_LOW, GMPO_EPSILON, GRPO_EPSILON

ALGORITHMS = tuple(OBJECTIVES)
# The paper's CISPO eps_high = 0.2 (appendix D): VERL caps the weight at 1 + 0.2; TRL's epsilon_high is the cap.
CISPO_DEFAULT_CAP = CISPO_CAP
EPSILON_FIELDS = ("epsilon_low_token", "epsilon_high_token", "epsilon_low_seq", "epsilon_high_seq",
                  "gmpo_epsilon_low", "gmpo_epsilon_high", "epsilon", "epsilon_high")  # fmt: skip
TRL_ROW_FIELDS = ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                  "vespo_lambda_neg")  # fmt: skip
NUMBER_FIELDS = ("token_weight", *EPSILON_FIELDS, "delta", *TRL_ROW_FIELDS)
OPTIONAL_NUMBER_FIELDS = ("epsilon_high", "delta")
ROUTING_REPLAY_MODES = ("none", "old", "rollout")  # MoE routing replay: live, pi_old (R2), rollout (R3)
NONFINITE_SETTING = "stop_on_nonfinite_gradients"


def option(default, help: str):
    """A config field with its `--help` text (`HfArgumentParser` reads `metadata["help"]`, as for TRL's fields)."""
    return field(default=default, metadata={"help": help})


@dataclass
class DHPOConfig(GRPOConfig):
    r"""
    Configuration for [`DHPOTrainer`]: every field of TRL's `GRPOConfig` plus the ones below. Defaults follow the
    DHPO paper (Min et al., 2026): entropy-guided mixing, branch-specific clipping with epsilon 0.2 / 0.28 on both
    branches, the per-response token mean of eq. 7 (`loss_type="grpo"`), no KL term (`beta=0.0`) and
    group-normalised advantages (`scale_rewards="group"`, eq. 1).

    DHPO (and GMPO) only differ from GRPO off-policy, when pi_theta != pi_old: take several optimizer steps per
    generation batch (`steps_per_generation` a multiple of `gradient_accumulation_steps`; the paper takes two) or
    `num_iterations > 1`. On-policy TRL passes no old log-probs and every ratio is 1; the config warns. Generating
    with vLLM does not change this: TRL recomputes pi_old with the training model, and its vLLM importance-sampling
    correction (pi_old / pi_vllm) is a separate, detached factor.

    Settings that do not act are refused. Every objective reads only its own fields (listed per `algorithm` below);
    setting another one to a value other than its default raises, naming the setting that would make it act. TRL's
    parser passes every field to the constructor, so "set" means "different from the default": passing a field at
    its default is accepted and, like omitting it, changes nothing. `DHPOTrainer` validates the config again.

    Parameters:
        algorithm (`str`, *optional*, defaults to `"dhpo"`):
            Policy objective, each a pure loss of `dhpo_trl.core.losses` registered in `dhpo_trl.core.objectives`, aggregated
            by `loss_type` like every other row. `"dhpo"`: the hybrid ratio of the paper; reads `mixing`,
            `token_weight` (averaged mixing), `entropy_norm_scope` (entropy mixing), `clipping`, the token epsilons,
            the sequence epsilons (branch clipping) and `delta`. Baselines of the paper's Table 1: `"grpo"` (TRL's
            token-level clipped surrogate; reads `epsilon`, `epsilon_high`, `delta`), `"gspo"` (TRL's
            sequence-level ratio, sets `importance_sampling_level="sequence"`; reads `epsilon`, `epsilon_high`,
            `delta`), `"cispo"` (-sg[min(r, cap)] A log pi with cap `epsilon_high`), `"gmpo"` (geometric mean of
            the clipped token ratios; reads `gmpo_epsilon_low/high`, aggregation `loss_type="grpo"` only). TRL
            1.16's own objectives, each as TRL's `GRPOTrainer` computes it: `"sapo"` (a soft gate
            -(4 / tau) sigmoid(tau (r - 1)) A instead of a clip; reads `sapo_temperature_pos/neg` and
            `importance_sampling_level`), `"luspo"` (TRL's clipped surrogate at `importance_sampling_level`, each
            response weighted by its length through the aggregation `loss_type="luspo"`, its only one; reads
            `epsilon`, `epsilon_high`, `delta`; the LUSPO paper uses the sequence level), `"vespo"`
            (-sg[phi(w)] A log pi with the gamma weight phi of the sequence weight w; reads `vespo_k_pos/neg`,
            `vespo_lambda_pos/neg`, and `importance_sampling_level` for the bias-corrected KL only). `"cispo"` also
            reads `importance_sampling_level`.
            TRL's spellings select the same rows when `algorithm` is left at its default: `loss_type="sapo"` runs
            `algorithm="sapo"` aggregated by `"grpo"`, `"vespo"` and `"cispo"` their rows by `"dapo"`, `"luspo"` its
            row; `importance_sampling_level="sequence"` runs `"gspo"` (also with `algorithm="grpo"`). A different
            explicit `algorithm` is refused.
        mixing (`str`, *optional*, defaults to `"entropy"`):
            How the mixing weight w of m = w r + (1 - w) s is chosen (eq. 8). `"entropy"` (DHPO-E): w is the
            min-max normalised, stop-gradient token entropy of the current policy (eqs. 9-10). `"averaged"`
            (DHPO-A): w = `token_weight` for every token.
        token_weight (`float`, *optional*, defaults to `0.5`):
            w for `mixing="averaged"`, in [0, 1]. `1.0` gives GRPO's token ratio, `0.0` GSPO's sequence ratio; with
            branch clipping the epsilons of the branch without weight are then refused (they cannot act).
        clipping (`str`, *optional*, defaults to `"branch"`):
            `"branch"`: clip the token ratio and the sequence ratio in their own trust regions, then mix (eq. 11).
            `"unified"`: clip the mixed ratio itself with the token epsilons (the paper's ablation).
        epsilon_low_token (`float`, *optional*, defaults to `0.2`):
            Lower clip of the token branch: r is clipped at `1 - epsilon_low_token`; in [0, 1).
        epsilon_high_token (`float`, *optional*, defaults to `0.28`):
            Upper clip of the token branch: r is clipped at `1 + epsilon_high_token`.
        epsilon_low_seq (`float`, *optional*, defaults to `0.2`):
            Lower clip of the sequence branch: s is clipped at `1 - epsilon_low_seq`; in [0, 1).
        epsilon_high_seq (`float`, *optional*, defaults to `0.28`):
            Upper clip of the sequence branch: s is clipped at `1 + epsilon_high_seq`.
        entropy_norm_scope (`str`, *optional*, defaults to `"batch"`):
            Over which tokens the min and max of the entropy normalisation are taken: `"batch"` (all valid tokens
            of the micro-batch on this process), `"sequence"` (each response separately) or `"global"` (the
            micro-batch on every process: min and max are reduced across processes, one all-reduce per step).
        gmpo_epsilon_low (`float`, *optional*, defaults to `0.4`):
            GMPO only: token log-ratios are clipped below at `-gmpo_epsilon_low`.
        gmpo_epsilon_high (`float`, *optional*, defaults to `0.4`):
            GMPO only: token log-ratios are clipped above at `gmpo_epsilon_high`.
        epsilon (`float`, *optional*, defaults to `0.2`):
            TRL's lower clip `1 - epsilon` for `"grpo"` and `"gspo"` only; in [0, 1).
        epsilon_high (`float` or `None`, *optional*, defaults to `None`):
            `"grpo"`, `"gspo"`: TRL's upper clip `1 + epsilon_high` (None: `epsilon`). `"cispo"`: the cap of the
            importance weight itself (TRL's meaning); None becomes the paper's 1.2.
        delta (`float` or `None`, *optional*, defaults to `None`):
            Dual clip, > 1. `"grpo"`, `"gspo"`: TRL's two-sided clip (the unclipped ratio capped at `delta`);
            `delta=3` reproduces VERL's `vanilla` loss, whose dual clip `clip_ratio_c=3` is always on. `"dhpo"`:
            for A < 0 the per-token loss is capped at -delta A (the paper's equations have no dual clip: None).
        dynamic_batching (`bool` or `None`, *optional*, defaults to `None`):
            `None` (automatic): on, except for a run whose TRL settings it cannot serve (`loss_type="bnpo"`,
            `steps_per_generation` not a multiple of `gradient_accumulation_steps`): TRL's batching then, with one
            printed line saying why. `True` asks for it (refused where it cannot serve).
            Cut each optimizer step's micro-batches by length instead of TRL's fixed slices of the generation batch.
            Within every process's gradient-accumulation window (never across windows, so each optimizer step sees
            exactly TRL's sequences), sequences are sorted by length and cut into the same number of micro-batches
            with the smallest largest padded area, each trimmed to its own longest prompt and completion; the
            old/reference log-prob passes over the generation batch are cut the same way. Each micro-batch's loss is
            its share of the window's loss, so the gradient equals TRL's for every `loss_type` except `"bnpo"`
            (normalised per micro-batch by TRL: TRL's batching then). What changes with the grouping: quantities TRL
            computes per micro-batch, i.e. DHPO-E's entropy min-max with `entropy_norm_scope="batch"` or
            `"global"` (the paper's VERL runs also normalised over token-packed micro-batches; use `"sequence"` for
            invariance), TRL's `top_entropy_quantile` threshold and the MoE router aux loss. The entropy bonus is
            each micro-batch's mean over the tokens it acts on, weighted by its share of the window's loss tokens
            (without `top_entropy_quantile`: the mean over the window's tokens). Planned only where
            `steps_per_generation` is a multiple of `gradient_accumulation_steps`. Multimodal batches keep TRL's
            micro-batches (a warning says so); `True` with a vision-language processor and images in the dataset is
            refused. `False` gives TRL's batching exactly.
        max_tokens_per_micro_batch (`int`, *optional*):
            With `dynamic_batching`, the largest padded token count (rows x (prompt + completion columns)) of one
            forward pass. A micro-batch above it runs as several forward/backward passes inside the same optimizer
            step (gradients accumulate, one synchronisation), so peak memory is bounded by tokens, not by the
            longest sequence times the batch size. Every process runs the same number of passes (agreed by one
            all-reduce per generation batch). A sequence longer than the budget gets a pass of its own; nothing is
            dropped or truncated. Also bounds the old/reference log-prob passes. `None`: one pass per micro-step.
            With `padding_free`, the budget counts real tokens: the tokens of one packed row (one forward).
        padding_free (`bool` or `None`, *optional*, defaults to `None`):
            `None` (automatic): packed rows where they were measured faster or run on a varlen kernel, dynamic
            batching elsewhere. Packed on CPU (`sdpa`/`eager`: faster than dynamic batching: docs/performance.md) and on
            CUDA with a varlen kernel: a varlen flash implementation (`flash_attention_2`/`_3`/`_4` or a hub flash
            kernel) or, with `sdpa`/`eager`, torch's `varlen_attn` (torch >= 2.10 built with CUDA; measured on an H100
            and an H200: docs/performance_gpu.md). Dynamic batching on CUDA without a varlen kernel (the per-sequence
            attention loop) and on other devices, and for a model packing cannot serve; the trainer then prints one
            line saying why and how to opt in. On an H200 at 1.7B packed rows ran 0.90x dynamic batching at TRL's
            4 x 8 batch shape (the update bound by the host's work per micro-step) and 2.33x at 16 x 2 (the same
            sequences in fewer, larger micro-steps; docs/performance_gpu.md). With
            `dynamic_batching=False`, automatic means off. `True`: packed rows, and a clear error on a model they
            cannot serve. `False`: dynamic batching.
            Run every forward of the update (policy, old and reference log-prob passes) on packed rows: the real prompt
            and completion tokens of several sequences end to end, `position_ids` restarting at 0 for each, attention
            confined to each sequence (transformers' varlen path with `flash_attention_2`/`_3`/`_4`; with
            `sdpa`/`eager`, a dispatching implementation registered in `AttentionInterface` that runs
            `scaled_dot_product_attention` over each packed sequence and the model's own attention for every other
            call, so generation is unchanged). Within each accumulation window the sequences are packed into one
            balanced row per micro-step (TRL's number of forwards) or, under `max_tokens_per_micro_batch`, into the
            rows first-fit-decreasing needs (balanced when they fit), the count agreed across processes; the
            old/reference passes run TRL's number of rows (more under the budget). A sequence longer than the budget
            gets a row of its own. Log-probs and entropies are scattered back to TRL's layout, so objectives, masks and
            metrics are unchanged and the update equals `padding_free=False` to float rounding, except for what depends
            on the grouping (as for `dynamic_batching`: per-micro-batch entropy statistics, the MoE aux loss). Needs
            `dynamic_batching=True` (it re-cuts each accumulation window as dynamic batching does, with the same window
            normalisers). A model whose attention cannot be confined to a packed sequence (linear-attention or
            state-space layers, sliding windows or logit soft-capping without flash attention, an attention that
            bypasses `AttentionInterface`) is refused when the trainer is built with `True` (kept on dynamic
            batching, one line, with `None`); multimodal batches keep TRL's micro-batches (one warning), and `True`
            with a vision-language processor and images in the dataset is refused.
        share_prompts (`bool`, *optional*, defaults to `False`):
            With `padding_free`: sequences of one packed row whose attended prompt tokens are identical (a GRPO
            group's completions) carry their prompt once. The row holds the prompt minus its last token, then, for each
            completion, the last prompt token and the completion (`position_ids` continuing from the prompt's); each
            completion attends to the prompt and causally to itself only (one SDPA per completion with a small mask,
            `dhpo_trl/training/shared_prompts.py`), so log-probs, entropies and gradients equal `share_prompts=False`
            to float rounding (the prompt's activations receive every completion's gradient). Rows are planned over
            groups (a group is split only when `max_tokens_per_micro_batch` or the agreed row count needs it), within
            each accumulation window as for `padding_free`; TRL shuffles the generation batch before cutting it into
            micro-steps, so a window shares only the completions of a prompt that fall into it
            (`batching/prompt_tokens_saved` logs the share of the update rows' prompt tokens not forwarded). Every
            forward of the update (policy, old and reference log-probs) runs shared. Needs padding-free packing
            (`padding_free=True`, or the default `None` where it packs; refused where it does not) and an `sdpa` or
            `eager` attention (a flash implementation is refused when the trainer is built). The MoE aux loss
            counts a shared prompt's tokens once. What it saves is measured by `benchmarks/bench_dynamic_batching.py`'s
            `shared` arm (docs/performance.md).
        sapo_temperature_pos, sapo_temperature_neg (`float`, *optional*, defaults to `1.0`, `1.05`):
            SAPO only: the gate's temperature where A > 0 and elsewhere; > 0.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg (`float`, *optional*, defaults to `2.0`,
            `3.0`, `3.0`, `2.0`):
            VESPO only: phi(w) = exp(lambda + k log w - lambda w) with the pair of A >= 0 or of A < 0; lambda >= 1e-4.
            VESPO folds TRL's vLLM importance-sampling correction into w inside TRL's loss, which `DHPOTrainer` does
            not: with `use_vllm=True` it needs `vllm_importance_sampling_correction=False`.
        importance_sampling_level (`str`, *optional*, defaults to `"token"`):
            TRL's ratio level for `"sapo"`, `"luspo"`, `"cispo"` (and the KL weight of `"vespo"`); `"gspo"` sets
            `"sequence"`, which with the default `algorithm` or `"grpo"` selects `"gspo"`. Refused elsewhere.
        loss_type (`str`, *optional*, defaults to `"grpo"`):
            TRL's aggregation of the per-token loss, the same for every objective. `"grpo"` is eq. 7 (mean over
            responses of the per-response token mean); `"bnpo"`, `"dr_grpo"` and `"dapo"` (token-weighted) work for
            every objective but GMPO and LUSPO; `"luspo"` (per-response token sum, mean over responses) is LUSPO's,
            set for `algorithm="luspo"`. TRL's objective names `"cispo"`, `"sapo"`, `"luspo"` and `"vespo"` select
            their rows (see `algorithm`).
        stop_on_nonfinite_gradients (`bool` or `None`, *optional*, defaults to `None`):
            Stop training at the first optimizer step whose gradient norm (transformers' global norm, before
            clipping) is NaN or inf, before the optimizer step writes it into the weights: `DHPOTrainer.train()`
            raises `NonFiniteGradientError` (one line: the step, the norm, the last checkpoint, which
            `resume_from_checkpoint="latest"` continues from). `None` (automatic): on, except with fp16, whose loss
            scaler skips inf steps by design and lowers the scale. `True`: on, refused with fp16. `False`: off, as
            transformers' Trainer (the optimizer steps whatever the norm). Under DeepSpeed the engine steps inside
            backward, before the norm is read: the run stops at that step, and the parameters are the previous
            step's where DeepSpeed's overflow check skipped it (ZeRO's default). Where DeepSpeed computes no norm
            (ZeRO stage 0 in fp32, `compute_grad_norm` false), `None` prints that the check is off and `True` is
            refused at the first step. See docs/resume.md.
    """

    algorithm: str = option(
        "dhpo",
        "Policy objective: 'dhpo', a baseline 'grpo', 'gspo', 'gmpo', 'cispo', or TRL's 'sapo', 'luspo', 'vespo'.",
    )
    mixing: str = option(
        "entropy", "Mixing weight of token and sequence ratios: 'entropy' (DHPO-E) or 'averaged' (DHPO-A)."
    )
    token_weight: float = option(
        AVERAGED_TOKEN_WEIGHT, "Weight w of the token ratio for mixing='averaged', in [0, 1]."
    )
    clipping: str = option(
        "branch", "'branch' (clip each ratio before mixing, eq. 11) or 'unified' (clip the mixed ratio)."
    )
    epsilon_low_token: float = option(EPSILON_LOW, "Token branch lower clip: 1 - epsilon.")
    epsilon_high_token: float = option(EPSILON_HIGH, "Token branch upper clip: 1 + epsilon.")
    epsilon_low_seq: float = option(EPSILON_LOW, "Sequence branch lower clip: 1 - epsilon.")
    epsilon_high_seq: float = option(EPSILON_HIGH, "Sequence branch upper clip: 1 + epsilon.")
    entropy_norm_scope: str = option(
        "batch", "Where the entropy min-max is taken: 'batch', 'sequence' or 'global' (all processes)."
    )
    gmpo_epsilon_low: float = option(GMPO_EPSILON, "GMPO: lower clip of the token log-ratio.")
    gmpo_epsilon_high: float = option(GMPO_EPSILON, "GMPO: upper clip of the token log-ratio.")
    epsilon: float = option(GRPO_EPSILON, "GRPO/GSPO: lower clip 1 - epsilon (DHPO and GMPO have their own fields).")
    epsilon_high: float | None = option(
        None, "GRPO/GSPO: upper clip 1 + epsilon_high (None: epsilon). CISPO: weight cap (None: 1.2)."
    )
    delta: float | None = option(
        None, "Dual clip (> 1) for GRPO/GSPO (TRL's; 3 = VERL's vanilla) and DHPO (A < 0 tokens)."
    )
    dynamic_batching: bool | None = option(
        None,
        "Length-sorted, trimmed micro-batches within each accumulation window (same update as TRL's batching, less "
        "padding). False: TRL's batching exactly. None (default): on unless loss_type='bnpo' or steps_per_generation "
        "is not a multiple of gradient_accumulation_steps.",
    )
    max_tokens_per_micro_batch: int | None = option(
        None,
        "With dynamic_batching: the padded-token budget of one forward pass; larger micro-batches run as several "
        "passes in the same optimizer step. None: one pass per micro-step.",
    )
    padding_free: bool | None = option(
        None,
        "With dynamic_batching: pack each forward's sequences end to end (no padding, attention per sequence); "
        "max_tokens_per_micro_batch then counts real tokens per packed row. None (default): packed on CPU and on "
        "CUDA with a varlen kernel (torch's varlen_attn or flash attention), dynamic batching elsewhere.",
    )
    share_prompts: bool = option(
        False,
        "With padding_free: a prompt shared by several sequences of a packed row is forwarded once; each completion "
        "attends to it (same update to float rounding). Needs an sdpa/eager model.",
    )
    loss_type: str = option(
        "grpo",
        "Aggregation for every objective: 'grpo' (eq. 7, default), 'bnpo', 'dr_grpo', 'dapo' ('luspo': LUSPO's). "
        "TRL's 'cispo', 'sapo', 'luspo', 'vespo' select those objectives.",
    )
    # ---- mixture-of-experts routing replay (dhpo_trl/training/routing_replay.py)
    routing_replay: str = option(
        "none",
        "MoE models: 'old' (R2) records each token's top-k experts in the pi_old pass and every policy and reference "
        "pass of that generation batch routes it through them (gate weights from the live router); 'rollout' (R3) "
        "replays the routing vLLM returns with each completion (a server started with "
        "--enable-return-routed-experts, or colocated) in every pass; 'none' (default): live routing.",
    )

    stop_on_nonfinite_gradients: bool | None = option(
        None,
        "Stop at the first NaN/inf gradient norm, before the optimizer step writes it into the weights (an error "
        "naming the step and the last checkpoint). None (default): on unless fp16 (its loss scaler skips inf steps). "
        "True: on, refused with fp16. False: off.",
    )

    def __post_init__(self):
        self._check_before_trl()
        super().__post_init__()  # TRL resolves steps_per_generation here
        self._check_after_trl()

    @cached_property
    def _setup_devices(self):
        start_cpu_process_group(self.use_cpu, self.ddp_backend, self.ddp_timeout, os.environ)
        return super()._setup_devices

    def validate(self) -> None:
        """Check the objective's settings again (`DHPOTrainer.__init__` calls this: the config may have been
        mutated after construction) and re-apply what `algorithm` implies: the constructor's checks, in its order."""
        self._check_before_trl()
        self._check_after_trl()

    def _check_before_trl(self) -> None:
        """The objective's fields and what `algorithm` sets, and a DeepSpeed config accelerate would drop: settled
        before TRL's and transformers' `__post_init__` read them (transformers builds its DeepSpeed config there)."""
        self._apply_trl_spelling()
        self._validate_dhpo_fields()
        self._apply_algorithm()
        refuse_deepspeed_dropped_by_accelerate(self.deepspeed, os.environ)
        check_trl_run_fields(self)

    def _check_after_trl(self) -> None:
        """The checks that read what TRL's `__post_init__` resolves (`steps_per_generation`)."""
        self._validate_batching()
        self._validate_routing_replay()
        check_seed(self.seed, self.world_size)
        nonfinite_check_applies(self.stop_on_nonfinite_gradients, self.fp16)
        self._warn_if_on_policy()

    def _apply_trl_spelling(self) -> None:
        """TRL's ways of naming an objective select its row when `algorithm` is at its default (or names that row);
        a row whose aggregations exclude the default `loss_type` gets its own. Idempotent."""
        default = _FIELD_DEFAULTS["algorithm"]
        if self.algorithm != "gspo" and getattr(self, "_level_set_for_gspo", False):
            self.importance_sampling_level = "token"  # set by the gspo row, which is no longer chosen
            self._level_set_for_gspo = False
        if self.loss_type in TRL_LOSS_TYPES:
            row, aggregation = TRL_LOSS_TYPES[self.loss_type]
            if self.algorithm not in (default, row):
                raise ValueError(
                    f"DHPOConfig.loss_type={self.loss_type!r} is TRL's {row.upper()} objective, but algorithm="
                    f"{self.algorithm!r}: set algorithm={row!r} (aggregated as TRL does, loss_type={aggregation!r}), "
                    f"or keep algorithm={self.algorithm!r} with a loss_type in {list(BASE_AGGREGATIONS)}."
                )
            if self.algorithm != row:
                self._selected_by = f"loss_type={self.loss_type!r}"
            if self.loss_type == "cispo" and self.epsilon_high is None:  # TRL's cap: epsilon_high, else epsilon
                self.epsilon_high, self.epsilon = self.epsilon, _FIELD_DEFAULTS["epsilon"]
            self.algorithm, self.loss_type = row, aggregation
        if self.importance_sampling_level == "sequence" and self.algorithm in (default, "grpo"):
            self._selected_by = f"importance_sampling_level='sequence' with algorithm={self.algorithm!r}"
            self._asked_for = self.algorithm  # the row the level's note points back to
            self.algorithm = "gspo"  # TRL's clipped surrogate on the sequence ratio is GSPO
        objective = OBJECTIVES.get(self.algorithm)
        if objective is not None and self.loss_type == _FIELD_DEFAULTS["loss_type"]:
            if self.loss_type not in objective.loss_types:
                self.loss_type = objective.loss_types[0]

    def _apply_algorithm(self) -> None:
        if self.algorithm == "gspo":  # keeps TRL's sequence-level metrics and warnings in their GSPO meaning
            if self.importance_sampling_level != "sequence":
                self._level_set_for_gspo = True
            self.importance_sampling_level = "sequence"
        if self.algorithm == "cispo" and self.epsilon_high is None:
            self.epsilon_high = CISPO_DEFAULT_CAP

    def _validate_dhpo_fields(self) -> None:
        def one_of(name: str, allowed) -> None:
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"DHPOConfig.{name}={value!r} is not supported: use one of {list(allowed)}.")

        one_of("algorithm", OBJECTIVES)
        one_of("mixing", MIXINGS)
        one_of("clipping", CLIPPINGS)
        one_of("entropy_norm_scope", ENTROPY_NORM_SCOPES)
        one_of("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS)
        for name in NUMBER_FIELDS:
            value = getattr(self, name)
            if (value is not None or name not in OPTIONAL_NUMBER_FIELDS) and not is_number(value, finite=True):
                raise ValueError(
                    f"DHPOConfig.{name}={value!r} must be a number ({type(value).__name__} given)"
                    + (" or None." if name in OPTIONAL_NUMBER_FIELDS else ".")
                )
        if self.loss_type not in AGGREGATIONS:
            raise ValueError(
                f"DHPOConfig.loss_type={self.loss_type!r} is not an aggregation DHPOTrainer applies: use one of "
                f"{list(AGGREGATIONS)} ('grpo' is the paper's per-response mean, eq. 7), or one of TRL's objectives "
                f"{list(TRL_LOSS_TYPES)}. The objective is chosen by `algorithm`."
            )
        objective = OBJECTIVES[self.algorithm]
        if self.loss_type not in objective.loss_types:
            why = {
                "gmpo": "GMPO's objective is a mean over sequences (VERL's geo_mean, whatever its aggregation mode); "
                        "a token-weighted aggregation would weight each sequence by its length",
                "luspo": "LUSPO's length weighting is its aggregation",
            }.get(self.algorithm, "'luspo' is LUSPO's aggregation (algorithm='luspo')")  # fmt: skip
            raise ValueError(
                f"DHPOConfig.loss_type={self.loss_type!r} with algorithm={self.algorithm!r}: {why}. Use loss_type="
                f"{objective.loss_types[0]!r}" + (f" or one of {list(objective.loss_types[1:])}." if
                                                   len(objective.loss_types) > 1 else ".")
            )
        self._refuse_settings_without_effect(objective)
        for name in EPSILON_FIELDS:
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"DHPOConfig.{name}={value} is negative: clip epsilons must be >= 0.")
        if not 0.0 <= self.token_weight <= 1.0:
            raise ValueError(
                f"DHPOConfig.token_weight={self.token_weight} is outside [0, 1]: it is the weight w of the token "
                "ratio in m = w r + (1 - w) s (1.0 = GRPO's ratio, 0.0 = GSPO's)."
            )
        for name in ("epsilon_low_token", "epsilon_low_seq", "epsilon"):
            if getattr(self, name) >= 1.0:
                raise ValueError(
                    f"DHPOConfig.{name}={getattr(self, name)} puts the lower clip 1 - {name} at or below 0, which "
                    "removes it: use a value below 1."
                )
        if self.delta is not None and self.delta <= 1.0:
            raise ValueError(
                f"DHPOConfig.delta={self.delta} must be > 1: it caps the ratio of A < 0 tokens (the dual clip; "
                "VERL's clip_ratio_c, default 3)."
            )
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DHPOConfig.{name}={getattr(self, name)} must be > 0: SAPO's gate divides by it.")
        for name in ("vespo_lambda_pos", "vespo_lambda_neg"):
            if getattr(self, name) < VESPO_LAMBDA_MIN:
                raise ValueError(
                    f"DHPOConfig.{name}={getattr(self, name)} is below {VESPO_LAMBDA_MIN}, where TRL's VESPO floors it "
                    f"(a smaller value would not act): use a value >= {VESPO_LAMBDA_MIN}."
                )
        if self.algorithm == "vespo" and self.use_vllm and self.vllm_importance_sampling_correction:
            raise ValueError(
                "DHPOConfig.vllm_importance_sampling_correction=True with algorithm='vespo' and use_vllm=True: TRL's "
                "VESPO folds the vLLM correction into its sequence weight, which DHPOTrainer does not do. Set "
                "vllm_importance_sampling_correction=False, or use trl.GRPOTrainer for VESPO with vLLM."
            )
        if self.algorithm == "cispo" and self.epsilon_high is not None and self.epsilon_high <= 0:
            raise ValueError(
                f"DHPOConfig.epsilon_high={self.epsilon_high} with algorithm='cispo' is the cap of the importance "
                f"weight and must be > 0 (the paper: {CISPO_DEFAULT_CAP})."
            )

    def _refuse_settings_without_effect(self, objective) -> None:
        """A setting the objective does not read is refused when it differs from its default.

        TRL's parser passes every field to the constructor, so a value typed at its default cannot be told from an
        omitted one: "set" means "not at the default". A default-valued setting has no effect either way.
        """
        reads = set(objective.settings(self))
        context = f"algorithm={self.algorithm!r}"
        if getattr(self, "_selected_by", None):
            context += f" (selected by {self._selected_by})"
        if self.algorithm == "dhpo":
            context += f", mixing={self.mixing!r}, clipping={self.clipping!r}"
            context += f", token_weight={self.token_weight!r}" if self.mixing == "averaged" else ""
        for name in OBJECTIVE_SETTINGS:
            value, default = getattr(self, name), _FIELD_DEFAULTS[name]
            if name not in reads and value != default:
                raise ValueError(
                    f"DHPOConfig.{name}={value!r} has no effect with {context}: it acts with "
                    f"{SETTING_SCOPES[name]}. Leave it at its default ({default!r})."
                )

    def _warn_if_on_policy(self) -> None:
        # TRL's own test (GRPOTrainer._generate_and_score_completions): no old log-probs when it holds.
        generate_every = self.steps_per_generation * self.num_iterations
        on_policy = self.algorithm in ("dhpo", "gmpo") and self.gradient_accumulation_steps % generate_every == 0
        setup = (self.algorithm, self.gradient_accumulation_steps, self.steps_per_generation, self.num_iterations)
        if on_policy and getattr(self, "_warned_on_policy", None) != setup:  # once per setup, not again in the trainer
            self._warned_on_policy = setup
            warnings.warn(
                f"DHPOConfig: algorithm={self.algorithm!r} runs on-policy (gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps} is a multiple of steps_per_generation={self.steps_per_generation}"
                f" x num_iterations={self.num_iterations}): every batch is used once by the policy that generated "
                "it, every ratio is 1 and the update is exactly GRPO's. Set steps_per_generation to k x "
                "gradient_accumulation_steps with k >= 2 (the paper: 2) or num_iterations > 1. vLLM alone does not "
                "change this: TRL recomputes pi_old with the training model.",
                UserWarning,
                stacklevel=5,  # the caller of DHPOConfig(...) or of DHPOTrainer(...), through _check_after_trl
            )

    def _validate_batching(self) -> None:
        budget = self.max_tokens_per_micro_batch
        if self.dynamic_batching is not None and not isinstance(self.dynamic_batching, bool):
            raise ValueError(f"DHPOConfig.dynamic_batching={self.dynamic_batching!r} must be True, False or None "
                             "(automatic).")  # fmt: skip
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"DHPOConfig.max_tokens_per_micro_batch={budget!r} must be a positive integer or None.")
        if self.padding_free is not None and not isinstance(self.padding_free, bool):
            raise ValueError(f"DHPOConfig.padding_free={self.padding_free!r} must be True, False or None (automatic).")
        if self.padding_free is True and self.dynamic_batching is False:
            raise ValueError(
                "DHPOConfig.padding_free=True packs the micro-batches that dynamic batching plans: set "
                "dynamic_batching=True, or padding_free=False."
            )
        if not isinstance(self.share_prompts, bool):
            raise ValueError(f"DHPOConfig.share_prompts={self.share_prompts!r} must be True or False.")
        if self.share_prompts and (self.padding_free is False or self.dynamic_batching is False):
            raise ValueError(  # padding_free=None: the trainer decides
                "DHPOConfig.share_prompts=True lays out the rows that padding-free packing builds: set "
                "padding_free=True (with dynamic_batching=True), or share_prompts=False."
            )
        if self.dynamic_batching is False and budget is not None:
            raise ValueError(
                f"DHPOConfig.max_tokens_per_micro_batch={budget} acts only with dynamic_batching: set "
                "dynamic_batching=True, or drop max_tokens_per_micro_batch."
            )
        compiled = compiled_packing_reason(self)
        for name in (name for name in ("padding_free", "share_prompts") if getattr(self, name) is True and compiled):
            unpacked = "share_prompts=False and padding_free=False" if self.share_prompts else "padding_free=False"
            raise ValueError(  # padding_free=None: the trainer keeps dynamic batching and says so
                f"DHPOConfig.{name}=True: {compiled}. Set {unpacked} (dynamic batching, which compiles), "
                "torch_compile=False, or gradient_checkpointing=False."
            )
        reason = trl_batching_reason(self) if self.dynamic_batching is not False else None
        for name in (name for name, asked in planning_requested(self).items() if asked and reason):
            raise ValueError(
                f"DHPOConfig.{name}={getattr(self, name)!r} needs dynamic batching, which cannot serve this run: "
                f"{reason}. Leave {name} at its default (TRL's batching for this run), or change that setting."
            )

    def _validate_routing_replay(self) -> None:
        """A dense model is refused by the trainer (it needs the model); here what the settings alone decide."""
        mode = self.routing_replay
        if mode not in ROUTING_REPLAY_MODES:
            raise ValueError(
                f"DHPOConfig.routing_replay={mode!r} is not supported: use one of {list(ROUTING_REPLAY_MODES)}."
            )
        if mode == "rollout" and not self.use_vllm:
            raise ValueError(
                "DHPOConfig.routing_replay='rollout' replays the routing vLLM returns with each completion, but "
                "use_vllm=False (transformers' generate returns none): set use_vllm=True (a server started with "
                "--enable-return-routed-experts, or vllm_mode='colocate'), or use routing_replay='old' (the pi_old "
                "pass's routing)."
            )
        # TRL's own test (GRPOTrainer._generate_and_score_completions) for computing pi_old, whose routing R2 replays.
        generate_every = self.steps_per_generation * self.num_iterations
        old_pass = self.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )
        if mode == "old" and not old_pass:
            raise ValueError(
                f"DHPOConfig.routing_replay='old' replays the routing of TRL's pi_old pass, which this on-policy "
                f"setup skips (gradient_accumulation_steps={self.gradient_accumulation_steps} is a multiple of "
                f"steps_per_generation={self.steps_per_generation} x num_iterations={self.num_iterations}): take "
                "several optimizer steps per generation batch (steps_per_generation or num_iterations), or set "
                "routing_replay='none'."
            )


def planning_requested(config) -> dict[str, bool]:
    """The settings that explicitly ask for planned micro-batches (dynamic batching or packing), and whether each is
    set: where planning cannot act, each set one is refused by name."""
    return {"dynamic_batching": config.dynamic_batching is True, "padding_free": config.padding_free is True,
            "share_prompts": bool(config.share_prompts),
            "max_tokens_per_micro_batch": config.max_tokens_per_micro_batch is not None}  # fmt: skip


def trl_batching_reason(config) -> str | None:
    """Why dynamic batching (and the packing built on its windows) cannot serve this run's TRL settings, or None."""
    if config.loss_type == "bnpo":
        return ("loss_type='bnpo' normalises by the tokens of each of TRL's micro-batches, which dynamic batching "
                "regroups (loss_type='dapo' is the token mean over the whole accumulation window)")  # fmt: skip
    if config.steps_per_generation % config.gradient_accumulation_steps != 0:
        return (f"steps_per_generation ({config.steps_per_generation}) is not a multiple of "
                f"gradient_accumulation_steps ({config.gradient_accumulation_steps}), and dynamic batching regroups "
                "sequences within each optimizer step's accumulation window")  # fmt: skip
    return None


def compiled_packing_reason(config) -> str | None:
    """Why `torch_compile=True` would not act on packed rows, or None. Their attention is not traced
    (`packing.packed_sdpa_attention`, `shared_prompts.shared_sdpa_attention`: Python over the row's layout), which
    breaks the compiled graph, and a graph break inside a gradient-checkpointed layer makes dynamo run the whole layer
    eagerly: on the CPU replica of the host-bound regime (28 layers) a packed micro-step ran 34,000 aten operators
    compiled or not, dynamic batching's 28,600 fell to 5,600 (docs/update_paths.md#torchcompile). Not measured with
    a flash implementation's varlen path, which the refusal covers too."""
    if config.torch_compile and config.gradient_checkpointing:
        return ("torch_compile=True does not compile packed rows with gradient_checkpointing=True (their per-sequence "
                "attention breaks the compiled graph inside every checkpointed layer, which then runs eagerly)")
    return None


SCALE_REWARDS = ("group", "batch", "none", True, False)  # TRL maps True to "group", False to "none"


def check_trl_run_fields(config) -> None:
    """TRL settings that `GRPOConfig` takes but training fails on, or divides by, once it runs: refused here."""
    counts = {"num_iterations": config.num_iterations, "steps_per_generation": config.steps_per_generation,
              "generation_batch_size": config.generation_batch_size,
              "max_completion_length": config.max_completion_length}  # fmt: skip
    # None: TRL derives steps_per_generation and generation_batch_size (from the other); no completion limit
    for name, value in counts.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"DHPOConfig.{name}={value!r} must be a positive whole number.")
    if config.max_steps == 0:  # transformers counts 0 as steps, not epochs, and checks its stop after a step
        raise ValueError("DHPOConfig.max_steps=0 trains one optimizer step: set the steps to train (1 or more), or -1 "
                         "to train num_train_epochs.")  # fmt: skip
    if not is_number(config.temperature, finite=True) or config.temperature <= 0:
        raise ValueError(f"DHPOConfig.temperature={config.temperature!r} must be a number > 0: TRL divides the "
                         "logits by it.")  # fmt: skip
    if config.scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"DHPOConfig.scale_rewards={config.scale_rewards!r} is not supported: use 'group', 'batch' "
                         "or 'none'.")  # fmt: skip


def check_seed(seed, processes: int) -> None:
    """TRL's trainer seeds numpy once the model has loaded (accelerate's `set_seed`), on each of `processes` with
    `seed` plus its rank: refuse here what numpy refuses there."""
    top = SEED_MAX - (processes - 1)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= top:
        ranks = f" (each of the {processes} processes adds its rank)" if processes > 1 else ""
        bound = f"2**32 - {processes}{ranks}"
        raise ValueError(f"DHPOConfig.seed={seed!r} must be a whole number from 0 to {bound}: numpy seeds with it.")


def nonfinite_check_applies(setting, loss_scaled: bool) -> bool:
    """Whether `stop_on_nonfinite_gradients` checks each step's gradient norm: `None` unless an fp16 loss scaler
    skips inf steps itself (there an inf norm is routine), `True` always (refused under such a scaler), `False`
    never. The config asks with `fp16`, the trainer again with its accelerator's scaler."""
    if setting is not None and not isinstance(setting, bool):
        raise ValueError(f"DHPOConfig.{NONFINITE_SETTING}={setting!r} must be True, False or None (automatic).")
    if setting is True and loss_scaled:
        raise ValueError(
            f"DHPOConfig.{NONFINITE_SETTING}=True cannot act with fp16: its loss scaler skips the steps whose "
            f"gradients overflow and lowers the scale, by design. Leave {NONFINITE_SETTING}=None (automatic: off "
            "with fp16), or train in bf16."
        )
    return setting is not False and not loss_scaled


def uses_dynamic_batching(config) -> bool:
    """Whether this run's micro-batches are planned (dynamic batching or packing) rather than TRL's."""
    return config.dynamic_batching is not False and trl_batching_reason(config) is None


_FIELD_DEFAULTS = {f.name: f.default for f in fields(DHPOConfig)}


def trl_objective(loss_type: str, importance_sampling_level: str) -> tuple[str, str]:
    """(algorithm, loss_type) of the row TRL's `GRPOTrainer` runs for its `loss_type` and `importance_sampling_level`."""
    if loss_type in TRL_LOSS_TYPES:
        return TRL_LOSS_TYPES[loss_type]
    return ("gspo" if importance_sampling_level == "sequence" else "grpo"), loss_type


def from_grpo_config(args: GRPOConfig) -> tuple[DHPOConfig, dict]:
    """A plain `GRPOConfig` as the `DHPOConfig` that runs the objective TRL's `GRPOTrainer` runs with it: every field
    copied, `algorithm` and the aggregation from its `loss_type` and `importance_sampling_level` (`trl_objective`).
    The DHPO fields keep their defaults (dynamic batching: the same update as TRL's batching).

    Returns the config and the objective settings TRL ignores for that loss type too (e.g. `epsilon` with SAPO),
    set back to their defaults here so that the config is accepted: the caller names them."""
    values = {f.name: getattr(args, f.name) for f in fields(GRPOConfig) if f.init}
    # GRPOConfig resolved both from one of them; passing both again is refused by its own check.
    values["generation_batch_size"] = None
    algorithm, loss_type = trl_objective(args.loss_type, args.importance_sampling_level)
    values["algorithm"], values["loss_type"] = algorithm, loss_type
    if args.loss_type == "cispo" and args.epsilon_high is None:  # TRL's cap: epsilon_high, else epsilon
        values["epsilon_high"], values["epsilon"] = args.epsilon, _FIELD_DEFAULTS["epsilon"]
    reads = set(OBJECTIVES[algorithm].settings(SimpleNamespace(**values)))
    ignored = {}
    for name in OBJECTIVE_SETTINGS:
        if name in values and name not in reads and values[name] != _FIELD_DEFAULTS[name]:
            ignored[name], values[name] = values[name], _FIELD_DEFAULTS[name]
    return DHPOConfig(**values), ignored


_TRUE = ("y", "yes", "t", "true", "on", "1")  # what accelerate's parse_flag_from_env counts as set


def refuse_deepspeed_dropped_by_accelerate(deepspeed, environ) -> None:
    """Refuse a DeepSpeed config that accelerate would silently drop: with `ACCELERATE_USE_CPU` set (`accelerate
    launch --cpu`, `use_cpu: true` in an accelerate config, or exported by hand) accelerate 1.15 forces `cpu=True`
    and then takes the DeepSpeed branch only `and not cpu` (accelerate/state.py, `AcceleratorState.__init__`, lines
    915 and 974): the model is wrapped in DDP, not DeepSpeed. transformers still registers the config globally
    (`HfTrainerDeepSpeedConfig`), so `is_deepspeed_zero3_enabled()` stays True and TRL 1.16 gathers the LM head as a
    ZeRO-3 parameter (trl/trainer/utils.py:230, `maybe_gather_lm_head_ctx`, on the first log-prob forward): it fails
    with `'Parameter' object has no attribute 'ds_status'`; under ZeRO-1/2 DeepSpeed would simply not act.
    The device plays no part: a GPU run with the variable set is a CPU run without DeepSpeed all the same.

    `deepspeed` is `TrainingArguments.deepspeed`; `ACCELERATE_USE_DEEPSPEED=true` is how `accelerate launch` with a
    DeepSpeed config asks for it (accelerate/utils/launch.py, `prepare_deepspeed_cmd_env`)."""

    def flag(name: str) -> bool:
        return str(environ.get(name, "")).strip().lower() in _TRUE

    asked = deepspeed not in (None, "", {}) or flag("ACCELERATE_USE_DEEPSPEED")
    if asked and flag("ACCELERATE_USE_CPU"):
        setting = "DHPOConfig.deepspeed" if deepspeed not in (None, "", {}) else "ACCELERATE_USE_DEEPSPEED=true"
        raise ValueError(
            f"{setting} has no effect with ACCELERATE_USE_CPU={environ.get('ACCELERATE_USE_CPU')!r} in the "
            "environment: accelerate then ignores DeepSpeed (and TRL fails on the first ZeRO-3 gather). Unset "
            "ACCELERATE_USE_CPU (and do not pass accelerate launch --cpu); DeepSpeed runs on CPU with "
            "DS_ACCELERATOR=cpu and --use_cpu true. Or drop the DeepSpeed config."
        )


# accelerate's CPU launch variables, in the order it reads them (`get_cpu_distributed_information`): torchrun's, then
# Intel MPI's, Open MPI's and MVAPICH's.
_CPU_WORLD_SIZE = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_CPU_RANK = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")


def _first_count(environ, names) -> int | None:
    """The first of `names` set to a count, as accelerate's `get_int_from_env` reads it; None if none is."""
    for name in names:
        value = int(environ.get(name, -1))
        if value >= 0:
            return value
    return None


def start_cpu_process_group(use_cpu: bool, ddp_backend, ddp_timeout, environ) -> bool:
    """Start the gloo process group of a multi-process CPU run with `ddp_timeout` as its collective limit, where
    accelerate would start gloo, with the rank, size and port it would take (`PartialState.__init__`, the MULTI_CPU
    branch: MASTER_PORT 29500 when unset, written to `environ` as accelerate writes it); True if it started one.
    transformers 5 hands `ddp_timeout` to accelerate only off the CPU (`TrainingArguments._setup_devices`, the
    `use_cpu` branch), so a CPU rank blocked in a collective the others never join would wait torch's default 30
    minutes whatever the user set; accelerate keeps a process group that already exists. MPI (which accelerate takes
    for no backend where torch has it), other backends (which it refuses on the CPU) and a launch without MASTER_ADDR
    (which it names) are left to accelerate."""
    import torch.distributed as dist

    if not dist.is_available():
        return False
    on_cpu = use_cpu or str(environ.get("ACCELERATE_USE_CPU", "")).strip().lower() in _TRUE
    world_size = _first_count(environ, _CPU_WORLD_SIZE) or 1
    gloo = ddp_backend == "gloo" or (ddp_backend is None and not dist.is_mpi_available())
    if not (on_cpu and world_size > 1 and gloo and environ.get("MASTER_ADDR")) or dist.is_initialized():
        return False
    if not environ.get("MASTER_PORT"):
        environ["MASTER_PORT"] = "29500"
    rank = _first_count(environ, _CPU_RANK) or 0
    dist.init_process_group("gloo", timeout=timedelta(seconds=ddp_timeout), rank=rank, world_size=world_size)
    return True


def as_dhpo_config(args, model_name) -> tuple[DHPOConfig, str | None]:
    """The trainer's `args` as a `DHPOConfig`, and a line to print or None: None gives the defaults, named after the
    model; a plain `GRPOConfig` the objective TRL's `GRPOTrainer` runs with it (`from_grpo_config`); anything else is
    refused."""
    if args is None:
        return DHPOConfig(f"{str(model_name).rstrip('/').split('/')[-1]}-DHPO"), None
    if isinstance(args, GRPOConfig) and not isinstance(args, DHPOConfig):
        args, ignored = from_grpo_config(args)
        unread = f"; not read by it, as in TRL: {ignored}" if ignored else ""
        return args, (f"DHPOTrainer: a GRPOConfig runs TRL's objective (algorithm={args.algorithm!r}, loss_type="
                      f"{args.loss_type!r}{unread}); for DHPO pass a DHPOConfig (algorithm='dhpo', its default).")
    if not isinstance(args, DHPOConfig):
        raise TypeError(f"DHPOTrainer needs `args` to be a DHPOConfig or a trl.GRPOConfig, got {type(args).__name__}.")
    return args, selection_note(args)


def selection_note(args: DHPOConfig) -> str | None:
    """The line that says a TRL spelling chose the row (`_apply_trl_spelling`), or None: with `algorithm` at its
    default a GSPO user's `importance_sampling_level='sequence'`, or a `loss_type` of TRL's, runs that objective, not
    DHPO, and nothing else would say so."""
    selected_by = getattr(args, "_selected_by", None)
    if not selected_by:
        return None
    asked = getattr(args, "_asked_for", _FIELD_DEFAULTS["algorithm"])
    if asked == _FIELD_DEFAULTS["algorithm"]:
        fix = f"not DHPO; for DHPO set importance_sampling_level='token' and a loss_type in {list(BASE_AGGREGATIONS)}"
    else:  # algorithm='grpo' named: its token ratio is one setting away
        fix = f"not {asked.upper()}; for algorithm={asked!r} set importance_sampling_level='token'"
    return f"DHPOTrainer: {selected_by} runs algorithm={args.algorithm!r} (loss_type={args.loss_type!r}), {fix}."
