"""Dynamic batching: length-sorted, trimmed micro-batches inside each gradient-accumulation window.

TRL pads every completion of a generation batch to the longest one, then slices that padded tensor into
micro-batches of `per_device_train_batch_size` rows. With long-tailed RLVR lengths most of every forward and
backward is padding. This module re-cuts the work without changing the update:

* which sequences form an optimizer step never changes: rows move only inside one process's accumulation window
  (the `gradient_accumulation_steps` micro-batches of one optimizer step);
* the window's rows are sorted by length and cut into contiguous groups whose largest padded area
  (rows x (prompt width + completion width)) is as small as possible, each group trimmed to its own longest
  prompt (prompts are left-padded) and completion (right-padded);
* every process runs the same number of forward passes (ZeRO-3 gathers parameters inside every forward, DDP
  syncs buffers): one per micro-step as in TRL, or, under a token budget, a number agreed across processes.

With `padding_free`, the same windows are cut into rows of whole sequences instead (the packing plan, at the end:
first-fit-decreasing under a real-token budget, balanced rows otherwise); `packing.py` runs them.

Everything here is a pure function of the tensors TRL's `_generate_and_score_completions` returns. Lengths come
from `prompt_mask` and `completion_mask` only; any other tensor is carried along by its shape, so a subclass or
a TRL update that adds per-row or per-token keys keeps working.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..core import metrics
from ..core.aggregation import dapo_tokens, planned_window

PROMPT_KEYS = ("prompt_ids", "prompt_mask")
# Multimodal inputs index images/tiles, not rows, and `token_type_ids` spans prompt + completion: such batches are
# left as TRL cut them.
UNSUPPORTED_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip
# The `dhpo_trl.core.aggregation.Window` of the accumulation window, attached to every micro-batch cut from it: the loss
# of a micro-batch is its share of the window's loss, whatever the number of rows it holds.
WINDOW = "dhpo_window"


class Passes(list):
    """The forward/backward passes of one micro-step, when a token budget splits it into several."""


def unsupported_reason(batch: dict) -> str | None:
    """Why `batch` cannot be regrouped (multimodal inputs, non-tensor values), or None."""
    for key, value in batch.items():
        if key in UNSUPPORTED_KEYS and value is not None:
            return f"the batch holds multimodal input `{key}`"
        if value is not None and not isinstance(value, torch.Tensor):
            return f"the batch holds a non-tensor value `{key}` ({type(value).__name__})"
    return None


def prompt_spans(prompt_mask: torch.Tensor) -> torch.Tensor:
    """Columns each left-padded prompt needs: from its first real token to the end. Shape (B,)."""
    width = prompt_mask.size(1)
    from_end = torch.arange(width, 0, -1, device=prompt_mask.device)  # width, ..., 1
    return (prompt_mask.bool() * from_end).amax(-1) if width else prompt_mask.new_zeros(prompt_mask.size(0))


def completion_spans(completion_mask: torch.Tensor) -> torch.Tensor:
    """Columns each right-padded completion needs: up to its last real token (0 if it has none). Shape (B,)."""
    width = completion_mask.size(1)
    position = torch.arange(1, width + 1, device=completion_mask.device)
    return (completion_mask.bool() * position).amax(-1) if width else completion_mask.new_zeros(completion_mask.size(0))


def _round_up(width: int, multiple: int | None, limit: int) -> int:
    if multiple:
        width = math.ceil(width / multiple) * multiple
    return min(width, limit)


class LengthPlan:
    """Rows of one batch sorted by length, and the cheapest ways to cut them into contiguous groups.

    `prompt` and `completion` are the per-row spans. A group costs its padded area: rows x (widest prompt + widest
    completion), each width at least 1 column (a forward needs one prompt token and keeps at least one logit) and
    rounded up to `pad_to_multiple_of` as TRL pads, never past the batch's own width.
    """

    def __init__(self, prompt: list[int], completion: list[int], pad_to_multiple_of: int | None = None,
                 widths: tuple[int, int] | None = None):  # fmt: skip
        self.order = sorted(range(len(prompt)), key=lambda row: (completion[row], prompt[row]))
        self.prompt = [prompt[row] for row in self.order]
        self.completion = [completion[row] for row in self.order]  # ascending
        self.multiple = pad_to_multiple_of
        # Widths never exceed the batch's own (already padded to the multiple); default: the longest spans.
        widths = widths or (max(prompt, default=1), max(completion, default=1))
        self.prompt_limit, self.completion_limit = max(widths[0], 1), max(widths[1], 1)

    def widths(self, start: int, end: int) -> tuple[int, int]:
        """(prompt width, completion width) of the sorted rows [start, end)."""
        return self._widths(max(self.prompt[start:end]), self.completion[end - 1])

    def _widths(self, prompt: int, completion: int) -> tuple[int, int]:
        return (
            _round_up(max(prompt, 1), self.multiple, self.prompt_limit),
            _round_up(max(completion, 1), self.multiple, self.completion_limit),
        )

    def area(self, start: int, end: int) -> int:
        return (end - start) * sum(self.widths(start, end))

    def greedy(self, cap: int) -> list[tuple[int, int]]:
        """The fewest contiguous groups with area <= cap, as (start, end); a row alone above cap is its own group."""
        bounds, start, widest = [], 0, 0
        for row in range(len(self.order)):
            candidate = max(widest, self.prompt[row])
            if row > start and (row + 1 - start) * sum(self._widths(candidate, self.completion[row])) > cap:
                bounds.append((start, row))
                start, candidate = row, self.prompt[row]
            widest = candidate
        return [*bounds, (start, len(self.order))] if self.order else []

    def groups_needed(self, budget: int) -> int:
        """How many passes keep every pass within `budget` padded tokens (rows longer than it go alone)."""
        return len(self.greedy(budget))

    def partition(self, num_groups: int) -> list[tuple[int, int]]:
        """`num_groups` non-empty contiguous groups (start, end) of the sorted rows, the largest group of several
        rows as small as possible (a row that is larger on its own is a group of its own).

        A run's area only grows when it is extended, so the greedy cut gives the fewest groups under a cap, and a
        binary search finds the smallest cap that needs at most `num_groups` groups. The peak area is then the
        larger of that cap and the largest row, the least any cut can reach. Groups still missing are made by
        halving the group with most rows, which never raises an area. Under a token budget, `num_groups` is at
        least `groups_needed(budget)`, so every group of several rows fits the budget.
        """
        rows = len(self.order)
        if not 1 <= num_groups <= rows:
            raise ValueError(f"cannot cut {rows} rows into {num_groups} non-empty groups")
        low, high = 0, self.area(0, rows)
        while low < high:
            middle = (low + high) // 2
            if len(self.greedy(middle)) <= num_groups:
                high = middle
            else:
                low = middle + 1
        bounds = self.greedy(low)
        while len(bounds) < num_groups:
            widest = max(range(len(bounds)), key=lambda index: bounds[index][1] - bounds[index][0])
            start, end = bounds[widest]
            bounds[widest : widest + 1] = [(start, (start + end) // 2), ((start + end) // 2, end)]
        return bounds

    def rows(self, start: int, end: int) -> list[int]:
        """Original row indices of the sorted rows [start, end)."""
        return self.order[start:end]


def plan_for(batch: dict, pad_to_multiple_of: int | None = None) -> LengthPlan:
    """The `LengthPlan` of a TRL batch dict (`prompt_mask` left-padded, `completion_mask` right-padded)."""
    return LengthPlan(
        prompt_spans(batch["prompt_mask"]).tolist(), completion_spans(batch["completion_mask"]).tolist(),
        pad_to_multiple_of, widths=(batch["prompt_mask"].size(1), batch["completion_mask"].size(1)),
    )


def forward_plan(attention_mask: torch.Tensor, logits_to_keep: int, pad_to_multiple_of: int | None = None) -> LengthPlan:
    """The `LengthPlan` of a (B, prompt + completion) attention mask whose last `logits_to_keep` columns are the
    completions, as TRL passes it to `_get_per_token_logps_and_entropies`."""
    prompt_width = attention_mask.size(1) - logits_to_keep
    return LengthPlan(
        prompt_spans(attention_mask[:, :prompt_width]).tolist(),
        completion_spans(attention_mask[:, prompt_width:]).tolist(),
        pad_to_multiple_of, widths=(prompt_width, logits_to_keep),
    )


def take(batch: dict, rows: list[int], prompt_width: int, completion_width: int) -> dict:
    """The sub-batch of `rows`, trimmed to `prompt_width` (left) and `completion_width` (right) columns.

    Keys are carried by shape: `prompt_ids`/`prompt_mask` are prompt-aligned; any other tensor with a row
    dimension and as many columns as `completion_mask` is completion-aligned (ids, masks, old/ref/sampling
    log-probs, vLLM importance ratios, tool masks); other row tensors ((B,) advantages, (B, 1) ratios) are
    indexed by row; 0-dim tensors (`num_items_in_batch`) and non-tensors (the `WINDOW`) are shared.
    """
    num_rows = batch["completion_mask"].size(0)
    completion_columns = batch["completion_mask"].size(1)
    index = torch.as_tensor(rows, dtype=torch.long, device=batch["completion_mask"].device)
    out = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.size(0) != num_rows:
            out[key] = value
            continue
        value = value.index_select(0, index)
        if key in PROMPT_KEYS:
            value = value[:, value.size(1) - prompt_width :]
        elif value.dim() >= 2 and value.size(1) == completion_columns:
            value = value[:, :completion_width]
        out[key] = value
    return out


def concat(batches: list[dict]) -> dict:
    """Row-wise concatenation of batches cut from one padded batch (same widths); 0-dim tensors are shared."""
    first = batches[0]
    out = {}
    for key, value in first.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            out[key] = torch.cat([batch[key] for batch in batches], dim=0)
        else:
            out[key] = value
    return out


def loss_mask(batch: dict) -> torch.Tensor:
    """The tokens that count in the loss: `completion_mask`, times `tool_mask` when present (as TRL)."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if batch.get("tool_mask") is not None else mask


