"""TRL 1.16 features a `GRPOTrainer` user turns on, with `DHPOTrainer` in its place: the same run with both trainers,
off-policy (two optimizer steps per generation batch), parameters and logged metrics compared; or, where one of our
settings cannot act with the feature, the early refusal that names it.
"""

import warnings

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer
from vlm_stand_in import build_model, build_processor, image_dataset

from dhpo_trl import DHPOConfig, DHPOTrainer

CPU = dict(use_cpu=True, bf16=False, report_to="none", seed=0, data_seed=0, save_strategy="no", logging_steps=1)
# Two micro-batches per optimizer step, two optimizer steps per generation batch: step 2 is off-policy.
RUN = dict(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2, steps_per_generation=4,
           max_steps=2, optim="sgd", learning_rate=0.5, max_grad_norm=0.0)  # fmt: skip


@pytest.fixture(autouse=True)
def quiet_trl(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def length_reward(completions, **kwargs):
    return [float(len(str(completion)) % 5) for completion in completions]


def train(trainer):
    start = [p.detach().clone() for p in trainer.model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return torch.cat([(p.detach() - s).flatten() for p, s in zip(trainer.model.parameters(), start, strict=True)])


# ------------------------------------------------------------------ vision-language models
def vlm_trainer(trainer_cls, args):
    processor = build_processor()
    return trainer_cls(model=build_model(processor), reward_funcs=length_reward, args=args,
                       train_dataset=image_dataset(), processing_class=processor)  # fmt: skip


def test_a_vision_language_model_on_image_prompts_trains_as_trls(tmp_path):
    """A tiny Qwen2.5-VL on prompts with images of three sizes: the default path keeps TRL's micro-batches and TRL's
    forwards with the image inputs, so the off-policy update is TRL's."""
    run = dict(**RUN, max_completion_length=8, **CPU)
    trl = vlm_trainer(GRPOTrainer, GRPOConfig(str(tmp_path / "trl"), **run))
    trl_change = train(trl)  # built and trained before the other: the same random state when each samples
    ours = vlm_trainer(DHPOTrainer, GRPOConfig(str(tmp_path / "dhpo"), **run))
    ours_change = train(ours)
    assert trl_change.norm() > 1e-2
    assert logged(ours, "off_policy/abs_log_ratio")[1] > 1e-3  # the second step is off-policy
    assert (ours_change - trl_change).abs().max().item() <= 1e-5
    for key in ("loss", "entropy", "clip_ratio/region_mean", "reward"):
        assert logged(ours, key) == pytest.approx(logged(trl, key), abs=1e-5), key


@pytest.mark.parametrize("setting", [dict(dynamic_batching=True), dict(padding_free=True),
                                     dict(padding_free=True, share_prompts=True),
                                     dict(max_tokens_per_micro_batch=512)])  # fmt: skip
def test_planned_batching_asked_for_with_a_vision_language_processor_is_refused(tmp_path, setting):
    """Image batches keep TRL's micro-batches: an explicit request for planned ones is refused when the trainer is
    built, naming the setting (the first one set, in the config's order)."""
    args = DHPOConfig(str(tmp_path), **setting, **RUN, **CPU)
    with pytest.raises(ValueError, match=f"DHPOConfig.{next(iter(setting))}=") as error:
        vlm_trainer(DHPOTrainer, args)
    assert "Qwen2_5_VLProcessor" in str(error.value) or "ImageOnlyProcessor" in str(error.value)
