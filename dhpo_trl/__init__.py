"""dhpo-trl: Dynamic Hybrid Policy Optimization (DHPO) on top of Hugging Face TRL."""

__version__ = "0.1.0"

from .config import DHPOConfig  # noqa: E402
from .losses import dhpo_per_token_loss, gmpo_per_token_loss  # noqa: E402
from .trainer import DHPOTrainer  # noqa: E402

__all__ = ["DHPOConfig", "DHPOTrainer", "__version__", "dhpo_per_token_loss", "gmpo_per_token_loss"]