def planned_windows(num_processes: int = 1, accumulation_share: float = 1.0) -> Callable:
    """`window_of(window, passes)` for `split_window`: the window's rows, loss tokens and passes, and TRL's dapo
    normaliser from its `num_items_in_batch` (`accumulation_share`: gradient_accumulation_steps /
    steps_per_generation in training)."""

    def window_of(window: dict, passes: int):
        items = window.get("num_items_in_batch")
        dapo = None if items is None else dapo_tokens(items, num_processes, accumulation_share)
        return planned_window(loss_mask(window), passes, dapo)

    return window_of


def split_window(window: dict, micro_steps: int, passes_per_step: int = 1, plan: LengthPlan | None = None,
                 pad_to_multiple_of: int | None = None, window_of: Callable | None = None) -> list[dict | Passes]:  # fmt: skip
    """Cut one accumulation window into `micro_steps` micro-batches of `passes_per_step` trimmed passes each.

    Every pass carries `window_of(window, total passes)` under `WINDOW` (default: `planned_windows()`, one
    process). A micro-step with one pass is a plain dict (what TRL's `training_step` expects), otherwise a
    `Passes` list.
    """
    plan = plan or plan_for(window, pad_to_multiple_of)
    total_passes = micro_steps * passes_per_step
    groups = plan.partition(total_passes)
    window_of = window_of or planned_windows()
    shared = {WINDOW: window_of(window, total_passes)}
    passes = [{**take(window, plan.rows(start, end), *plan.widths(start, end)), **shared} for start, end in groups]
    steps = [passes[step * passes_per_step : (step + 1) * passes_per_step] for step in range(micro_steps)]
    return [step[0] if passes_per_step == 1 else Passes(step) for step in steps]


