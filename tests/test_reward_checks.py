"""Reward functions returning garbage fail on the first batch with a named error; None/NaN stay allowed."""

import math

import numpy as np
import pytest
import torch
from datasets import Dataset

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.reward_checks import check_reward_functions, checked_reward_function


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def test_valid_outputs_pass_through_unchanged():
    outputs = [1, 0.5, True, None, math.nan, np.float32(0.25), torch.tensor(2.0)]
    checked = checked_reward_function(lambda completions, **kw: outputs)
    assert checked(completions=["a"] * len(outputs)) is outputs


@pytest.mark.parametrize(
    ("outputs", "match"),
    [
        (["1.0"], r"returned '1.0' for completion 0"),
        ([[1.0, 2.0]], r"for completion 0"),
        ([0.0, math.inf], r"returned inf for completion 1"),
        (1.0, r"returned float"),
        ("oops", r"returned str"),
    ],
)
def test_garbage_raises_a_named_error(outputs, match):
    def my_reward(completions, **kwargs):
        return outputs

    with pytest.raises(ValueError, match=match) as error:
        checked_reward_function(my_reward)(completions=["a", "b"])
    assert "'my_reward'" in str(error.value)


def test_names_modules_and_model_ids_are_kept():
    class Scorer:
        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    module = torch.nn.Linear(1, 1)
    wrapped = check_reward_functions([constant_reward, Scorer(), "some/reward-model", module])
    assert wrapped[0].__name__ == "constant_reward" and wrapped[1].__name__ == "Scorer"
    assert wrapped[2] == "some/reward-model" and wrapped[3] is module
    assert check_reward_functions(constant_reward).__name__ == "constant_reward"


def test_trainer_fails_on_first_batch_naming_the_function(tokenizer, tiny_model, tmp_path):
    def string_reward(completions, **kwargs):
        return ["high"] * len(completions)

    args = DHPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=1, report_to="none", use_cpu=True, bf16=False)  # fmt: skip
    trainer = DHPOTrainer(model=tiny_model, reward_funcs=string_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 8}), processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="Reward function 'string_reward' returned 'high'"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert "rewards/string_reward/mean" not in str(trainer.state.log_history)
