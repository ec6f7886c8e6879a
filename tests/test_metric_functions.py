"""`dhpo_trl.core.metrics`' pure functions and its one cross-process reduction, with a stand-in second process.

Expected values are written out by hand; the trainer-level metrics are in test_metrics.py."""

import math

import pytest
import torch

from dhpo_trl.core import metrics


class OtherProcess:
    """An `all_reduce(tensor, op)` with one other process holding `other` (a list in the same key order)."""

    def __init__(self, other):
        self.other, self.calls = other, []

    def __call__(self, tensor, op):
        self.calls.append(op)
        other = torch.as_tensor(self.other[op], dtype=tensor.dtype)
        return tensor + other if op == "sum" else torch.maximum(tensor, other)


def test_reduce_across_sums_and_maxes_in_one_collective_each():
    fake = OtherProcess({"sum": [10.0, 1.0], "max": [-0.5, 3.0]})
    sums, maxima = metrics.reduce_across(
        {"a": torch.tensor(2.0), "b": torch.tensor(3)}, {"-low": torch.tensor(-1.0), "high": torch.tensor(4.0)}, fake
    )
    assert sums == {"a": 12.0, "b": 4.0} and maxima == {"-low": -0.5, "high": 4.0}
    assert fake.calls == ["sum", "max"]
    assert metrics.reduce_across({}, {}, fake) == ({}, {}) and len(fake.calls) == 2  # nothing to reduce: no call


def test_entropy_range_spans_every_process_and_ignores_an_empty_one():
    entropies = torch.tensor([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    local = metrics.entropy_range_maxima(entropies, mask)
    assert {k: v.item() for k, v in local.items()} == {"-entropy_min": -1.0, "entropy_max": 4.0}
    _, maxima = metrics.reduce_across({}, local, OtherProcess({"max": [-0.5, 3.0]}))
    assert metrics.entropy_range(maxima) == (0.5, 4.0)
    empty = metrics.entropy_range_maxima(entropies, torch.zeros_like(mask))  # all padding: never drags the range
    _, maxima = metrics.reduce_across({}, empty, OtherProcess({"max": [-0.5, 3.0]}))
    assert metrics.entropy_range(maxima) == (0.5, 3.0)
    _, maxima = metrics.reduce_across({}, empty, metrics.local_all_reduce)  # no valid token anywhere: finite
    assert metrics.entropy_range(maxima) == (0.0, 0.0)


def test_padding_fraction_counts_every_process_tokens():
    # Here 8 real of 10 forwarded tokens, the other process 5 of 10: 1 - 13 / 20.
    sums, _ = metrics.reduce_across(metrics.padding_sums(8, 10), {}, OtherProcess({"sum": [5, 10]}))
    assert metrics.padding_fraction(sums) == pytest.approx(0.35)
    sums, _ = metrics.reduce_across(metrics.padding_sums(0, 0), {}, metrics.local_all_reduce)
    assert metrics.padding_fraction(sums) == 1.0  # nothing forwarded: no division by zero


def test_nan_mean_skips_nan_entries_over_processes():
    sums = metrics.nan_mean_sums("policy_loss", torch.tensor([0.5, float("nan"), 1.5]))
    assert {k: v.item() for k, v in sums.items()} == {"policy_loss": 2.0, "policy_loss_count": 2.0}
    reduced, _ = metrics.reduce_across(sums, {}, OtherProcess({"sum": [4.0, 1.0]}))
    assert metrics.nan_mean("policy_loss", reduced) == pytest.approx(2.0)
    assert math.isnan(metrics.nan_mean("x", {"x": 0.0, "x_count": 0.0}))


def test_loss_metrics_of_hand_made_ratios():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # one row of two tokens, one empty row
    info = {
        "abs_log_ratio": torch.tensor([[0.1, 0.3, 9.0], [9.0, 9.0, 9.0]]),
        "token_ratio": torch.tensor([[0.5, 1.5, 9.0], [9.0, 9.0, 9.0]]),
        "sequence_ratio": torch.tensor([1.2, 9.0]),
        "mixing_weight": torch.tensor([[0.2, 0.6, 9.0], [9.0, 9.0, 9.0]]),
        "clipped": torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]),
    }
    entropies = torch.tensor([[2.0, 4.0, 9.0], [9.0, 9.0, 9.0]])
    sums, maxima = metrics.loss_sums(info, entropies, mask, None, "p", (("clip_fraction", "clipped"),))
    reduced = metrics.reduce_across(sums, maxima, metrics.local_all_reduce)
    out = metrics.loss_metrics(*reduced, "p", (("clip_fraction", "clipped"),))
    assert out == pytest.approx({
        "entropy": 3.0, "off_policy/abs_log_ratio": 0.2,
        "p/token_ratio/mean": 1.0, "p/token_ratio/min": 0.5, "p/token_ratio/max": 1.5,
        "p/sequence_ratio/mean": 1.2, "p/sequence_ratio/min": 1.2, "p/sequence_ratio/max": 1.2,
        "p/mixing_weight/mean": 0.4, "p/mixing_weight/std": 0.2, "p/clip_fraction": 0.5,
    })  # fmt: skip
    # no valid token anywhere: NaN, never 0 or +-inf
    sums, maxima = metrics.loss_sums(info, entropies, torch.zeros_like(mask), None, "p")
    out = metrics.loss_metrics(*metrics.reduce_across(sums, maxima, metrics.local_all_reduce), "p")
    assert all(math.isnan(value) for value in out.values())


