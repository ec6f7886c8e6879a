"""Dynamic batching through the real trainer: the same update as TRL's batching, with less padding.

Completions come from a deterministic `rollout_func` with long-tailed lengths (and one truncated completion that
`mask_truncated_completions` turns into an all-padding sequence), so runs with and without dynamic batching see
identical sequences, rewards and advantages. Plain SGD makes the parameter change a sum of the window gradients,
so a wrong normalisation of an unevenly filled micro-batch shows up at 1e-2 or more, while trimming left padding
(RoPE positions shift) only moves logits by float rounding.
"""

import random

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from dhpo_trl import DHPOConfig, DHPOTrainer, batching
from dhpo_trl.presets import config_for
from dhpo_trl.tiny import build_char_tokenizer, build_tiny_qwen3

CPU = dict(use_cpu=True, bf16=False, report_to="none", seed=0, data_seed=0, save_strategy="no", logging_steps=1)
MAX_COMPLETION = 40


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def long_tailed_rollout(tok, truncated_every=0):
    """Completions of deterministic, long-tailed lengths (most short, a few at MAX_COMPLETION), ending in EOS
    except every `truncated_every`-th one (cut at the maximum without EOS: a truncated completion)."""
    calls = []

    def rollout(prompts, trainer):
        prompt_ids, completion_ids = [], []
        for index, prompt in enumerate(prompts):
            rng = random.Random(f"{prompt}|{index % trainer.num_generations}|{len(calls)}")
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            length = min(MAX_COMPLETION, max(1, int(rng.lognormvariate(1.6, 0.9))))
            if rng.random() < 0.1:
                length = MAX_COMPLETION
            body = [rng.randint(3, len(tok) - 1) for _ in range(length - 1)]
            truncated = truncated_every and (len(completion_ids) + 1) % truncated_every == 0
            completion = body + [rng.randint(3, len(tok) - 1)] if truncated else body + [tok.eos_token_id]
            prompt_ids.append(ids)
            completion_ids.append(completion[:MAX_COMPLETION])
        calls.append(len(prompts))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout


def length_reward(completions, **kwargs):
    """Varies within a group: the completion's length and content, mod 7."""
    return [float((len(text) + sum(map(ord, text))) % 7) for text in completions]


def dataset(n=16):
    # prompts of varied length: left padding differs between micro-batches
    return Dataset.from_dict({"prompt": [f"{'x' * (a % 5)}{a}+{3 * a + 1}=" for a in range(n)]})


def parameter_change(tok, config, trainer_cls=DHPOTrainer, truncated_every=0):
    model = build_tiny_qwen3(tok, seed=0)
    start = [p.detach().clone() for p in model.parameters()]
    trainer = trainer_cls(
        model=model, reward_funcs=length_reward, args=config, train_dataset=dataset(),
        processing_class=tok, rollout_func=long_tailed_rollout(tok, truncated_every),
    )  # fmt: skip
    trainer.train()
    change = torch.cat([(p.detach() - s).flatten() for p, s in zip(model.parameters(), start, strict=True)])
    return change, trainer


def relative_gap(a, b):
    return ((a - b).norm() / b.norm()).item()


RUN = dict(
    per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2, steps_per_generation=4,
    max_completion_length=MAX_COMPLETION, max_steps=4, optim="sgd", learning_rate=0.5, mask_truncated_completions=True,
)  # fmt: skip


@pytest.mark.parametrize("row", ["GMPO", "DHPO-A"])
def test_rows_update_as_with_trl_batching(tok, row, tmp_path):
    base, _ = parameter_change(tok, config_for(row, output_dir=str(tmp_path), dynamic_batching=False, **RUN, **CPU),
                               truncated_every=5)  # fmt: skip
    dynamic, trainer = parameter_change(tok, config_for(row, output_dir=str(tmp_path), **RUN, **CPU), truncated_every=5)
    assert base.norm() > 1e-3  # the runs trained
    assert relative_gap(dynamic, base) < 1e-3
    padding = [entry["batching/padding_fraction"] for entry in trainer.state.log_history if "batching/padding_fraction" in entry]
    assert padding and all(0.0 <= value < 1.0 for value in padding)


def passes_of(trainer):
    """Every forward pass of the last planned generation batch (a micro-step may hold several)."""
    return [part for micro in trainer._buffered_inputs for part in (micro if isinstance(micro, list) else [micro])]


def area(part):
    return part["prompt_mask"].numel() + part["completion_mask"].numel()


def test_token_budget_splits_micro_steps_into_passes_with_the_same_update(tok, tmp_path):
    run = {**RUN, "num_iterations": 2}  # the planned passes are reused by the second iteration
    base, _ = parameter_change(tok, config_for("DHPO-A", output_dir=str(tmp_path), dynamic_batching=False, **run, **CPU))
    budget = 30  # below one long sequence (its prompt + 40 completion tokens): those get a pass of their own
    dynamic, trainer = parameter_change(
        tok, config_for("DHPO-A", output_dir=str(tmp_path), max_tokens_per_micro_batch=budget, **run, **CPU)
    )
    assert relative_gap(dynamic, base) < 1e-3
    steps = trainer._buffered_inputs
    assert any(isinstance(step, batching.Passes) and len(step) > 1 for step in steps)
    passes = passes_of(trainer)
    assert all(area(part) <= budget or part["completion_mask"].size(0) == 1 for part in passes)
    assert any(area(part) > budget for part in passes)  # a sequence much longer than the budget, alone, not cut
    assert sum(part["completion_mask"].size(0) for part in passes) == 16  # every row once
    for window in (steps[0:2], steps[2:4]):  # two optimizer steps of two micro-steps each
        window_passes = [part for micro in window for part in (micro if isinstance(micro, list) else [micro])]
        assert {part[batching.WINDOW_PASSES].item() for part in window_passes} == {len(window_passes)}
        assert {part[batching.WINDOW_SEQUENCES].item() for part in window_passes} == {8}


def test_equal_lengths_and_one_micro_batch_per_window(tok, tmp_path):
    def equal_rollout(prompts, trainer):
        ids = [tok(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
        completions = [[5 + (index % 7)] * 11 + [tok.eos_token_id] for index in range(len(prompts))]
        return {"prompt_ids": ids, "completion_ids": completions, "logprobs": None}

    def run(**overrides):
        model = build_tiny_qwen3(tok, seed=0)
        start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        config = config_for("GMPO", output_dir=str(tmp_path), **{**RUN, **overrides}, **CPU)
        trainer = DHPOTrainer(model=model, reward_funcs=length_reward, args=config, train_dataset=dataset(),
                              processing_class=tok, rollout_func=equal_rollout)  # fmt: skip
        trainer.train()
        return torch.cat([p.detach().flatten() for p in model.parameters()]) - start, trainer

    base, _ = run(dynamic_batching=False)
    dynamic, trainer = run()
    assert relative_gap(dynamic, base) < 1e-3
    assert [part["completion_mask"].shape for part in passes_of(trainer)] == [(4, 12)] * 4  # even split
    single_base, _ = run(dynamic_batching=False, gradient_accumulation_steps=1, steps_per_generation=2)
    single, _ = run(gradient_accumulation_steps=1, steps_per_generation=2)
    assert relative_gap(single, single_base) < 1e-3