def _alone(values: list[int]) -> list[int]:
    return values


def windows(buffered: list[dict], micro_steps: int) -> list[dict]:
    """TRL's buffered generation batch as its accumulation windows: `micro_steps` consecutive micro-batches each."""
    return [concat(buffered[i : i + micro_steps]) for i in range(0, len(buffered), micro_steps)]


def passes_per_step(needed: list[int], micro_steps: int, budget: int | None, agree: Callable = _alone) -> list[int]:
    """Forward passes per micro-step of each window: 1 without a budget (TRL's one forward per micro-step); under
    one, the window's `needed` passes agreed over processes (`agree`: the element-wise maximum of a list of ints
    over all processes, one collective; ZeRO-3 gathers parameters inside every forward), rounded up to a multiple
    of `micro_steps`."""
    if budget is None:
        return [1] * len(needed)
    return [math.ceil(count / micro_steps) for count in agree(needed)]


def forward_count(rows: int, batch_size: int, needed: Callable[[], int], budget: int | None,
                  agree: Callable = _alone) -> int:  # fmt: skip
    """Forwards of a no-gradient pass over a generation batch of `rows`: TRL's `ceil(rows / batch_size)`, or under
    a `budget` at least `needed()`, the maximum over processes (the same on every process)."""
    count = math.ceil(rows / batch_size)
    return count if budget is None else agree([max(count, needed())])[0]


