"""dhpo-trl: Dynamic Hybrid Policy Optimization (DHPO) on top of Hugging Face TRL.

The package, layer by layer (each imports only the ones above it, and `user_errors` for one-line errors):

    core/        the method as pure functions: losses, objectives, aggregation, metrics, DHPOConfig, recipes
    training/    DHPOTrainer and its update engine: batching and packing, exact resume, mirrored TRL lines, checks
    scoring/     the bounded math reward, its grader, golds and the math data
    scale_out/   `dhpo-train`, the command that `accelerate launch` runs
    demo/        the embedded CPU default, `python -m dhpo_trl`
    evaluation/  benchmarks, the evaluation callback, `dhpo-evaluate` and `dhpo-plot`
"""

__version__ = "0.2.0"

from .core.config import DHPOConfig  # noqa: E402
from .core.losses import dhpo_per_token_loss, gmpo_per_token_loss  # noqa: E402
from .scoring.rewards import math_verify_reward  # noqa: E402
from .training.nonfinite import NonFiniteGradientError  # noqa: E402
from .training.trainer import DHPOTrainer  # noqa: E402

__all__ = ["DHPOConfig", "DHPOTrainer", "NonFiniteGradientError", "__version__", "dhpo_per_token_loss", "gmpo_per_token_loss", "math_verify_reward"]
