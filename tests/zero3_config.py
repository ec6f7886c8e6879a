"""The DeepSpeed ZeRO-3 config of the tests' launches on CPU.

DeepSpeed keeps a parameter of fewer than `stage3_param_persistence_threshold` elements (1e5 by default) resident on
every rank, which is every parameter of the tests' tiny models: their forwards would gather nothing, and a rank
running a forward (or a gather) the other does not would go unnoticed. At 0 no parameter stays resident, so every
forward gathers from every rank, as a real model's large parameters do, and an unagreed forward blocks its launch.
"""

EVERY_FORWARD_GATHERS = {"stage3_param_persistence_threshold": 0}  # also for a config accelerate builds


def zero3(**zero_optimization) -> dict:
    """ZeRO-3 with no resident parameter; `zero_optimization` adds or overrides that section's keys."""
    return {"zero_optimization": {"stage": 3, **EVERY_FORWARD_GATHERS, **zero_optimization},
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "bf16": {"enabled": False}}  # fmt: skip


def residency(model) -> dict:
    """How many of `model`'s parameters there are, how many ZeRO-3 partitioned and how many it keeps resident: a
    launch asserts {"parameters": n, "partitioned": n, "resident": 0} rather than assume the config reached DeepSpeed."""
    params = list(model.parameters())
    return {"parameters": len(params), "partitioned": sum(hasattr(p, "ds_persist") for p in params),
            "resident": sum(bool(getattr(p, "ds_persist", False)) for p in params)}  # fmt: skip


def assert_none_resident(*counts: dict) -> None:
    """Every rank's (or run's) `residency`: the same parameters, each one partitioned, none resident."""
    n = counts[0]["parameters"]
    assert n > 0 and list(counts) == [{"parameters": n, "partitioned": n, "resident": 0}] * len(counts), counts
