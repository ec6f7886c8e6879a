"""The seven objectives of the paper's Table 1 and ablation as `DHPOConfig` keyword arguments.

Clip ranges are the paper's (appendix D); the rest is what VERL, where the paper ran every row, does by default
(GRPO's dual clip `clip_ratio_c = 3`). Every row shares the aggregation `loss_type="grpo"`, the per-response mean of
the paper's equations 3, 6 and 7. `DHPOConfig(**PAPER_ALGORITHMS["DHPO-E"], ...)` or `config_for("GSPO",
output_dir=...)` give one ready configuration; recipes, the study and the tests use these.
"""

from __future__ import annotations

from .config import DHPOConfig
from .paper import (
    AVERAGED_TOKEN_WEIGHT,
    CISPO_CAP,
    EPSILON_HIGH,
    EPSILON_LOW,
    GMPO_EPSILON,
    GRPO_DELTA,
    GRPO_EPSILON,
    GSPO_EPSILON_HIGH,
    GSPO_EPSILON_LOW,
)  # fmt: skip

PAPER_ALGORITHMS: dict[str, dict] = {
    # Token-level ratio, symmetric clip 0.2, and VERL's vanilla dual clip for A < 0 at 3 (TRL's delta = 3).
    "GRPO": {"algorithm": "grpo", "epsilon": GRPO_EPSILON, "epsilon_high": GRPO_EPSILON, "delta": GRPO_DELTA},
    # Sequence-level ratio (TRL's importance_sampling_level="sequence"), clip [1 - 3e-4, 1 + 4e-4]. VERL's gspo loss
    # has no dual clip.
    "GSPO": {"algorithm": "gspo", "epsilon": GSPO_EPSILON_LOW, "epsilon_high": GSPO_EPSILON_HIGH},
    # Geometric mean of token ratios, log-ratio clipped to [-0.4, 0.4], a mean over sequences (VERL's geo_mean).
    "GMPO": {"algorithm": "gmpo", "gmpo_epsilon_low": GMPO_EPSILON, "gmpo_epsilon_high": GMPO_EPSILON},
    # Clipped, detached IS weight -sg[min(r, 1.2)] A log pi: the paper's eps_high = 0.2 caps the weight at 1.2 (the
    # cap is TRL's epsilon_high); its eps_low = 10 puts VERL's lower bound at 1 - 10 < 0, i.e. no lower bound.
    "CISPO": {"algorithm": "cispo", "epsilon_high": CISPO_CAP},
    # DHPO with averaged mixing (w = 0.5), branch-specific clipping, [0.2, 0.28] on both branches. The DHPO rows
    # follow the paper's equations: no dual clip (delta=None).
    "DHPO-A": {
        "algorithm": "dhpo", "mixing": "averaged", "token_weight": AVERAGED_TOKEN_WEIGHT, "clipping": "branch",
        "epsilon_low_token": EPSILON_LOW, "epsilon_high_token": EPSILON_HIGH,
        "epsilon_low_seq": EPSILON_LOW, "epsilon_high_seq": EPSILON_HIGH,
    },
    # DHPO with entropy-guided mixing (the paper's main method).
    "DHPO-E": {
        "algorithm": "dhpo", "mixing": "entropy", "clipping": "branch",
        "epsilon_low_token": EPSILON_LOW, "epsilon_high_token": EPSILON_HIGH,
        "epsilon_low_seq": EPSILON_LOW, "epsilon_high_seq": EPSILON_HIGH,
    },
    # Ablation (section 4.4): DHPO-E with one clip [1 - 0.2, 1 + 0.28] on the mixed ratio.
    "DHPO-E-unified": {
        "algorithm": "dhpo", "mixing": "entropy", "clipping": "unified",
        "epsilon_low_token": EPSILON_LOW, "epsilon_high_token": EPSILON_HIGH,
    },
}  # fmt: skip


def config_for(name: str, **kwargs) -> DHPOConfig:
    """`DHPOConfig` for one of the paper's rows (keys of `PAPER_ALGORITHMS`), with `kwargs` on top."""
    if name not in PAPER_ALGORITHMS:
        raise ValueError(f"Unknown algorithm {name!r}: choose one of {list(PAPER_ALGORITHMS)}.")
    return DHPOConfig(**{**PAPER_ALGORITHMS[name], **kwargs})