def test_cispo_clip_ratio_is_the_share_of_capped_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    info = {"clipped_high": torch.tensor([[True, False, True], [True, True, False]])}
    sums, maxima = metrics.clip_sums("cispo_clip_ratio", info, mask)
    out = metrics.clip_metrics("cispo_clip_ratio", *metrics.reduce_across(sums, maxima, metrics.local_all_reduce))
    assert out == {"cispo_clip_ratio": pytest.approx(3 / 5)}


def test_extremes_of_one_value_and_of_no_rows():
    """One valid value is its own min and max; a process with no rows sends -inf, so another's extremes win."""
    info = {"abs_log_ratio": torch.zeros(1, 1), "token_ratio": torch.tensor([[1.25]]), "sequence_ratio": torch.tensor([1.5])}
    sums, maxima = metrics.loss_sums(info, torch.zeros(1, 1), torch.ones(1, 1), None, "p")
    out = metrics.loss_metrics(*metrics.reduce_across(sums, maxima, metrics.local_all_reduce), "p")
    assert (out["p/token_ratio/min"], out["p/token_ratio/max"]) == (1.25, 1.25)
    assert (out["p/sequence_ratio/min"], out["p/sequence_ratio/max"]) == (1.5, 1.5)
    empty = {"clipped_low": torch.zeros(0, 3, dtype=torch.bool), "clipped_high": torch.zeros(0, 3, dtype=torch.bool)}
    sums, maxima = metrics.clip_sums("clip_ratio", empty, torch.zeros(0, 3))
    other = OtherProcess({"sum": [1.0, 2.0, 0.0, 2.0, 1.0, 2.0], "max": [-0.25, 0.5]})
    out = metrics.clip_metrics("clip_ratio", *metrics.reduce_across(sums, maxima, other))
    assert (out["clip_ratio/low_min"], out["clip_ratio/high_max"]) == (0.25, 0.5)


def test_one_token_shares_divide_by_one():
    info = {"clipped_high": torch.tensor([[True]])}
    sums, maxima = metrics.clip_sums("cispo_clip_ratio", info, torch.ones(1, 1))
    out = metrics.clip_metrics("cispo_clip_ratio", *metrics.reduce_across(sums, maxima, metrics.local_all_reduce))
    assert out == {"cispo_clip_ratio": 1.0}
    sums, _ = metrics.reduce_across(metrics.padding_sums(1, 1), {}, metrics.local_all_reduce)
    assert metrics.padding_fraction(sums) == 0.0


def test_within_sequence_spread_and_sequence_log_ratio_against_statistics():
    """std_t log r and |mean_t log r| per sequence, averaged over the sequences with a valid token; padding (9.0
    here) and the empty row count nowhere."""
    import statistics

    rows = [[0.1, -0.3, 0.5], [0.2, -0.6], []]
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    log_ratio = torch.tensor([[0.1, -0.3, 0.5], [0.2, -0.6, 9.0], [9.0, 9.0, 9.0]])
    info = {"abs_log_ratio": log_ratio.abs(), "log_ratio": log_ratio}
    sums, maxima = metrics.loss_sums(info, torch.zeros(3, 3), mask, None, None)
    out = metrics.loss_metrics(*metrics.reduce_across(sums, maxima, metrics.local_all_reduce), None)
    present = [r for r in rows if r]
    assert out["off_policy/log_ratio_spread"] == pytest.approx(statistics.fmean(statistics.pstdev(r) for r in present))
    assert out["off_policy/abs_sequence_log_ratio"] == pytest.approx(
        statistics.fmean(abs(statistics.fmean(r)) for r in present)
    )
