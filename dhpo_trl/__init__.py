"""dhpo-trl: Dynamic Hybrid Policy Optimization (DHPO) on top of Hugging Face TRL.

The package, layer by layer (each imports only the ones above it, and `user_errors` for one-line errors):

    core/        the method as pure functions: losses, objectives, aggregation, metrics, DHPOConfig, recipes
    training/    DHPOTrainer and its update engine: batching and packing, exact resume, mirrored TRL lines, checks
    scoring/     the bounded math reward, its grader, golds and the math data
    scale_out/   `dhpo-train`, the command that `accelerate launch` runs
    demo/        the embedded CPU default, `python -m dhpo_trl`
    evaluation/  benchmarks, the evaluation callback, `dhpo-evaluate` and `dhpo-plot`
"""

import importlib as _importlib
import sys as _sys

__version__ = "0.2.0"

# Each public name and the module that defines it. They are imported on first use (PEP 562), so that `import dhpo_trl`
# and light submodules (`dhpo_trl.demo.cell_pool`, `dhpo_trl.user_errors`) do not import TRL, transformers and torch.
_PUBLIC = {
    "DHPOConfig": ".core.config",
    "DHPOTrainer": ".training.trainer",
    "NonFiniteGradientError": ".training.nonfinite",
    "dhpo_per_token_loss": ".core.losses",
    "gmpo_per_token_loss": ".core.losses",
    "math_verify_reward": ".scoring.rewards",
}

__all__ = ["DHPOConfig", "DHPOTrainer", "NonFiniteGradientError", "__version__", "dhpo_per_token_loss", "gmpo_per_token_loss", "math_verify_reward"]


def __getattr__(name: str):
    """Import a public name's module on first use and keep the name in the package's globals (later lookups do not
    come here)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}", name=name, obj=_sys.modules[__name__])
    value = getattr(_importlib.import_module(_PUBLIC[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
