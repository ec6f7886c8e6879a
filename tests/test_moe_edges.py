"""dhpo_trl.training.moe on hand-built modules and configs: which configs count as MoE, which blocks are found, where the
ZeRO stage is read from, and what is logged. No DeepSpeed needed (its leaf-module setter is replaced by a spy)."""

import logging
from types import SimpleNamespace

import pytest
import torch

from dhpo_trl.training.moe import (
    _zero_stage,
    is_moe_config,
    maybe_set_zero3_leaf_modules,
    moe_block_classes,
    zero3_leaf_modules_for_trl_prepared_models,
)


@pytest.mark.parametrize("field", ["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"])
def test_every_expert_count_field_is_recognised(field):
    assert is_moe_config(SimpleNamespace(**{field: 2}))
    assert is_moe_config(SimpleNamespace(**{field: 64}))
    assert not is_moe_config(SimpleNamespace(**{field: 1}))  # one expert is a dense model
    assert not is_moe_config(SimpleNamespace(**{field: 0}))
    assert not is_moe_config(SimpleNamespace(**{field: None}))  # dense configs of MoE families carry None


def test_expert_count_is_read_from_the_text_config():
    class Composite:  # a vision-language config: the experts live in its text config
        num_experts = 1

        def get_text_config(self):
            return SimpleNamespace(num_local_experts=8)

    assert is_moe_config(Composite())
    assert not is_moe_config(SimpleNamespace(hidden_size=8))
    assert not is_moe_config(SimpleNamespace(num_experts=1, n_routed_experts=1))
    assert is_moe_config(SimpleNamespace(num_experts=None, n_routed_experts=4))  # any field may hold the count


class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)


class BlockWithExperts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(2, 2)
        self.experts = Experts()


class OtherBlockWithExperts(BlockWithExperts):
    pass


class FusedSparseMoeBlock(torch.nn.Module):  # experts fused into one weight: no `experts` child
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))


class Model(torch.nn.Module):
    def __init__(self, *blocks, config=None):
        super().__init__()
        self.layers = torch.nn.ModuleList(blocks)
        if config is not None:
            self.config = config


def test_blocks_are_found_by_experts_child_in_order_of_first_appearance():
    model = Model(OtherBlockWithExperts(), BlockWithExperts(), OtherBlockWithExperts())
    assert moe_block_classes(model) == [OtherBlockWithExperts, BlockWithExperts]  # once each, first seen first


def test_blocks_are_found_by_class_name_when_the_config_declares_experts():
    moe = Model(FusedSparseMoeBlock(), config=SimpleNamespace(num_experts=4))
    assert moe_block_classes(moe) == [FusedSparseMoeBlock]
    dense = Model(FusedSparseMoeBlock(), config=SimpleNamespace(num_experts=1))
    assert moe_block_classes(dense) == []  # the config says dense: the name alone does not count
    assert moe_block_classes(Model(FusedSparseMoeBlock())) == []  # no config, no experts child
    # an experts child is enough even when the config does not say MoE
    assert moe_block_classes(Model(BlockWithExperts(), config=SimpleNamespace())) == [BlockWithExperts]


def test_a_dense_model_with_an_moe_config_has_no_blocks():
    assert moe_block_classes(Model(torch.nn.Linear(2, 2), config=SimpleNamespace(num_experts=8))) == []


def plugin(**fields):
    return SimpleNamespace(**fields)


@pytest.mark.parametrize(
    ("holder", "stage"),
    [
        (SimpleNamespace(deepspeed_plugin=plugin(zero_stage=3)), 3),
        (SimpleNamespace(deepspeed_plugin=plugin(zero_stage="2")), 2),  # a stage read from YAML may be a string
        (SimpleNamespace(deepspeed_plugin=None, state=SimpleNamespace(deepspeed_plugin=plugin(zero_stage=1))), 1),
        (SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin(zero_stage=0))), 0),
        # a plugin built from a DeepSpeed JSON keeps the stage in its config only
        (SimpleNamespace(deepspeed_plugin=plugin(deepspeed_config={"zero_optimization": {"stage": 3}})), 3),
        (SimpleNamespace(deepspeed_plugin=plugin(zero_stage=None, deepspeed_config={"zero_optimization": {}})), None),
        (SimpleNamespace(deepspeed_plugin=plugin(deepspeed_config={})), None),
        (SimpleNamespace(deepspeed_plugin=None, state=SimpleNamespace(deepspeed_plugin=None)), None),
        (SimpleNamespace(), None),
    ],
)
def test_zero_stage_sources(holder, stage):
    assert _zero_stage(holder) == stage


def test_leaf_modules_from_a_json_plugin_and_the_warning_names_them(leaf_spy, caplog):
    model = Model(BlockWithExperts(), OtherBlockWithExperts())
    holder = SimpleNamespace(deepspeed_plugin=plugin(deepspeed_config={"zero_optimization": {"stage": 3}}))
    with caplog.at_level(logging.WARNING, logger="dhpo_trl.training.moe"):
        names = maybe_set_zero3_leaf_modules(model, holder)
    assert names == ["BlockWithExperts", "OtherBlockWithExperts"]
    assert leaf_spy == [(model, [BlockWithExperts, OtherBlockWithExperts])]
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "DeepSpeed ZeRO-3 with a mixture-of-experts model: BlockWithExperts, OtherBlockWithExperts set as ZeRO-3 "
        "leaf modules (all expert weights of a block are gathered when it runs), so that ranks routing tokens to "
        "different experts do not hang."
    )


def test_no_leaf_modules_and_no_warning_for_a_dense_model_under_zero3(leaf_spy, caplog):
    with caplog.at_level(logging.WARNING, logger="dhpo_trl.training.moe"):
        assert (
            maybe_set_zero3_leaf_modules(
                Model(torch.nn.Linear(2, 2)), SimpleNamespace(deepspeed_plugin=plugin(zero_stage=3))
            )
            == []
        )
    assert leaf_spy == [] and caplog.records == []


def test_the_prepare_deepspeed_wrapper_is_removed_even_after_an_error():
    from trl.trainer import grpo_trainer

    original = grpo_trainer.prepare_deepspeed
    with pytest.raises(RuntimeError, match="boom"):
        with zero3_leaf_modules_for_trl_prepared_models():
            assert grpo_trainer.prepare_deepspeed is not original
            raise RuntimeError("boom")
    assert grpo_trainer.prepare_deepspeed is original
