"""`dhpo_trl.core.aggregation` on hand-made tensors: every expected value is written out by hand or summed in a naive
loop here, never recomputed with the module."""


import pytest
import torch

from dhpo_trl.core import aggregation
from dhpo_trl.core.aggregation import Window, aggregate, entropy_bonus

# Two rows of three columns; padding holds huge values, so any leak into a sum shows.
LOSS = torch.tensor([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]])
ENTROPIES = LOSS.clone()  # valid entropies 1, 2, 4: sum 7 over 3 tokens
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
HIGH = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])  # a top-entropy mask: with MASK, the entropies 1 and 4


def naive_row_means(loss, mask):
    means = []
    for row in range(loss.size(0)):
        values = [loss[row, col].item() for col in range(loss.size(1)) if mask[row, col] > 0]
        means.append(sum(values) / len(values) if values else 0.0)
    return means


# ------------------------------------------------------------------ TRL's fixed slices
def test_fixed_slices_divide_as_trl_for_accumulation():
    window = aggregation.fixed_slice_window(rows=2, passes=4, dapo=torch.tensor(6.0))
    assert (window.sequences, window.passes, window.tokens) == (8.0, 4.0, None)
    # grpo: (1.5 + 4) / 2 rows, then / 4 accumulation steps
    assert aggregate("grpo", LOSS, MASK, window, 3).item() == pytest.approx((1.5 + 4.0) / 2 / 4)
    # bnpo: token mean 7 / 3, / 4
    assert aggregate("bnpo", LOSS, MASK, window, 3).item() == pytest.approx(7 / 3 / 4)
    # dr_grpo: token sum / (2 rows x 5 columns), / 4
    assert aggregate("dr_grpo", LOSS, MASK, window, 5).item() == pytest.approx(7 / 10 / 4)
    # dapo: token sum over the dapo normaliser only (never divided by the passes)
    assert aggregate("dapo", LOSS, MASK, window, 3).item() == pytest.approx(7 / 6)


def test_dapo_normaliser_is_the_window_tokens_per_process():
    # 40 tokens in the generation batch over 2 processes; the window is 2 of 8 steps of it
    assert aggregation.dapo_tokens(torch.tensor(40), 2, 2 / 8).item() == pytest.approx(5.0)
    assert aggregation.dapo_tokens(torch.tensor(0), 1, 1.0).item() == 1.0  # an empty batch divides by 1


def test_unknown_aggregation_is_refused_naming_loss_type():
    window = aggregation.fixed_slice_window(2, 1, 1.0)
    with pytest.raises(ValueError, match="loss_type='sapo'"):
        aggregate("sapo", LOSS, MASK, window, 3)


def test_reported_policy_loss_is_undivided_except_dapo():
    window = aggregation.fixed_slice_window(2, 4, 1.0)
    loss = torch.tensor(0.25, requires_grad=True)
    assert aggregation.reported_policy_loss("grpo", loss, window).item() == 1.0
    assert aggregation.reported_policy_loss("dr_grpo", loss, window).item() == 1.0
    assert aggregation.reported_policy_loss("dapo", loss, window).item() == 0.25
    assert not aggregation.reported_policy_loss("grpo", loss, window).requires_grad


# ------------------------------------------------------------------ planned windows
def window_of_three():
    """Three rows of lengths 2, 1, 3 and their per-token losses."""
    loss = torch.tensor([[1.0, 3.0, 9.0], [2.0, 9.0, 9.0], [0.5, 1.5, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    return loss, mask


@pytest.mark.parametrize("groups", [[[0, 1, 2]], [[0], [1, 2]], [[2], [0], [1]]])
def test_planned_micro_batches_sum_to_the_window_loss_whatever_the_grouping(groups):
    loss, mask = window_of_three()
    window = aggregation.planned_window(mask, passes=len(groups), dapo=torch.tensor(6.0))
    assert (window.sequences, window.tokens, window.passes) == (3.0, 6.0, float(len(groups)))
    total = {name: 0.0 for name in ("grpo", "dr_grpo", "dapo")}
    bonus = 0.0
    for rows in groups:
        for name in total:
            total[name] += aggregate(name, loss[rows], mask[rows], window, 3).item()
        bonus += entropy_bonus(loss[rows], mask[rows], None, window).item()
    row_means = naive_row_means(loss, mask)  # 2, 2, 2
    token_sum = 1 + 3 + 2 + 0.5 + 1.5 + 4
    assert total["grpo"] == pytest.approx(sum(row_means) / 3)
    assert total["dr_grpo"] == pytest.approx(token_sum / (3 * 3))
    assert total["dapo"] == pytest.approx(token_sum / 6)
    assert bonus == pytest.approx(token_sum / 6)  # the window's token mean


def test_share_is_by_tokens_when_known_else_one_over_passes():
    assert Window(4.0, 4.0, None, 1.0).share(10) == 0.25
    assert Window(4.0, 4.0, 8.0, 1.0).share(2) == 0.25
    assert Window(4.0, 4.0, 0.0, 1.0).share(0) == 0.0  # an empty window divides by 1, not 0
    assert Window(1.0, 1.0, 1.0, 1.0).share(1) == 1.0  # a one-token window is all its micro-batch's


# ------------------------------------------------------------------ entropy bonus
def test_bonus_over_fixed_slices_is_the_masked_mean_divided_for_accumulation():
    window = aggregation.fixed_slice_window(2, 2, 1.0)
    assert entropy_bonus(ENTROPIES, MASK, None, window).item() == pytest.approx(7 / 3 / 2)
    eval_window = aggregation.fixed_slice_window(2, 1, 1.0)
    assert entropy_bonus(ENTROPIES, MASK, None, eval_window).item() == pytest.approx(7 / 3)


def test_entropy_mask_restricts_the_bonus_to_its_tokens():
    window = aggregation.fixed_slice_window(2, 1, 1.0)
    assert entropy_bonus(ENTROPIES, MASK, HIGH, window).item() == pytest.approx(2.5)


def test_planned_bonus_with_a_top_entropy_mask_is_the_mean_over_the_kept_tokens():
    """The defect of issue 26: over a planned window the bonus divided by all the window's tokens (5 / 3 here)
    where TRL divides by the entropy-masked ones (5 / 2)."""
    window = aggregation.planned_window(MASK, passes=1, dapo=1.0)  # the micro-batch is the whole window
    assert entropy_bonus(ENTROPIES, MASK, HIGH, window).item() == pytest.approx(2.5)
    # two micro-batches of the window: each its kept-token mean, weighted by its share of the window's tokens
    window = aggregation.planned_window(MASK, passes=2, dapo=1.0)
    first = entropy_bonus(ENTROPIES[:1], MASK[:1], HIGH[:1], window).item()  # kept: 1 (of 2 tokens)
    second = entropy_bonus(ENTROPIES[1:], MASK[1:], HIGH[1:], window).item()  # kept: 4 (of 1 token)
    assert (first, second) == (pytest.approx(1.0 * 2 / 3), pytest.approx(4.0 * 1 / 3))


def test_a_micro_batch_without_valid_tokens_adds_no_bonus():
    for window in (aggregation.fixed_slice_window(2, 1, 1.0), aggregation.planned_window(MASK, 1, 1.0)):
        assert entropy_bonus(ENTROPIES, torch.zeros_like(MASK), None, window).item() == 0.0


def test_dapo_without_num_items_is_refused_naming_it():
    window = aggregation.planned_window(MASK, 1, None)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        aggregate("dapo", LOSS, MASK, window, 3)