def plan_generation_batch(buffered: list[dict], micro_steps: int, budget: int | None = None,
                          pad_to_multiple_of: int | None = None, max_over_processes: Callable = _alone,
                          window_of: Callable | None = None) -> list[dict | Passes]:  # fmt: skip
    """Cut every accumulation window (`micro_steps` consecutive micro-batches) of TRL's buffered generation batch
    into length-sorted micro-steps.

    Under a token `budget` a window needs as many passes as its greedy cut has groups, rounded up to a multiple of
    `micro_steps`; `max_over_processes` (element-wise maximum of a list of ints over all processes, one collective)
    makes every process run the same number, since ZeRO-3 gathers parameters inside every forward.
    """
    cut = windows(buffered, micro_steps)
    plans = [plan_for(window, pad_to_multiple_of) for window in cut]
    needed = [plan.groups_needed(budget) for plan in plans] if budget is not None else [1] * len(plans)
    passes = passes_per_step(needed, micro_steps, budget, max_over_processes)
    return [
        micro
        for window, plan, count in zip(cut, plans, passes, strict=True)
        for micro in split_window(window, micro_steps, count, plan=plan, window_of=window_of)
    ]


def forward_passes(micro_batches: list) -> list[dict]:
    """Every forward pass of planned micro-steps (a micro-step may be a `Passes` list)."""
    return [part for micro in micro_batches for part in (micro if isinstance(micro, list) else [micro])]


def chunked_forward(forward: Callable, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                    batch_size: int, budget: int | None = None, pad_to_multiple_of: int | None = None,
                    max_over_processes: Callable = _alone, compute_entropy: bool = False,
                    compute_aux_loss: bool = False):  # fmt: skip
    """TRL's chunked no-grad forward over a generation batch, on length-sorted, trimmed chunks.

    `forward(input_ids, attention_mask, logits_to_keep, compute_entropy, compute_aux_loss)` returns TRL's
    `(logps, entropies, aux_loss)` for one chunk. As many chunks as TRL's `ceil(rows / batch_size)` (the same on
    every process), or, under a token `budget`, the maximum over processes of what the budget needs. Returns the
    (B, logits_to_keep) log-probs and entropies in the original row order, 0 beyond each row's own length (every
    consumer masks it), and the mean aux loss over chunks.
    """
    plan = forward_plan(attention_mask, logits_to_keep, pad_to_multiple_of)
    count = forward_count(input_ids.size(0), batch_size, lambda: plan.groups_needed(budget), budget,
                          max_over_processes)
    prompt_width = input_ids.size(1) - logits_to_keep
    logps = entropies = None
    aux_losses = []
    for start, end in plan.partition(count):
        rows = torch.as_tensor(plan.rows(start, end), device=input_ids.device)
        prompt, completion = plan.widths(start, end)
        columns = slice(prompt_width - prompt, prompt_width + completion)
        chunk_logps, chunk_entropies, aux = forward(
            input_ids[rows, columns], attention_mask[rows, columns], completion, compute_entropy, compute_aux_loss
        )
        if logps is None:
            logps = chunk_logps.new_zeros(input_ids.size(0), logits_to_keep)
            entropies = chunk_logps.new_zeros(input_ids.size(0), logits_to_keep) if compute_entropy else None
        logps[rows, :completion] = chunk_logps
        if compute_entropy:
            entropies[rows, :completion] = chunk_entropies
        if compute_aux_loss:
            aux_losses.append(aux)
    return logps, entropies, (torch.stack(aux_losses).mean() if compute_aux_loss else None)


def padded_fraction(batches: list[dict]) -> tuple[int, int]:
    """(real tokens, forwarded tokens) over batches: prompt + completion tokens against rows x widths."""
    real = forwarded = 0
    for batch in batches:
        real += int(batch["prompt_mask"].sum()) + int(batch["completion_mask"].sum())
        forwarded += batch["prompt_mask"].numel() + batch["completion_mask"].numel()
    return real, forwarded


