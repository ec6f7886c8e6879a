"""`dhpo_trl.training.batching` on its own: spans from masks, the min-max partition, trimming, and window splitting."""

import itertools
import math
import random

import pytest
import torch

from dhpo_trl.training import batching
from dhpo_trl.training.batching import LengthPlan


def trl_batch(prompt_lengths, completion_lengths, prompt_width=None, completion_width=None, seed=0):
    """A batch laid out as TRL's `_generate_and_score_completions` returns it: left-padded prompts (pad id 0),
    right-padded completions, per-token tensors on the completion columns, per-row advantages."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(prompt_lengths)
    prompt_width = prompt_width or max(prompt_lengths)
    completion_width = completion_width or max(max(completion_lengths), 1)
    prompt_ids = torch.zeros(rows, prompt_width, dtype=torch.long)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    completion_ids = torch.zeros(rows, completion_width, dtype=torch.long)
    completion_mask = torch.zeros(rows, completion_width, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        if p:
            prompt_ids[row, prompt_width - p :] = torch.randint(1, 50, (p,), generator=generator)
            prompt_mask[row, prompt_width - p :] = 1
        completion_ids[row, :c] = torch.randint(1, 50, (c,), generator=generator)
        completion_mask[row, :c] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "old_per_token_logps": torch.randn(rows, completion_width, generator=generator) * completion_mask,
        "importance_sampling_ratio": torch.rand(rows, 1, generator=generator),
        "advantages": torch.randn(rows, generator=generator),
        "num_items_in_batch": completion_mask.sum(),
    }


def test_spans_read_left_and_right_padding_and_an_empty_completion():
    batch = trl_batch([3, 1, 5], [4, 0, 2], prompt_width=6, completion_width=7)
    assert batching.prompt_spans(batch["prompt_mask"]).tolist() == [3, 1, 5]
    assert batching.completion_spans(batch["completion_mask"]).tolist() == [4, 0, 2]
    # A hole inside a completion (e.g. a tool mask folded in) still counts up to the last real token.
    assert batching.completion_spans(torch.tensor([[1, 0, 1, 0, 0]])).tolist() == [3]


def largest_shared_area(plan: LengthPlan, bounds) -> int:
    """Largest area of a group of several rows (a row alone costs what it costs under any cut)."""
    return max([plan.area(start, end) for start, end in bounds if end - start > 1], default=0)


def brute_force_min_max(plan: LengthPlan, groups: int) -> int:
    rows = len(plan.order)
    cuts = itertools.combinations(range(1, rows), groups - 1)
    return min(largest_shared_area(plan, list(itertools.pairwise([0, *cut, rows]))) for cut in cuts)


@pytest.mark.parametrize("multiple", [None, 4])
def test_partition_is_exact_contiguous_and_optimal(multiple):
    rng = random.Random(multiple or 0)
    for _ in range(150):
        rows = rng.randint(1, 8)
        groups = rng.randint(1, rows)
        prompt = [rng.randint(1, 20) for _ in range(rows)]
        completion = [rng.choice([0, 1, 3, 7, 40, 200]) for _ in range(rows)]
        widths = (max(prompt) + 3, max(completion) + 3) if multiple else None
        plan = LengthPlan(prompt, completion, multiple, widths=widths)
        bounds = plan.partition(groups)
        assert len(bounds) == groups
        assert bounds[0][0] == 0 and bounds[-1][1] == rows
        assert all(end > start for start, end in bounds)
        assert all(left[1] == right[0] for left, right in zip(bounds, bounds[1:]))
        assert largest_shared_area(plan, bounds) == brute_force_min_max(plan, groups)
        # the peak area is the least any cut of the sorted rows reaches: its largest row, or the shared optimum
        largest_row = max(plan.area(row, row + 1) for row in range(rows))
        assert max(plan.area(start, end) for start, end in bounds) == max(largest_row, brute_force_min_max(plan, groups))


def test_area_counts_widths_with_floor_of_one_and_rounding():
    plan = LengthPlan([2, 5], [0, 6], pad_to_multiple_of=4, widths=(8, 8))
    # sorted: (c=0, p=2), (c=6, p=5); empty completion still keeps one logit, widths round up to 4, capped at 8
    assert plan.widths(0, 1) == (4, 4)
    assert plan.widths(0, 2) == (8, 8)
    assert plan.area(0, 2) == 2 * 16
    assert plan.widths(1, 2) == (8, 8)
    no_multiple = LengthPlan([2, 5], [0, 6])
    assert no_multiple.widths(0, 1) == (2, 1)
    assert no_multiple.area(0, 2) == 2 * (5 + 6)


def test_a_one_token_prompt_or_completion_keeps_one_column():
    # a BOS-only prompt and a one-token completion: the floor of one column never widens them
    plan = LengthPlan([1, 3], [1, 5])
    assert plan.widths(0, 1) == (1, 1) and plan.area(0, 1) == 2
    # nor does rounding to a multiple past a one-column batch
    assert LengthPlan([1, 1], [1, 1], pad_to_multiple_of=8, widths=(1, 1)).widths(0, 2) == (1, 1)


def test_partition_halves_the_group_with_most_rows_when_the_cheapest_cut_falls_short():
    # sorted (completion, prompt): (0, 4), (1, 2), (2, 1), (2, 2), (2, 2). Caps up to 7 cut them into 5 groups and
    # cap 8 into 3, so 4 groups come from halving a 2-row group of cap 8's cut, never from splitting a lone row.
    plan = LengthPlan([2, 1, 4, 2, 2], [2, 2, 0, 2, 1])
    assert plan.greedy(7) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert plan.greedy(8) == [(0, 1), (1, 3), (3, 5)]
    assert plan.partition(4) == [(0, 1), (1, 2), (2, 3), (3, 5)]


def test_groups_needed_under_a_budget_and_rows_longer_than_it():
    # four rows of area 10 each (prompt 2 + completion 8) and one of 102: budget 25 holds two short rows per pass
    plan = LengthPlan([2, 2, 2, 2, 2], [8, 8, 8, 8, 100])
    assert plan.groups_needed(25) == 3  # [short, short], [short, short], [long alone, above the budget]
    assert plan.greedy(25) == [(0, 2), (2, 4), (4, 5)]
    assert plan.groups_needed(40) == 2
    assert plan.groups_needed(10) == 5
    assert plan.groups_needed(10**6) == 1


def test_partition_refuses_more_groups_than_rows():
    with pytest.raises(ValueError, match="3 rows into 4"):
        LengthPlan([1, 1, 1], [1, 1, 1]).partition(4)


def test_take_trims_each_key_by_its_alignment():
    batch = trl_batch([2, 6, 3], [5, 1, 9], prompt_width=7, completion_width=11)
    batch["tool_mask"] = torch.ones(3, 11, dtype=torch.long)
    batch["custom_per_row"] = torch.arange(3)
    sub = batching.take(batch, [2, 0], prompt_width=3, completion_width=9)
    assert sub["prompt_ids"].shape == (2, 3) and sub["completion_ids"].shape == (2, 9)
    assert torch.equal(sub["prompt_ids"], batch["prompt_ids"][[2, 0], 4:])
    assert torch.equal(sub["completion_mask"], batch["completion_mask"][[2, 0], :9])
    assert torch.equal(sub["old_per_token_logps"], batch["old_per_token_logps"][[2, 0], :9])
    assert sub["tool_mask"].shape == (2, 9)
    assert torch.equal(sub["advantages"], batch["advantages"][[2, 0]])
    assert torch.equal(sub["importance_sampling_ratio"], batch["importance_sampling_ratio"][[2, 0]])
    assert torch.equal(sub["custom_per_row"], torch.tensor([2, 0]))
    assert sub["num_items_in_batch"] is batch["num_items_in_batch"]
    # nothing real was cut: the kept columns hold every real token of the chosen rows
    assert sub["prompt_mask"].sum() == 5 and sub["completion_mask"].sum() == 14


def test_take_when_prompt_and_completion_widths_coincide():
    batch = trl_batch([1, 4], [4, 2], prompt_width=4, completion_width=4)
    sub = batching.take(batch, [0, 1], prompt_width=4, completion_width=4)
    assert torch.equal(sub["prompt_mask"], batch["prompt_mask"])
    sub = batching.take(batch, [0], prompt_width=1, completion_width=4)
    assert sub["prompt_mask"].tolist() == [[1]] and sub["completion_mask"].tolist() == [[1, 1, 1, 1]]


def test_unsupported_batches_are_named():
    batch = trl_batch([1], [1])
    assert batching.unsupported_reason(batch) is None
    assert "pixel_values" in batching.unsupported_reason({**batch, "pixel_values": torch.zeros(1, 3)})
    assert "num_images" in batching.unsupported_reason({**batch, "num_images": [1]})
    assert "extra" in batching.unsupported_reason({**batch, "extra": [1]})
    assert batching.unsupported_reason({**batch, "pixel_values": None}) is None


def rows_of(batch):
    """(prompt tokens, completion tokens, advantage) of every row, padding stripped: order-free content."""
    out = []
    for row in range(batch["completion_mask"].size(0)):
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        completion = batch["completion_ids"][row][batch["completion_mask"][row].bool()].tolist()
        out.append((tuple(prompt), tuple(completion), round(float(batch["advantages"][row]), 6)))
    return sorted(out)


@pytest.mark.parametrize("passes", [1, 3])
def test_split_window_keeps_every_row_once_and_carries_window_normalisers(passes):
    rng = random.Random(passes)
    prompts = [rng.randint(3, 12) for _ in range(16)]
    completions = [min(64, int(rng.lognormvariate(2.0, 1.0))) for _ in range(15)] + [64]
    window = trl_batch(prompts, completions, completion_width=64)
    window["completion_mask"][3] = 0  # an all-padding sequence (e.g. a masked truncated completion)
    steps = batching.split_window(window, micro_steps=4, passes_per_step=passes)
    assert len(steps) == 4
    flat = [part for step in steps for part in (step if passes > 1 else [step])]
    assert all(isinstance(step, batching.Passes) == (passes > 1) for step in steps)
    assert len(flat) == 4 * passes
    assert sorted(row for part in flat for row in rows_of(part)) == rows_of(window)
    for part in flat:
        assert part[batching.WINDOW].sequences == 16
        assert part[batching.WINDOW].tokens == window["completion_mask"].sum().item()
        assert part[batching.WINDOW].passes == 4 * passes
        # trimmed to its own longest prompt and completion (at least one column each)
        assert part["prompt_mask"][:, 0].any()
        assert part["completion_mask"][:, -1].any() or part["completion_mask"].size(1) == 1
    assert batching.padded_fraction([trl_batch([2, 3], [1, 4], prompt_width=3, completion_width=4)]) == (10, 14)
    real, forwarded = batching.padded_fraction(flat)
    real_trl, forwarded_trl = batching.padded_fraction([window])
    assert real == real_trl and forwarded < forwarded_trl


def test_split_window_balances_a_long_tail():
    # 15 short rows and one at the maximum: TRL pads every micro-batch of 4 to 64 completion columns.
    window = trl_batch([4] * 16, [6] * 15 + [64], completion_width=64)
    steps = batching.split_window(window, micro_steps=4)
    areas = [step["prompt_mask"].numel() + step["completion_mask"].numel() for step in steps]
    # the long row goes alone (1 x 68 columns); the 15 short ones (4 + 6 columns) share the other three
    long_step = next(step for step in steps if step["completion_mask"].size(1) == 64)
    assert long_step["completion_mask"].size(0) == 1
    assert max(areas) == 68 and sum(areas) == 68 + 15 * 10  # TRL forwards 16 x 68 = 1088


def test_concat_restores_row_tensors_and_shares_scalars():
    a, b = trl_batch([2, 3], [1, 4], prompt_width=3, completion_width=4), trl_batch([1], [2], 3, 4, seed=1)
    joined = batching.concat([a, b])
    assert joined["prompt_ids"].shape == (3, 3)
    assert torch.equal(joined["advantages"], torch.cat([a["advantages"], b["advantages"]]))
    assert joined["num_items_in_batch"] is a["num_items_in_batch"]


def test_unsupported_reason_names_the_value_type():
    assert batching.unsupported_reason({"extra": [1]}) == "the batch holds a non-tensor value `extra` (list)"


def test_forward_plan_rounds_widths_to_the_multiple_but_never_past_the_batch():
    # prompt spans 3 and 5 of a 6-column prompt, completion spans 2 and 7 of a 9-column completion
    prompt = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    completion = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0, 0]])
    plan = batching.forward_plan(torch.cat([prompt, completion], dim=1), logits_to_keep=9, pad_to_multiple_of=4)
    assert plan.widths(0, 1) == (4, 4)  # 3 -> 4 and 2 -> 4
    assert plan.widths(0, 2) == (6, 8)  # 5 -> 8 capped at the prompt's 6 columns; 7 -> 8 within the 9
    assert batching.forward_plan(torch.cat([prompt, completion], dim=1), logits_to_keep=9).widths(0, 2) == (5, 7)


def test_plan_for_rounds_widths_to_the_multiple_within_the_batch():
    batch = {"prompt_mask": torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]]),
             "completion_mask": torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0, 0]])}  # fmt: skip
    assert batching.plan_for(batch, pad_to_multiple_of=4).widths(0, 2) == (6, 8)
    assert batching.plan_for(batch).widths(0, 2) == (5, 7)


def test_loss_mask_multiplies_the_tool_mask_in():
    mask = torch.tensor([[1, 1, 1, 0]])
    tool = torch.tensor([[1, 0, 1, 0]])  # tool-output tokens (0) do not count, as in TRL
    assert batching.loss_mask({"completion_mask": mask, "tool_mask": tool}).tolist() == [[1, 0, 1, 0]]
    assert batching.loss_mask({"completion_mask": mask, "tool_mask": None}).tolist() == [[1, 1, 1, 0]]


def test_split_window_pads_each_micro_batch_to_the_multiple():
    batch = {"prompt_mask": torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]]),
             "prompt_ids": torch.arange(12).reshape(2, 6),
             "completion_mask": torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0, 0]]),
             "completion_ids": torch.arange(18).reshape(2, 9)}  # fmt: skip
    short, long = batching.split_window(batch, micro_steps=2, pad_to_multiple_of=4)
    assert short["prompt_ids"].shape == (1, 4) and short["completion_ids"].shape == (1, 4)  # 3 -> 4, 2 -> 4
    assert long["prompt_ids"].shape == (1, 6) and long["completion_ids"].shape == (1, 8)  # 5 -> 8 capped at 6; 7 -> 8
    assert short["prompt_ids"].tolist() == [[2, 3, 4, 5]]  # left-trimmed prompt keeps its last columns


def test_spans_of_an_empty_prompt_and_an_empty_selection():
    assert batching.prompt_spans(torch.zeros(2, 0, dtype=torch.long)).tolist() == [0, 0]
    assert batching.completion_spans(torch.zeros(2, 0, dtype=torch.long)).tolist() == [0, 0]  # one span per row
    assert LengthPlan([], []).greedy(10) == []  # no rows, no group (not one empty group)
    batch = {"prompt_mask": torch.ones(2, 3, dtype=torch.long), "completion_mask": torch.ones(2, 4, dtype=torch.long)}
    empty = batching.take(batch, [], 3, 4)
    assert empty["prompt_mask"].shape == (0, 3) and empty["completion_mask"].shape == (0, 4)


# ------------------------------------------------------------------------------ the packing plan (padding_free)
def check_rows(rows, lengths, count, budget):
    assert len(rows) == count and all(rows)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))  # every sequence exactly once
    for row in rows:
        assert len(row) == 1 or budget is None or sum(lengths[i] for i in row) <= budget


@pytest.mark.parametrize("seed", range(40))
def test_plan_rows_properties(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(1, 30), rng.randint(1, 300)]) for _ in range(rng.randint(1, 40))]
    budget = rng.choice([None, 1, rng.randint(20, 200), 10_000])
    needed = batching.rows_needed(lengths, budget)
    for count in sorted({needed, min(len(lengths), needed + rng.randint(0, 5)), len(lengths)}):
        check_rows(batching.plan_rows(lengths, count, budget), lengths, count, budget)
    if budget is not None:  # first-fit-decreasing: no two of its rows would fit together
        rows = batching.first_fit_decreasing(lengths, budget)
        loads = sorted(sum(lengths[i] for i in row) for row in rows)
        assert len(loads) < 2 or loads[0] + loads[1] > budget
        with pytest.raises(ValueError, match="rows are needed"):
            if needed > 1:
                batching.plan_rows(lengths, needed - 1, budget)
            else:
                raise ValueError("rows are needed")
    with pytest.raises(ValueError, match="cannot pack"):
        batching.plan_rows(lengths, len(lengths) + 1, budget)


def test_plan_rows_examples():
    # a sequence above the budget gets a row of its own; the rest fill rows up to the budget
    assert batching.first_fit_decreasing([50, 10, 200, 30, 20], 60) == [[2], [0, 1], [3, 4]]
    assert batching.rows_needed([50, 10, 200, 30, 20], 60) == 3
    assert batching.rows_needed([50, 10, 200, 30, 20], None) == 1
    # without a budget, balanced rows: 4 sequences of 10 and one of 40 in two rows -> 40 | 40
    rows = batching.plan_rows([10, 10, 40, 10, 10], 2)
    assert sorted(sum([10, 10, 40, 10, 10][i] for i in row) for row in rows) == [40, 40]
    # balanced rows that break the budget fall back to first-fit-decreasing, then split to the count
    rows = batching.plan_rows([6, 5, 5, 4], 3, budget=10)
    check_rows(rows, [6, 5, 5, 4], 3, 10)


@pytest.mark.parametrize("seed", range(20))
def test_plan_windows_same_forwards_on_every_process_and_no_cross_window_rows(seed):
    rng = random.Random(seed)
    micro_steps, windows, per_window = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 4)
    budget = rng.choice([None, rng.randint(30, 400)])
    processes = [[[rng.randint(1, 200) for _ in range(per_window * micro_steps)] for _ in range(windows)]
                 for _ in range(3)]  # fmt: skip
    needed = [[batching.rows_needed(window, budget) for window in process] for process in processes]
    calls = []

    def agree(values):  # the element-wise max over the three simulated processes
        calls.append(values)
        return [max(column) for column in zip(*needed, strict=True)]

    plans = [batching.plan_windows(process, micro_steps, budget, agree) for process in processes]
    assert len(calls) == (0 if budget is None else 3)  # one agreement per generation batch and process
    for process, plan in zip(processes, plans, strict=True):
        assert len(plan) == windows
        for lengths, steps in zip(process, plan, strict=True):
            assert len(steps) == micro_steps
            rows = [row for step in steps for row in step]
            check_rows(rows, lengths, len(rows), budget)  # indices are the window's own: no row crosses windows
    forwards = [[[len(step) for step in steps] for steps in plan] for plan in plans]
    assert forwards[0] == forwards[1] == forwards[2]  # the same forwards per micro-step on every process
    if budget is None:  # TRL's one forward per micro-step
        assert all(count == 1 for window in forwards[0] for count in window)


@pytest.mark.parametrize("budget", [None, 40])
def test_packed_generation_batch_keeps_each_window_its_sequences_once_in_rows_within_the_budget(budget):
    rng = random.Random(7)
    buffered = [trl_batch([rng.randint(2, 12) for _ in range(4)], [rng.choice([0, 3, 9, 30]) for _ in range(4)],
                          prompt_width=12, completion_width=30, seed=seed) for seed in range(4)]  # fmt: skip
    asked = []

    def agree(counts):  # another process needs one more row in the first window
        asked.append(list(counts))
        return [counts[0] + 1, *counts[1:]]

    steps = batching.plan_packed_generation_batch(buffered, 2, budget, agree)
    assert asked == ([] if budget is None else [[batching.rows_needed(batching.token_counts(
        w["prompt_mask"], w["completion_mask"]), budget) for w in (batching.concat(buffered[:2]),
                                                                   batching.concat(buffered[2:]))]])  # fmt: skip
    assert len(steps) == 4  # micro-steps: 2 windows x 2 accumulation steps
    for index, window in enumerate((batching.concat(buffered[:2]), batching.concat(buffered[2:]))):
        parts = [p for step in steps[2 * index : 2 * index + 2] for p in (step if isinstance(step, list) else [step])]
        assert sorted(row for part in parts for row in rows_of(part)) == rows_of(window)  # each sequence once
        agreed = None if budget is None else asked[0][index] + (index == 0)  # what `agree` answered
        assert len(parts) == (2 if budget is None else 2 * math.ceil(agreed / 2))  # a multiple of the micro-steps
        for part in parts:
            assert part[batching.WINDOW].passes == len(parts) and part[batching.WINDOW].sequences == 8
            assert part["prompt_mask"][:, 0].any()  # trimmed to its own widest prompt
            tokens = sum(batching.token_counts(part["prompt_mask"], part["completion_mask"]))
            assert budget is None or tokens <= budget or part["completion_mask"].size(0) == 1
    real = sum(max(1, int(b["prompt_mask"][r].sum() + b["completion_mask"][r].sum())) for b in buffered
               for r in range(4))  # fmt: skip
    assert batching.packed_fraction(batching.forward_passes(steps)) == (real, real)
