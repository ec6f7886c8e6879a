"""Deterministic long-tailed completions for batching tests: a TRL `rollout_func`, a reward and prompts.

Runs that differ only in how micro-batches are cut see identical sequences, rewards and advantages.
"""

import random

from datasets import Dataset

MAX_COMPLETION = 40
# The off-policy run these tests train: two optimizer steps per generation batch (two micro-batches each), two
# generation batches, so steps 2 and 4 are off-policy; SGD at a large rate so that small gaps show in the weights.
OFF_POLICY_RUN = dict(
    per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2, steps_per_generation=4,
    max_completion_length=MAX_COMPLETION, max_steps=4, optim="sgd", learning_rate=0.5, mask_truncated_completions=True,
)  # fmt: skip


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