# ------------------------------------------------------------------------- two update paths (`update_path.Path`)
class Padded:
    """TRL's micro-batches and forwards, unchanged (`dynamic_batching` off, or a batch it cannot regroup)."""

    name = "padded"
    fallback = "dynamic_batching keeps"  # said when a batch cannot be planned

    def plan(self, buffered: list[dict], run) -> tuple[list, dict]:
        return buffered, self.unplanned(buffered)

    def forward(self, model, trl, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, run):  # fmt: skip
        return trl(input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss)

    def sums(self, passes: list[dict]) -> dict:
        return metrics.padding_sums(*padded_fraction(passes))

    def unplanned(self, buffered: list[dict]) -> dict:
        return metrics.padding_sums(*padded_fraction(forward_passes(buffered)))

    def logged(self, sums: dict) -> dict:
        return {"batching/padding_fraction": metrics.padding_fraction(sums)}


class Dynamic(Padded):
    """Length-sorted, trimmed micro-batches in each accumulation window (`plan_generation_batch`), and the
    no-gradient passes over the generation batch on length-sorted chunks (`chunked_forward`)."""

    name = "dynamic"

    def plan(self, buffered: list[dict], run) -> tuple[list, dict]:
        planned = plan_generation_batch(buffered, run.micro_steps, run.budget, run.pad_to_multiple_of, run.agree,
                                        run.window_of)  # fmt: skip
        return planned, self.sums(forward_passes(planned))

    def forward(self, model, trl, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, run):  # fmt: skip
        if batch_size is None:  # a policy pass: its micro-batch is already planned
            return trl(input_ids, attention_mask, logits_to_keep, None, compute_entropy, compute_aux_loss)

        def chunk(ids, mask, keep, entropy, aux):
            return trl(ids, mask, keep, None, entropy, aux)

        return chunked_forward(chunk, input_ids, attention_mask, logits_to_keep, batch_size, run.budget,
                               run.pad_to_multiple_of, run.agree, compute_entropy, compute_aux_loss)  # fmt: skip


PADDED, DYNAMIC = Padded(), Dynamic()


