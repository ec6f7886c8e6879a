"""Efficiency as behaviour: the largest forward pass of a dynamic-batching plan is the least any grouping reaches.

`batching.split_window` cuts one accumulation window into passes; each pass is trimmed to its own widest prompt and
completion (rounded up to `pad_to_multiple_of`, never past the window's width). Its padded tokens are
rows x (prompt columns + completion columns), read here off the tensors it returns. The optimum is found by brute
force over every partition of the rows into that many non-empty groups (not only contiguous runs of a sorted
order), with the widths computed here. Cases: lengths tied in one dimension and varied in the other (a sort key that
ignores one length misses the optimum), and widths already multiples of `pad_to_multiple_of` (rounding them up
again adds a padded block to every pass).
"""

import math

import pytest
import torch

from dhpo_trl.training import batching


def window(prompt_lengths, completion_lengths, prompt_width=None, completion_width=None):
    rows = len(prompt_lengths)
    prompt_width = prompt_width or max(prompt_lengths)
    completion_width = completion_width or max(completion_lengths)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    completion_mask = torch.zeros(rows, completion_width, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        prompt_mask[i, prompt_width - p :] = 1  # left-padded
        completion_mask[i, :c] = 1  # right-padded
    return {
        "prompt_ids": prompt_mask * 7, "prompt_mask": prompt_mask, "completion_ids": completion_mask * 9,
        "completion_mask": completion_mask, "advantages": torch.arange(rows, dtype=torch.float),
    }  # fmt: skip


def set_partitions(items, k):
    """Every partition of `items` into exactly k non-empty groups."""
    if k == 1:
        yield [list(items)]
        return
    if len(items) == k:
        yield [[item] for item in items]
        return
    if len(items) < k:
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest, k - 1):
        yield [[first], *partition]
    for partition in set_partitions(rest, k):
        for index in range(len(partition)):
            yield [*partition[:index], [first, *partition[index]], *partition[index + 1 :]]


def optimum_peak(prompts, completions, groups, multiple, prompt_width, completion_width):
    def width(span, limit):
        span = max(span, 1)
        return min(math.ceil(span / multiple) * multiple if multiple else span, limit)

    def area(group):
        return len(group) * (width(max(prompts[i] for i in group), prompt_width)
                             + width(max(completions[i] for i in group), completion_width))  # fmt: skip

    partitions = set_partitions(list(range(len(prompts))), groups)
    return min(max(area(group) for group in partition) for partition in partitions)


def planned_passes(batch, micro_steps, passes_per_step, multiple):
    steps = batching.split_window(batch, micro_steps, passes_per_step, pad_to_multiple_of=multiple)
    return [part for step in steps for part in (step if isinstance(step, list) else [step])]


CASES = {  # name: (prompt lengths, completion lengths, pad_to_multiple_of, window widths or None)
    "completions tied, prompts vary": ([9, 2, 8, 3, 9, 2, 7], [6] * 7, None, None),
    "prompts tied, completions vary": ([5] * 7, [12, 1, 11, 2, 12, 3, 1], None, None),
    "both vary, ties inside": ([9, 2, 9, 2, 5, 5, 9], [3, 3, 8, 8, 3, 8, 1], None, None),
    "aligned widths, multiple 4": ([8, 4, 8, 4, 4, 8], [12, 4, 8, 12, 4, 8], 4, (8, 12)),
    "aligned widths, multiple 8, ties": ([8, 8, 16, 8, 16, 8], [8, 16, 8, 8, 16, 8], 8, (16, 16)),
    "unaligned spans, multiple 4": ([5, 3, 7, 2, 6, 1], [9, 2, 5, 11, 3, 6], 4, (8, 12)),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("micro_steps, passes_per_step", [(2, 1), (3, 1), (2, 2)])
def test_peak_padded_tokens_equal_the_brute_force_optimum(name, micro_steps, passes_per_step):
    prompts, completions, multiple, widths = CASES[name]
    batch = window(prompts, completions, *(widths or (None, None)))
    parts = planned_passes(batch, micro_steps, passes_per_step, multiple)
    assert sorted(int(v) for p in parts for v in p["advantages"]) == list(range(len(prompts)))  # every row once
    peak = max(p["prompt_mask"].numel() + p["completion_mask"].numel() for p in parts)
    groups = micro_steps * passes_per_step
    assert peak == optimum_peak(prompts, completions, groups, multiple, batch["prompt_mask"].size(1),
                                batch["completion_mask"].size(1))  # fmt: skip


def test_an_aligned_width_is_not_rounded_up_again():
    """Every row already spans a multiple of 4: each pass is exactly as wide as its widest row."""
    batch = window([4, 8, 4, 8], [8, 4, 12, 4], 8, 12)
    for part in planned_passes(batch, 2, 1, 4):
        assert part["prompt_mask"].size(1) == int(part["prompt_mask"].sum(1).max())
        assert part["completion_mask"].size(1) == int(part["completion_mask"].sum(1).max())
