"""MoE: a tiny Qwen3-MoE trains with DHPO and its router aux loss; ZeRO-3 leaf modules are set exactly when needed."""

import math
from types import SimpleNamespace

import pytest
from datasets import Dataset

import dhpo_trl.training.trainer as trainer_module
from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.training.moe import (
    maybe_set_zero3_leaf_modules,
    moe_block_classes,
    zero3_leaf_modules_for_trl_prepared_models,
)


def _reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


def _off_policy_config(tmp_path, **overrides):
    # steps_per_generation > gradient_accumulation_steps: the second step of each generation batch is off-policy
    kwargs = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=1, steps_per_generation=2,
        max_completion_length=8, max_steps=4, logging_steps=1, learning_rate=1e-2, seed=0,
    )  # fmt: skip
    kwargs.update(overrides)
    return DHPOConfig(**kwargs)


@pytest.fixture
def moe_model(tiny_moe_model):
    # As in the released Qwen3-MoE configs: TRL asks for router logits in its own forward (the aux loss is on
    # because the config has the field and a non-zero coefficient). With the flag on in the config, generate()
    # fails in transformers 5.17 (the cached decode step's router logits do not match the full attention mask).
    tiny_moe_model.config.output_router_logits = False
    return tiny_moe_model


def _dataset(n=16):
    return Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(n)]})


def test_tiny_moe_trains_with_dhpo_and_logs_aux_loss(tmp_path, moe_model, tokenizer):
    trainer = DHPOTrainer(
        moe_model, _reward, args=_off_policy_config(tmp_path), train_dataset=_dataset(), processing_class=tokenizer
    )
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == pytest.approx(0.01)
    assert trainer.zero3_leaf_modules == []  # no DeepSpeed here
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "aux_loss" in entry]
    assert len(logs) == 4
    for entry in logs:
        # Switch-style balance loss: num_experts * sum_e f_e P_e >= 1 per layer when balanced, so clearly > 0
        assert math.isfinite(entry["aux_loss"]) and entry["aux_loss"] > 0.5
        assert math.isfinite(entry["loss"])
    ratios = [entry["dhpo/token_ratio/max"] - entry["dhpo/token_ratio/min"] for entry in logs]
    assert max(ratios) > 1e-4, "no off-policy step: pi_theta never differed from pi_old"


def test_aux_loss_is_added_to_the_dhpo_loss(tmp_path, moe_model, tokenizer):
    trainer = DHPOTrainer(
        moe_model, _reward, args=_off_policy_config(tmp_path), train_dataset=_dataset(4), processing_class=tokenizer
    )
    inputs = trainer._generate_and_score_completions([{"prompt": p} for p in _dataset(4)["prompt"]])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # the aux loss is divided by it, like the policy loss
    with_aux = trainer._compute_loss(trainer.model, inputs).item()
    aux = trainer._metrics["train"]["aux_loss"][-1]
    trainer.aux_loss_enabled = False
    without_aux = trainer._compute_loss(trainer.model, inputs).item()
    assert aux > 0.5
    assert with_aux - without_aux == pytest.approx(0.01 * aux / 2, rel=1e-4, abs=1e-7)


# ------------------------------------------------------------------ ZeRO-3 leaf modules


def _accelerator(stage):
    plugin = None if stage is None else SimpleNamespace(zero_stage=stage)
    return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), deepspeed_plugin=plugin)


def test_moe_block_classes(tiny_model, tiny_moe_model):
    assert [cls.__name__ for cls in moe_block_classes(tiny_moe_model)] == ["Qwen3MoeSparseMoeBlock"]
    assert moe_block_classes(tiny_model) == []


def test_leaf_modules_set_for_moe_under_zero3(leaf_spy, tiny_moe_model):
    names = maybe_set_zero3_leaf_modules(tiny_moe_model, _accelerator(3))
    assert names == ["Qwen3MoeSparseMoeBlock"]
    assert len(leaf_spy) == 1 and leaf_spy[0][0] is tiny_moe_model
    assert [cls.__name__ for cls in leaf_spy[0][1]] == ["Qwen3MoeSparseMoeBlock"]


def test_leaf_modules_read_from_training_arguments(leaf_spy, tiny_moe_model):
    args = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3))  # TrainingArguments.deepspeed_plugin
    assert maybe_set_zero3_leaf_modules(tiny_moe_model, args) == ["Qwen3MoeSparseMoeBlock"]
    assert len(leaf_spy) == 1


@pytest.mark.parametrize(("moe", "stage"), [(False, 3), (True, 2), (True, None)])
def test_leaf_modules_not_set_otherwise(leaf_spy, tiny_model, tiny_moe_model, moe, stage):
    model = tiny_moe_model if moe else tiny_model
    assert maybe_set_zero3_leaf_modules(model, _accelerator(stage)) == []
    assert leaf_spy == []


def test_real_deepspeed_flags_the_moe_blocks(tiny_moe_model):
    pytest.importorskip("deepspeed")
    from deepspeed.utils import z3_leaf_module

    maybe_set_zero3_leaf_modules(tiny_moe_model, _accelerator(3))
    flagged = [type(m).__name__ for m in tiny_moe_model.modules() if z3_leaf_module(m)]
    assert flagged == ["Qwen3MoeSparseMoeBlock"] * tiny_moe_model.config.num_hidden_layers


def test_trl_prepared_models_get_leaf_modules_during_init(leaf_spy, tiny_moe_model):
    from trl.trainer import grpo_trainer

    original = grpo_trainer.prepare_deepspeed
    wrapped_models = []
    grpo_trainer.prepare_deepspeed = lambda model, accelerator: wrapped_models.append(model) or "engine"
    try:
        with zero3_leaf_modules_for_trl_prepared_models():
            assert grpo_trainer.prepare_deepspeed(tiny_moe_model, _accelerator(3)) == "engine"
        # the leaf flag is set before the (here fake) DeepSpeed wrap, and the wrapper is removed afterwards
        assert len(leaf_spy) == 1 and wrapped_models == [tiny_moe_model]
        assert grpo_trainer.prepare_deepspeed(tiny_moe_model, _accelerator(3)) == "engine"
        assert len(leaf_spy) == 1
    finally:
        grpo_trainer.prepare_deepspeed = original


def test_trainer_marks_the_policy_before_deepspeed_wraps_it(tmp_path, monkeypatch, moe_model, tokenizer):
    seen = []

    def spy(model, accelerator):
        # called on the unwrapped policy, with the trainer's accelerator (which holds the DeepSpeed plugin)
        seen.append((model, accelerator, type(model).__name__))
        return ["Qwen3MoeSparseMoeBlock"]

    monkeypatch.setattr(trainer_module, "maybe_set_zero3_leaf_modules", spy)
    trainer = DHPOTrainer(
        moe_model, _reward, args=_off_policy_config(tmp_path), train_dataset=_dataset(4), processing_class=tokenizer
    )
    assert len(seen) == 1
    assert seen[0][0] is trainer.model and seen[0][1] is trainer.accelerator
    assert seen[0][2] == "Qwen3MoeForCausalLM"
    assert trainer.zero3_leaf_modules == ["Qwen3MoeSparseMoeBlock"]