# ------------------------------------------------------------------------------- the packing plan (padding_free)
# Which whole sequences share one packed row (`dhpo_trl/training/packing.py` runs the rows). The same guarantees as
# above: rows never leave their accumulation window, and every process runs the same number of forwards.
def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Sequence indices in rows of at most `budget` tokens: longest first, each into the first row it fits.

    A sequence longer than the budget gets a row of its own (nothing is cut or dropped). Deterministic: ties keep
    index order.
    """
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    rows: list[list[int]] = []
    loads: list[int] = []
    for index in order:
        for row, load in enumerate(loads):
            if load + lengths[index] <= budget:
                rows[row].append(index)
                loads[row] += lengths[index]
                break
        else:
            rows.append([index])
            loads.append(lengths[index])
    return rows


def balanced(lengths: list[int], count: int) -> list[list[int]]:
    """`count` rows, longest sequence first into the lightest row (LPT): the heaviest row is at most 4/3 of optimal,
    so the forwards of one step (and of every process) cost about the same."""
    rows: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for index in sorted(range(len(lengths)), key=lambda index: (-lengths[index], index)):
        row = min(range(count), key=lambda r: (loads[r], r))
        rows[row].append(index)
        loads[row] += lengths[index]
    return rows


def rows_needed(lengths: list[int], budget: int | None) -> int:
    """The fewest rows first-fit-decreasing needs under `budget` (1 without a budget, 0 without sequences)."""
    if not lengths:
        return 0
    return 1 if budget is None else len(first_fit_decreasing(lengths, budget))


def plan_rows(lengths: list[int], count: int, budget: int | None = None) -> list[list[int]]:
    """Exactly `count` non-empty rows of sequence indices, each within `budget` tokens unless it holds a single
    longer sequence; every sequence in exactly one row.

    Balanced rows (LPT) when they respect the budget; otherwise the first-fit-decreasing rows, with the heaviest
    splittable row halved until there are `count` (halving never breaks the budget).
    """
    if not 1 <= count <= len(lengths):
        raise ValueError(f"cannot pack {len(lengths)} sequences into {count} non-empty rows")
    rows = balanced(lengths, count)

    def fits(row):
        return budget is None or len(row) == 1 or sum(lengths[i] for i in row) <= budget

    if all(fits(row) for row in rows):
        return [sorted(row) for row in rows]
    rows = first_fit_decreasing(lengths, budget)
    if len(rows) > count:
        raise ValueError(f"{len(rows)} rows are needed under budget {budget}, but only {count} were agreed")
    while len(rows) < count:
        splittable = [r for r in range(len(rows)) if len(rows[r]) > 1]
        widest = max(splittable, key=lambda r: (sum(lengths[i] for i in rows[r]), -r))
        halves = balanced([lengths[i] for i in rows[widest]], 2)
        rows[widest : widest + 1] = [[rows[widest][i] for i in half] for half in halves]
    return [sorted(row) for row in rows]


def plan_windows(window_lengths: list[list[int]], micro_steps: int, budget: int | None, agree,
                 ) -> list[list[list[list[int]]]]:  # fmt: skip
    """For every accumulation window (its sequences' token counts), `micro_steps` micro-steps of rows.

    Without a budget a micro-step is one row, as in TRL (one forward per micro-step). With one, every window needs
    `rows_needed` rows, agreed over processes (`passes_per_step`). Result: windows -> micro-steps -> rows ->
    sequence indices (of the window).
    """
    needed = [rows_needed(lengths, budget) for lengths in window_lengths]
    passes = passes_per_step(needed, micro_steps, budget, agree)
    return [steps_of(plan_rows(lengths, micro_steps * per_step, budget), micro_steps)
            for lengths, per_step in zip(window_lengths, passes, strict=True)]  # fmt: skip


def steps_of(rows: list, micro_steps: int) -> list[list]:
    """`rows` (a multiple of `micro_steps` of them) as `micro_steps` consecutive micro-steps."""
    per_step = len(rows) // micro_steps
    return [rows[step * per_step : (step + 1) * per_step] for step in range(micro_steps)]


def token_counts(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> list[int]:
    """Tokens each sequence forwards when packed: its attended prompt and completion tokens, at least 1 (a
    sequence with none forwards its last prompt column, so that every row is non-empty)."""
    return (prompt_mask.sum(1) + completion_mask.sum(1)).clamp(min=1).tolist()


def split_window_into_rows(window: dict, steps: list[list[list[int]]], window_of: Callable | None = None,
                           ) -> list[dict | Passes]:  # fmt: skip
    """The window's micro-batches for `steps` (micro-steps -> rows -> sequence indices): each row becomes one pass,
    a (rows, columns) sub-batch trimmed to its own widest prompt and completion, carrying the window's
    `aggregation.Window` under `WINDOW` (`window_of(window, total passes)`, as `split_window`).

    The loss is computed on this padded layout (cheap, element-wise); only the forward is packed."""
    prompt = prompt_spans(window["prompt_mask"]).tolist()
    completion = completion_spans(window["completion_mask"]).tolist()
    prompt_limit, completion_limit = window["prompt_mask"].size(1), window["completion_mask"].size(1)
    total = sum(len(step) for step in steps)
    shared = {WINDOW: (window_of or planned_windows())(window, total)}
    micro = []
    for step in steps:
        passes = []
        for row in step:
            widths = (min(max(1, *(prompt[i] for i in row)), prompt_limit),
                      min(max(1, *(completion[i] for i in row)), completion_limit))  # fmt: skip
            passes.append({**take(window, row, *widths), **shared})
        micro.append(passes[0] if len(passes) == 1 else Passes(passes))
    return micro


def plan_packed_generation_batch(buffered: list[dict], micro_steps: int, budget: int | None = None,
                                 max_over_processes: Callable = _alone, window_of: Callable | None = None,
                                 ) -> list[dict | Passes]:  # fmt: skip
    """`plan_generation_batch` for packed forwards: every accumulation window of TRL's buffered generation
    batch becomes rows of whole sequences (`plan_windows`), each row one pass."""
    cut = windows(buffered, micro_steps)
    lengths = [token_counts(window["prompt_mask"], window["completion_mask"]) for window in cut]
    plans = plan_windows(lengths, micro_steps, budget, max_over_processes)
    return [micro for window, plan in zip(cut, plans, strict=True)
            for micro in split_window_into_rows(window, plan, window_of)]  # fmt: skip


def packed_fraction(micro_batches: list[dict]) -> tuple[int, int]:
    """(real tokens, forwarded tokens) of packed passes: a packed forward carries only real tokens."""
    real = sum(sum(token_counts(part["prompt_mask"], part["completion_mask"])) for part in micro_batches)
    return real, real
