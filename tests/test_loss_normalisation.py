"""Each `loss_type`'s normalisation: the gradient of an accumulation window, and of an eval batch, against a hand
computation.

With token_weight = 1 and trust regions too wide to bind, the per-token loss is -A_i r_it, with
r_it = pi_theta / pi_old: the only thing left to check is how `loss_type` normalises it. The hand losses below
spell each normalisation out, written from TRL's documentation of the loss types, over a generation batch of four
micro-batches with ragged lengths, one all-padding row, and two micro-batches per optimizer step:
- grpo: mean over the micro-batch's responses of each response's token mean, divided by the accumulation steps;
- bnpo: the micro-batch's token mean, divided by the accumulation steps;
- dr_grpo: the micro-batch's token sum over (responses x max_completion_length), divided by the accumulation steps;
- dapo: the token mean over the whole accumulation window (its tokens counted from the generation batch).
In eval nothing is accumulated: each micro-batch's loss is its own normalised loss. `max_completion_length` (10)
differs from the batch width (6), which only dr_grpo may see.
"""

import pytest
import torch
from datasets import Dataset

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.core import aggregation
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3

PROMPT_LEN, WIDTH, MAX_COMPLETION_LENGTH = 4, 6, 10
ACCUMULATION, STEPS_PER_GENERATION = 2, 4
# four micro-batches of 3 responses; both accumulation windows hold 21 tokens
LENGTHS = [[6, 2, 4], [1, 5, 3], [3, 3, 5], [6, 4, 0]]
ADVANTAGES = [[1.0, -0.5, 0.7], [-1.2, 0.4, 0.9], [0.3, -0.8, 1.5], [-0.6, 1.1, 0.5]]
WIDE = {  # trust regions no ratio of this batch leaves
    "dhpo": dict(mixing="averaged", token_weight=1.0, epsilon_low_token=0.9, epsilon_high_token=10.0),
    "grpo": dict(epsilon=0.9, epsilon_high=10.0),
}


@pytest.fixture(scope="module")
def policy():
    return build_tiny_qwen3(build_char_tokenizer(), hidden_size=32, seed=5)


