"""Mixture-of-experts models under DeepSpeed ZeRO-3: mark the MoE blocks as ZeRO-3 leaf modules.

ZeRO-3 gathers a module's parameters in a hook when the module runs and records the order for prefetching. In an
MoE block, different ranks route their tokens to different experts, so ranks run different expert modules and the
collective gathers stop matching: training hangs (a known DeepSpeed behaviour). A ZeRO-3 "leaf" module gathers all
its parameters on entry and installs no hooks below it, so every rank does the same collectives.

Some DeepSpeed releases already list a few transformers MoE blocks as default leaves (0.19 lists Mixtral, Qwen2-MoE
and Qwen3-MoE); we set the flag ourselves so that it does not depend on that list or on its version.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)

# Config fields that give the number of routed experts, across transformers MoE architectures.
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def is_moe_config(config) -> bool:
    """True when the (text) config declares more than one routed expert."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any((getattr(text_config, name, None) or 0) > 1 for name in EXPERT_COUNT_FIELDS)


def moe_block_classes(model: torch.nn.Module) -> list[type]:
    """The classes of the model's sparse MoE blocks (e.g. `Qwen3MoeSparseMoeBlock`), in order of first appearance.

    A block is a module with a child named `experts` (the router and the experts live together in it: Qwen2/3-MoE,
    Mixtral, DeepSeek-V3, GPT-OSS) or whose class name contains `SparseMoeBlock`. Empty for a dense model.
    """
    config = getattr(model, "config", None)
    structural = any(hasattr(module, "experts") for module in model.modules())
    if not structural and (config is None or not is_moe_config(config)):
        return []
    classes: dict[type, None] = {}
    for module in model.modules():
        named_children = dict(module.named_children())
        if "experts" in named_children or "SparseMoeBlock" in type(module).__name__:
            classes[type(module)] = None
    return list(classes)


def _zero_stage(accelerator_or_args) -> int | None:
    """ZeRO stage of the DeepSpeed plugin held by an `Accelerator` or `TrainingArguments`; None without DeepSpeed."""
    plugin = getattr(accelerator_or_args, "deepspeed_plugin", None)
    if plugin is None:
        state = getattr(accelerator_or_args, "state", None)
        plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is None:
        return None
    stage = getattr(plugin, "zero_stage", None)
    if stage is None:  # a plugin built from a DeepSpeed JSON keeps the stage in its config only
        stage = plugin.deepspeed_config.get("zero_optimization", {}).get("stage")
    return int(stage) if stage is not None else None


def maybe_set_zero3_leaf_modules(model: torch.nn.Module, accelerator_or_args) -> list[str]:
    """Mark the MoE blocks of `model` as ZeRO-3 leaf modules when ZeRO-3 is on; return the class names marked.

    Must run before DeepSpeed wraps the model (`deepspeed.initialize`), which is when ZeRO-3 installs its hooks.
    Does nothing (returns []) for a dense model or without ZeRO stage 3.
    """
    if _zero_stage(accelerator_or_args) != 3:
        return []
    classes = moe_block_classes(model)
    if not classes:
        return []
    from deepspeed.utils import set_z3_leaf_modules  # deepspeed is only needed when ZeRO-3 is on

    set_z3_leaf_modules(model, classes)
    names = [cls.__name__ for cls in classes]
    logger.warning(
        "DeepSpeed ZeRO-3 with a mixture-of-experts model: %s set as ZeRO-3 leaf modules (all expert weights of a "
        "block are gathered when it runs), so that ranks routing tokens to different experts do not hang.",
        ", ".join(names),
    )
    return names


@contextlib.contextmanager
def zero3_leaf_modules_for_trl_prepared_models():
    """While active, the reference and reward models TRL hands to DeepSpeed get their MoE blocks marked as leaves.

    `GRPOTrainer.__init__` wraps those models with `trl.trainer.grpo_trainer.prepare_deepspeed` before it returns,
    so the trainer cannot mark them afterwards; this wraps that function for the duration of the block.
    """
    from trl.trainer import grpo_trainer

    original = grpo_trainer.prepare_deepspeed

    def prepare_deepspeed_with_leaves(model, accelerator):
        maybe_set_zero3_leaf_modules(model, accelerator)
        return original(model, accelerator)

    grpo_trainer.prepare_deepspeed = prepare_deepspeed_with_leaves
    try:
        yield
    finally:
        grpo_trainer.prepare_deepspeed = original
