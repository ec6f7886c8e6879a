"""`DHPOConfig`: TRL's `GRPOConfig` plus the knobs of DHPO and of the paper's baselines."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from .losses import CLIPPINGS, MIXINGS

ALGORITHMS = ("dhpo", "grpo", "gspo", "gmpo", "cispo")
ENTROPY_NORM_SCOPES = ("batch", "sequence", "global")
# TRL aggregations that normalise a per-token loss; "grpo" is the paper's eq. 7.
DHPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass
class DHPOConfig(GRPOConfig):
    r"""
    Configuration for [`DHPOTrainer`]: every field of TRL's `GRPOConfig` plus the ones below. Defaults follow the
    DHPO paper (Min et al., 2026): entropy-guided mixing, branch-specific clipping with epsilon 0.2 / 0.28 on both
    branches, the per-response token mean of eq. 7 (`loss_type="grpo"`), no KL term (`beta=0.0`) and
    group-normalised advantages (`scale_rewards="group"`, eq. 1).

    DHPO only differs from GRPO/GSPO off-policy (when pi_theta != pi_old): use `steps_per_generation` larger than
    `gradient_accumulation_steps` (the paper takes two optimizer steps per generation batch) or
    `num_iterations > 1`, or generate with vLLM.

    Parameters:
        algorithm (`str`, *optional*, defaults to `"dhpo"`):
            Policy objective. `"dhpo"`: the hybrid ratio of the paper, configured by the fields below. Baselines of
            the paper's Table 1: `"grpo"` (TRL's token-level objective, clip range from `epsilon`/`epsilon_high`),
            `"gspo"` (TRL's objective with `importance_sampling_level="sequence"`), `"cispo"` (TRL's
            `loss_type="cispo"`, ratio capped at `epsilon_high`), `"gmpo"` (geometric-mean policy optimisation,
            implemented in `dhpo_trl.losses.gmpo_per_token_loss`, log-ratio clip from `gmpo_epsilon_low/high`).
            Choosing `"gspo"` sets `importance_sampling_level="sequence"`, `"cispo"` sets `loss_type="cispo"`.
        mixing (`str`, *optional*, defaults to `"entropy"`):
            How the mixing weight w of m = w r + (1 - w) s is chosen (eq. 8). `"entropy"` (DHPO-E): w is the
            min-max normalised, stop-gradient token entropy of the current policy (eqs. 9-10). `"averaged"`
            (DHPO-A): w = `token_weight` for every token.
        token_weight (`float`, *optional*, defaults to `0.5`):
            w for `mixing="averaged"`, in [0, 1]. `1.0` gives GRPO's token ratio, `0.0` GSPO's sequence ratio.
        clipping (`str`, *optional*, defaults to `"branch"`):
            `"branch"`: clip the token ratio and the sequence ratio in their own trust regions, then mix (eq. 11).
            `"unified"`: clip the mixed ratio itself with the token epsilons (the paper's ablation).
        epsilon_low_token (`float`, *optional*, defaults to `0.2`):
            Lower clip of the token branch: r is clipped at `1 - epsilon_low_token`.
        epsilon_high_token (`float`, *optional*, defaults to `0.28`):
            Upper clip of the token branch: r is clipped at `1 + epsilon_high_token`.
        epsilon_low_seq (`float`, *optional*, defaults to `0.2`):
            Lower clip of the sequence branch: s is clipped at `1 - epsilon_low_seq`.
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
        dynamic_batching (`bool`, *optional*, defaults to `True`):
            Cut each optimizer step's micro-batches by length instead of TRL's fixed slices of the generation batch.
            Within every process's gradient-accumulation window (never across windows, so each optimizer step sees
            exactly TRL's sequences), sequences are sorted by length and cut into the same number of micro-batches
            with the smallest largest padded area, each trimmed to its own longest prompt and completion; the
            old/reference log-prob passes over the generation batch are cut the same way. Each micro-batch's loss is
            its share of the window's loss, so the gradient equals TRL's for every `loss_type` except `"bnpo"`
            (normalised per micro-batch by TRL, refused here). What changes with the grouping: quantities TRL
            computes per micro-batch, i.e. DHPO-E's entropy min-max with `entropy_norm_scope="batch"` or
            `"global"` (the paper's VERL runs also normalised over token-packed micro-batches; use `"sequence"` for
            invariance), TRL's `top_entropy_quantile` threshold and the MoE router aux loss. The entropy bonus
            becomes the mean over the window's tokens. Needs `steps_per_generation` to be a multiple of
            `gradient_accumulation_steps`. Multimodal batches keep TRL's micro-batches (a warning says so).
            `False` gives TRL's batching exactly.
        max_tokens_per_micro_batch (`int`, *optional*):
            With `dynamic_batching`, the largest padded token count (rows x (prompt + completion columns)) of one
            forward pass. A micro-batch above it runs as several forward/backward passes inside the same optimizer
            step (gradients accumulate, one synchronisation), so peak memory is bounded by tokens, not by the
            longest sequence times the batch size. Every process runs the same number of passes (agreed by one
            all-reduce per generation batch). A sequence longer than the budget gets a pass of its own; nothing is
            dropped or truncated. Also bounds the old/reference log-prob passes. `None`: one pass per micro-step.
        loss_type (`str`, *optional*, defaults to `"grpo"`):
            TRL's aggregation of the per-token loss. `"grpo"` is eq. 7 (mean over responses of the per-response
            token mean); `"bnpo"`, `"dr_grpo"` and `"dapo"` (token-mean aggregations) stay selectable for DHPO and
            GMPO. `"cispo"` is set by `algorithm="cispo"`.
    """

    algorithm: str = field(
        default="dhpo",
        metadata={"help": "Policy objective: 'dhpo', or a baseline 'grpo', 'gspo', 'gmpo', 'cispo'."},
    )
    mixing: str = field(
        default="entropy",
        metadata={"help": "Mixing weight of token and sequence ratios: 'entropy' (DHPO-E) or 'averaged' (DHPO-A)."},
    )
    token_weight: float = field(
        default=0.5, metadata={"help": "Weight w of the token ratio for mixing='averaged', in [0, 1]."}
    )
    clipping: str = field(
        default="branch",
        metadata={"help": "'branch' (clip each ratio before mixing, eq. 11) or 'unified' (clip the mixed ratio)."},
    )
    epsilon_low_token: float = field(default=0.2, metadata={"help": "Token branch lower clip: 1 - epsilon."})
    epsilon_high_token: float = field(default=0.28, metadata={"help": "Token branch upper clip: 1 + epsilon."})
    epsilon_low_seq: float = field(default=0.2, metadata={"help": "Sequence branch lower clip: 1 - epsilon."})
    epsilon_high_seq: float = field(default=0.28, metadata={"help": "Sequence branch upper clip: 1 + epsilon."})
    entropy_norm_scope: str = field(
        default="batch",
        metadata={"help": "Where the entropy min-max is taken: 'batch', 'sequence' or 'global' (all processes)."},
    )
    gmpo_epsilon_low: float = field(default=0.4, metadata={"help": "GMPO: lower clip of the token log-ratio."})
    gmpo_epsilon_high: float = field(default=0.4, metadata={"help": "GMPO: upper clip of the token log-ratio."})
    dynamic_batching: bool = field(
        default=True,
        metadata={"help": "Length-sorted, trimmed micro-batches within each accumulation window (same update as "
                          "TRL's batching, less padding). False: TRL's batching exactly."},
    )  # fmt: skip
    max_tokens_per_micro_batch: int | None = field(
        default=None,
        metadata={"help": "With dynamic_batching: the padded-token budget of one forward pass; larger micro-batches "
                          "run as several passes in the same optimizer step. None: one pass per micro-step."},
    )  # fmt: skip
    loss_type: str = field(
        default="grpo",
        metadata={"help": "Aggregation: 'grpo' (eq. 7, default), 'bnpo', 'dr_grpo', 'dapo'; 'cispo' for CISPO."},
    )

    def __post_init__(self):
        self._validate_dhpo_fields()
        if self.algorithm == "gspo":
            self.importance_sampling_level = "sequence"
        elif self.algorithm == "cispo":
            self.loss_type = "cispo"
        super().__post_init__()
        self._validate_batching()

    def _validate_dhpo_fields(self) -> None:
        def one_of(name: str, allowed: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"DHPOConfig.{name}={value!r} is not supported: use one of {list(allowed)}.")

        one_of("algorithm", ALGORITHMS)
        one_of("mixing", MIXINGS)
        one_of("clipping", CLIPPINGS)
        one_of("entropy_norm_scope", ENTROPY_NORM_SCOPES)
        if not 0.0 <= self.token_weight <= 1.0:
            raise ValueError(
                f"DHPOConfig.token_weight={self.token_weight} is outside [0, 1]: it is the weight w of the token "
                "ratio in m = w r + (1 - w) s (1.0 = GRPO's ratio, 0.0 = GSPO's)."
            )
        for name in ("epsilon_low_token", "epsilon_high_token", "epsilon_low_seq", "epsilon_high_seq",
                     "gmpo_epsilon_low", "gmpo_epsilon_high"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"DHPOConfig.{name}={getattr(self, name)} is negative: clip epsilons must be >= 0.")
        if self.algorithm != "cispo" and self.loss_type not in DHPO_LOSS_TYPES:
            raise ValueError(
                f"DHPOConfig.loss_type={self.loss_type!r} cannot aggregate the {self.algorithm.upper()} loss: use one "
                f"of {list(DHPO_LOSS_TYPES)} ('grpo' is the paper's eq. 7). For CISPO set algorithm='cispo'."
            )
        if self.algorithm in ("dhpo", "gmpo") and self.delta is not None:
            raise ValueError(
                f"DHPOConfig.delta={self.delta} (TRL's two-sided clip of the GRPO ratio) has no effect on "
                f"algorithm={self.algorithm!r}, whose ratios are bounded by its own clipping: leave delta=None."
            )
        if self.algorithm != "gspo" and self.importance_sampling_level != "token":
            raise ValueError(
                f"DHPOConfig.importance_sampling_level={self.importance_sampling_level!r} with "
                f"algorithm={self.algorithm!r}: sequence-level ratios are selected by algorithm='gspo' (DHPO mixes "
                "both levels itself). Leave importance_sampling_level at 'token'."
            )

    def _validate_batching(self) -> None:
        budget = self.max_tokens_per_micro_batch
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"DHPOConfig.max_tokens_per_micro_batch={budget!r} must be a positive integer or None.")
        if not self.dynamic_batching:
            if budget is not None:
                raise ValueError(
                    f"DHPOConfig.max_tokens_per_micro_batch={budget} acts only with dynamic_batching=True: set "
                    "dynamic_batching=True, or drop max_tokens_per_micro_batch."
                )
            return
        if self.loss_type == "bnpo":
            raise ValueError(
                "DHPOConfig.loss_type='bnpo' normalises by the tokens of each micro-batch, which dynamic_batching "
                "regroups: use loss_type='dapo' (token mean over the whole accumulation window, all processes), or "
                "dynamic_batching=False for TRL's per-micro-batch bnpo."
            )
        if self.steps_per_generation % self.gradient_accumulation_steps != 0:
            raise ValueError(
                f"DHPOConfig.dynamic_batching regroups sequences within each optimizer step's accumulation window, "
                f"so steps_per_generation ({self.steps_per_generation}) must be a multiple of "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}): change one of them, or set "
                "dynamic_batching=False."
            )