def forward_logps(model, batch):
    """Log-probs of the completion tokens, with gradient: a plain forward pass and log-softmax."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, PROMPT_LEN - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def micro_batches(policy):
    generator = torch.Generator().manual_seed(0)
    vocab = policy.config.vocab_size
    batches = []
    for lengths, advantages in zip(LENGTHS, ADVANTAGES, strict=True):
        mask = (torch.arange(WIDTH) < torch.tensor(lengths).unsqueeze(1)).long()
        batch = {
            "prompt_ids": torch.randint(3, vocab, (3, PROMPT_LEN), generator=generator),
            "prompt_mask": torch.ones(3, PROMPT_LEN, dtype=torch.long),
            "completion_ids": torch.randint(3, vocab, (3, WIDTH), generator=generator),
            "completion_mask": mask,
            "advantages": torch.tensor(advantages),
        }
        with torch.no_grad():
            logps = forward_logps(policy, batch)
        log_ratio = (torch.rand(3, WIDTH, generator=generator) - 0.5) * 0.3  # ratios in [0.86, 1.16]
        batch["old_per_token_logps"] = logps - torch.where(mask.bool(), log_ratio, torch.full_like(log_ratio, 9.0))
        batches.append(batch)
    generation_tokens = sum(sum(lengths) for lengths in LENGTHS)
    for batch in batches:  # as TRL sets it: the active tokens of the whole generation batch, all processes
        batch["num_items_in_batch"] = torch.tensor(generation_tokens)
    return batches


def hand_loss(model, batches, loss_type, accumulation):
    """The normalised loss of `batches` (one accumulation window, or one eval batch with accumulation=1)."""
    terms = []
    for batch in batches:
        mask = batch["completion_mask"].float()
        ratio = torch.exp(forward_logps(model, batch) - batch["old_per_token_logps"])
        per_token = -batch["advantages"].unsqueeze(1) * ratio * mask
        responses = mask.size(0)
        if loss_type == "grpo":
            terms.append(sum(per_token[i].sum() / max(mask[i].sum(), 1) for i in range(responses)) / responses)
        elif loss_type == "bnpo":
            terms.append(per_token.sum() / mask.sum())
        elif loss_type == "dr_grpo":
            terms.append(per_token.sum() / (responses * MAX_COMPLETION_LENGTH))
        else:
            terms.append(per_token.sum())
    if loss_type == "dapo":
        return sum(terms) / sum(batch["completion_mask"].sum() for batch in batches)
    return sum(terms) / accumulation


def gradient(model, loss_fn):
    model.zero_grad()
    loss_fn().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad()
    return grads


def make_trainer(policy, tmp_path, algorithm, loss_type):
    args = DHPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        algorithm=algorithm, loss_type=loss_type, per_device_train_batch_size=3, num_generations=3,
        gradient_accumulation_steps=ACCUMULATION, steps_per_generation=STEPS_PER_GENERATION,
        max_completion_length=MAX_COMPLETION_LENGTH, **WIDE[algorithm],
        dynamic_batching=loss_type != "bnpo",  # bnpo normalises per micro-batch: TRL's batching only
    )  # fmt: skip
    trainer = DHPOTrainer(
        policy, lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 12}), processing_class=build_char_tokenizer(),
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = ACCUMULATION
    return trainer


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("algorithm", ["dhpo", "grpo"])
def test_accumulation_window_gradient(algorithm, loss_type, policy, micro_batches, tmp_path):
    trainer = make_trainer(policy, tmp_path, algorithm, loss_type)
    policy.train()
    for window in (micro_batches[:2], micro_batches[2:]):
        ours = gradient(policy, lambda w=window: sum(trainer.compute_loss(policy, dict(b)) for b in w))
        expected = gradient(policy, lambda w=window: hand_loss(policy, w, loss_type, ACCUMULATION))
        assert expected.abs().max() > 1e-4
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("algorithm", ["dhpo", "grpo"])
def test_eval_batch_is_not_divided_for_accumulation(algorithm, loss_type, policy, micro_batches, tmp_path):
    trainer = make_trainer(policy, tmp_path, algorithm, loss_type)
    policy.eval()
    try:
        for batch in (micro_batches[0], micro_batches[3]):
            batch = dict(batch, num_items_in_batch=batch["completion_mask"].sum())  # eval: the batch is the whole
            with torch.no_grad():
                loss = trainer.compute_loss(policy, dict(batch))
                expected = hand_loss(policy, [batch], loss_type, accumulation=1)
            assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
            ours = gradient(policy, lambda b=batch: trainer.compute_loss(policy, dict(b)))
            torch.testing.assert_close(ours, gradient(policy, lambda b=batch: hand_loss(policy, [b], loss_type, 1)))
    finally:
        policy.train()


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_one_token_and_no_token_micro_batches(loss_type, policy, micro_batches, tmp_path):
    """The smallest denominators: one valid token in the whole micro-batch is its own mean; none gives 0, not NaN."""
    trainer = make_trainer(policy, tmp_path, "dhpo", loss_type)
    policy.eval()
    one = torch.zeros_like(micro_batches[0]["completion_mask"])
    one[1, 0] = 1
    batch = dict(micro_batches[0], completion_mask=one, num_items_in_batch=torch.tensor(1))
    with torch.no_grad():
        loss = trainer.compute_loss(policy, dict(batch))
        expected = hand_loss(policy, [batch], loss_type, accumulation=1)
        empty = dict(batch, completion_mask=torch.zeros_like(one), num_items_in_batch=torch.tensor(0))
        nothing = trainer.compute_loss(policy, dict(empty))
    assert expected.abs().item() > 1e-3
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert nothing.item() == 0.0


def test_dapo_on_two_processes_scales_so_that_their_average_is_the_window_mean():
    """`num_items_in_batch` counts the tokens of all processes; DDP averages the processes' gradients, so each
    process divides its token sum by the tokens per process, not by all of them (checked on the aggregation alone:
    one process stands in for two)."""
    per_token = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    items = torch.tensor(10)  # 5 tokens here, 5 on the other process
    token_sum = 0.5 - 1.0 + 1.5 + 0.25 - 0.75

    def dapo(share, passes):
        window = aggregation.fixed_slice_window(2, passes, aggregation.dapo_tokens(items, 2, share))
        return aggregation.aggregate("dapo", per_token, mask, window, max_completion_length=3).item()

    assert dapo(1.0, 1) == pytest.approx(token_sum / 5)  # evaluation: the whole batch
    # in training, one micro-step of the accumulation window: the window holds steps_per_generation / accumulation of
    # the generation batch that num_items_in_batch counts (and dapo never divides by the passes)
    expected = token_sum / (5 * ACCUMULATION / STEPS_PER_GENERATION)
    assert dapo(ACCUMULATION / STEPS_PER_GENERATION, ACCUMULATION) == pytest.approx(expected)
