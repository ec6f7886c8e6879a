"""Reward functions returning garbage fail on the first batch with a named error; None/NaN stay allowed."""

import functools
import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from datasets import Dataset

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.training.reward_checks import (
    _as_reward,
    check_reward_functions,
    check_reward_weights,
    checked_reward_function,
)


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


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, math.nan),
        (3, 3.0),
        (False, 0.0),
        (Fraction(1, 4), 0.25),
        (np.int64(2), 2.0),
        (np.array(0.5), 0.5),  # a 0-d array is a scalar
        (torch.tensor([1.5]), 1.5),  # one element, whatever its shape
        (torch.tensor(-2.0), -2.0),
    ],
)
def test_single_numbers_of_every_kind_are_rewards(value, expected):
    assert _as_reward(value) == pytest.approx(expected, nan_ok=True)
    assert isinstance(_as_reward(value), float)


@pytest.mark.parametrize(
    "value", ["1.0", b"1", [1.0], (1.0,), torch.tensor([1.0, 2.0]), np.array([1.0, 2.0]), Decimal("1.0"), 1j, {}]
)
def test_anything_else_is_not_a_reward(value):
    assert _as_reward(value) is None


def test_an_object_with_item_but_no_shape_is_not_a_reward():
    class Boxed:
        def item(self):
            return 1.0

    assert _as_reward(Boxed()) is None


@pytest.mark.parametrize(
    ("outputs", "match"),
    [
        ([1.0, -math.inf], r"returned -inf for completion 1"),
        ([torch.tensor([1.0, 2.0])], r"for completion 0: each reward must be a finite number"),
        ([Decimal("0.5")], r"Decimal\('0.5'\) for completion 0"),
        (
            (x for x in [1.0]),
            r"returned generator; it must return a list with one float \(or None\) per completion \(1 here\)",
        ),
        (None, r"returned NoneType"),
        (b"1", r"returned bytes"),
    ],
)
def test_more_garbage_is_named(outputs, match):
    def scorer(completions, **kwargs):
        return outputs

    with pytest.raises(ValueError, match=match):
        checked_reward_function(scorer)(completions=["x"])


def test_arguments_reach_the_function_and_tuples_pass():
    seen = {}

    def scorer(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, **kwargs)
        return (1.0, None)

    checked = checked_reward_function(scorer)
    assert checked(["p1", "p2"], completions=["a", "b"], answer=["1", "2"], trainer_state=7) == (1.0, None)
    assert seen == {"prompts": ["p1", "p2"], "completions": ["a", "b"], "answer": ["1", "2"], "trainer_state": 7}
    assert checked.__wrapped__ is scorer and checked.__doc__ == scorer.__doc__


def test_partials_keep_a_name_and_single_values_stay_single():
    def scaled(completions, scale, **kwargs):
        return [scale] * len(completions)

    wrapped = check_reward_functions([functools.partial(scaled, scale=2.0)])
    assert isinstance(wrapped, list) and len(wrapped) == 1
    assert wrapped[0](completions=["a"]) == [2.0]
    assert wrapped[0].__name__ == "scaled"  # TRL's name for a partial: its function's
    assert check_reward_functions(None) is None
    assert check_reward_functions("org/reward-model") == "org/reward-model"
    single = check_reward_functions(scaled)
    assert callable(single) and not isinstance(single, list) and single.__wrapped__ is scaled


def test_async_reward_functions_are_left_to_trl():
    async def async_reward(completions, **kwargs):
        return ["garbage"] * len(completions)

    assert check_reward_functions([async_reward]) == [async_reward]
    assert check_reward_functions(async_reward) is async_reward


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.parametrize(("weights", "funcs"), [([1.0, 2.0], _reward), ([1.0], [_reward, _reward]), ([1.0], None)])
def test_reward_weights_that_do_not_match_the_functions_are_named(weights, funcs):
    with pytest.raises(ValueError, match=r"DHPOConfig\.reward_weights="):
        check_reward_weights(weights, funcs)


def test_matching_reward_weights_pass():
    assert check_reward_weights([1.0, 0.5], [_reward, _reward]) is None
    assert check_reward_weights([2.0], _reward) is None
    assert check_reward_weights(None, [_reward, _reward]) is None


def test_the_trainer_refuses_mismatched_weights_before_loading_the_model(tmp_path):
    """TRL checks them after loading the policy (minutes for a large model): here the model path does not even exist."""
    args = DHPOConfig(str(tmp_path), reward_weights=[1.0, 2.0], use_cpu=True, bf16=False, report_to="none",
                      steps_per_generation=2)  # fmt: skip
    dataset = Dataset.from_list([{"prompt": "1+1="}] * 8)
    with pytest.raises(ValueError, match=r"DHPOConfig\.reward_weights="):
        DHPOTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=[_reward], args=args, train_dataset=dataset)
