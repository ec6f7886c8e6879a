"""Every paper recipe and algorithm overlay parses into the paper's setup and batch, for 8 and 32 processes."""

from pathlib import Path

import pytest

from dhpo_trl.core.presets import PAPER_ALGORITHMS
from dhpo_trl.scale_out.cli import load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "recipes"
CPU = {"use_cpu": True, "bf16": False}  # parse on a machine without GPU; the recipes themselves set bf16
# recipe -> (model, prompts per optimizer step = VERL ppo_mini_batch_size)
MODELS = {
    "dhpo_e_qwen3_1.7b_base.yaml": ("Qwen/Qwen3-1.7B-Base", 256),
    "dhpo_e_qwen3_4b_base.yaml": ("Qwen/Qwen3-4B-Base", 256),
    "dhpo_e_qwen3_30b_a3b_base.yaml": ("Qwen/Qwen3-30B-A3B-Base", 32),
}
OVERLAYS = {
    "grpo.yaml": "GRPO", "gspo.yaml": "GSPO", "gmpo.yaml": "GMPO", "cispo.yaml": "CISPO",
    "dhpo_a.yaml": "DHPO-A", "dhpo_e_unified.yaml": "DHPO-E-unified",
}  # fmt: skip


def test_every_recipe_file_is_covered():
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == sorted(MODELS)
    assert sorted(p.name for p in (RECIPES / "algorithms").glob("*.yaml")) == sorted(OVERLAYS)


@pytest.mark.parametrize("num_processes", [8, 32])
@pytest.mark.parametrize("recipe", sorted(MODELS))
def test_recipe_is_the_paper_setup_with_its_global_batch(recipe, num_processes):
    script, config, model = load_recipe(RECIPES / recipe, num_processes=num_processes, overrides=CPU)
    model_id, prompts_per_step = MODELS[recipe]
    per_micro_step = config.per_device_train_batch_size * num_processes  # completions, all processes
    # 512 prompts x 16 responses per generation batch
    assert config.num_generations == 16
    assert per_micro_step * config.steps_per_generation == 512 * 16
    # one optimizer step = one PPO mini-batch: 256 prompts (32 for the 30B-A3B) x 16 responses
    assert per_micro_step * config.gradient_accumulation_steps == prompts_per_step * 16
    assert config.steps_per_generation // config.gradient_accumulation_steps == 512 // prompts_per_step
    assert config.steps_per_generation % config.gradient_accumulation_steps == 0
    # VERL's dynamic batch sizes: length-sorted micro-batches within each optimizer step, one pass per micro-step
    assert config.dynamic_batching is True and config.max_tokens_per_micro_batch is None
    # the rest of appendix D
    assert model.model_name_or_path == model_id and model.dtype == "float32"
    assert (script.dataset_name, script.dataset_config) == ("hkust-nlp/SimpleRL-Zoo-Data", "simplelr_qwen_level3to5")
    assert (script.question_column, script.answer_column, script.max_prompt_length) == ("question", "gt_answer", 1024)
    assert config.max_completion_length == 4096
    assert (config.temperature, config.top_p, config.top_k) == (1.0, 1.0, 0)
    assert (config.learning_rate, config.warmup_steps, config.weight_decay) == (1e-6, 10, 0.1)
    assert config.beta == 0.0 and config.loss_type == "grpo" and config.scale_rewards == "group"
    assert config.gradient_checkpointing and config.use_vllm and config.vllm_mode == "server"
    assert config.algorithm == "dhpo" and config.mixing == "entropy" and config.clipping == "branch"
    for field, value in PAPER_ALGORITHMS["DHPO-E"].items():
        assert getattr(config, field) == value


def test_recipes_keep_bf16_on_gpu():
    import yaml

    for recipe in MODELS:
        assert yaml.safe_load((RECIPES / recipe).read_text())["bf16"] is True


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_selects_the_paper_row(overlay):
    _, config, _ = load_recipe(
        RECIPES / "dhpo_e_qwen3_1.7b_base.yaml", [RECIPES / "algorithms" / overlay], num_processes=8, overrides=CPU
    )
    for field, value in PAPER_ALGORITHMS[OVERLAYS[overlay]].items():
        assert getattr(config, field) == value, field
    assert config.per_device_train_batch_size * 8 * config.steps_per_generation == 8192  # batch untouched
    if overlay == "gspo.yaml":
        assert config.importance_sampling_level == "sequence"
        assert (config.epsilon, config.epsilon_high) == (3e-4, 4e-4)
    if overlay == "cispo.yaml":  # CISPO is aggregated by loss_type like every row: eq. 7's per-response mean
        assert config.loss_type == "grpo" and config.epsilon_high == 1.2
    if overlay == "grpo.yaml":  # VERL's vanilla loss: dual clip at 3
        assert (config.algorithm, config.epsilon, config.epsilon_high, config.delta) == ("grpo", 0.2, 0.2, 3.0)


def test_command_line_overrides_the_recipe_and_rescales_the_plan():
    _, config, _ = load_recipe(
        RECIPES / "dhpo_e_qwen3_4b_base.yaml", num_processes=8, overrides={**CPU, "per_device_train_batch_size": 4}
    )
    assert (config.steps_per_generation, config.gradient_accumulation_steps) == (256, 128)


def test_indivisible_batch_names_the_field():
    with pytest.raises(ValueError, match="per_device_train_batch_size=24"):
        load_recipe(
            RECIPES / "dhpo_e_qwen3_1.7b_base.yaml",
            num_processes=8,
            overrides={**CPU, "per_device_train_batch_size": 24},
        )


def test_unknown_key_in_a_yaml_is_an_error(tmp_path):
    overlay = tmp_path / "typo.yaml"
    overlay.write_text("epsilon_hihg: 0.3\n")
    with pytest.raises(ValueError, match="epsilon_hihg"):
        load_recipe(RECIPES / "dhpo_e_qwen3_1.7b_base.yaml", [overlay], num_processes=8, overrides=CPU)


@pytest.mark.parametrize("recipe", sorted(MODELS))
def test_recipe_bounds_its_checkpoints_and_waits_long_enough_for_the_server(recipe):
    """Checkpoints: a ZeRO-3 checkpoint with optimizer shards is ~14 bytes per parameter (~430 GB for 30B-A3B), so
    every recipe keeps a bounded number; 30B-A3B keeps the bf16 weights only. ddp_timeout: rank 0 alone waits for
    the server and generates for every rank while the others wait in a collective (1800 s by default)."""
    _, config, _ = load_recipe(RECIPES / recipe, num_processes=8, overrides=CPU)
    assert config.save_strategy == "steps" and 1 <= config.save_total_limit <= 3
    assert config.save_only_model is ("30b" in recipe)  # the dense ones stay resumable
    assert config.ddp_timeout >= 2 * 1800  # well above the --vllm_server_timeout 1800 that the printed commands use
