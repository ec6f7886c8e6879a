"""Padding-free policy update: each forward is one row of whole sequences laid end to end, no padding.

TRL hands `_get_per_token_logps_and_entropies` a (B, T) batch: left-padded prompts, right-padded completions.
Here the real tokens of several sequences are concatenated into one row (batch 1), `position_ids` restart at 0
for every sequence, and attention never crosses a sequence boundary:

* with `attn_implementation="sdpa"` or `"eager"`, `packed_sdpa_attention` runs `scaled_dot_product_attention`
  causally over each sequence on its own, so attention costs the sum of the squared sequence lengths, not the square
  of the row. The model is switched to `dhpo_packed_sdpa` / `dhpo_packed_eager` (registered in transformers'
  `AttentionInterface` and `AttentionMaskInterface`), which dispatch: packed rows get the per-sequence attention,
  everything else (generation, padded forwards) the model's own attention and mask;
* with `attn_implementation="flash_attention_2"/"_3"/"_4"` (or a hub flash kernel) transformers' own varlen path
  runs on the `cu_seq_lens_*` passed with every packed forward; the model's implementation is then left alone.

The per-token log-probs and entropies are scattered back to TRL's (B, logits_to_keep) layout, 0 where there is no
completion token (as TRL's fused head leaves them), so every objective, mask and metric downstream is unchanged.

The plan (which sequences share a row) lives in one process's accumulation window: rows never mix two optimizer
steps, and every process runs the same number of forwards (the caller passes the cross-process maximum as
`agree`). Everything but `forward_packed` and `packed_attention` is a pure function of tensors and lengths.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import batching

# Implementations whose own kernel reads `cu_seq_lens_*` (transformers' varlen flash path): left in place.
VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
# Implementations the per-sequence SDPA function replaces exactly (same math, no mask needed).
REPLACEABLE_IMPLEMENTATIONS = ("eager", "sdpa")


# ------------------------------------------------------------------------------------------------ the plan
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


def plan_windows(window_lengths: list[list[int]], micro_steps: int, budget: int | None,
                 agree) -> list[list[list[list[int]]]]:  # fmt: skip
    """For every accumulation window (its sequences' token counts), `micro_steps` micro-steps of rows.

    Without a budget a micro-step is one row, as in TRL (one forward per micro-step). With one, every window needs
    `rows_needed` rows; `agree` (a list of ints -> the element-wise maximum over processes, one collective) makes
    the count the same on every process, rounded up to a multiple of `micro_steps`. Result: windows -> micro-steps
    -> rows -> sequence indices (of the window).
    """
    passes = [1] * len(window_lengths)
    if budget is not None:
        needed = agree([rows_needed(lengths, budget) for lengths in window_lengths])
        passes = [math.ceil(count / micro_steps) for count in needed]
    plans = []
    for lengths, per_step in zip(window_lengths, passes, strict=True):
        rows = plan_rows(lengths, micro_steps * per_step, budget)
        plans.append([rows[step * per_step : (step + 1) * per_step] for step in range(micro_steps)])
    return plans


def token_counts(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> list[int]:
    """Tokens each sequence forwards when packed: its attended prompt and completion tokens, at least 1 (a
    sequence with none forwards its last prompt column, so that every row is non-empty)."""
    return (prompt_mask.sum(1) + completion_mask.sum(1)).clamp(min=1).tolist()


def split_window(window: dict, steps: list[list[list[int]]], window_of: Callable | None = None,
                 ) -> list[dict | batching.Passes]:  # fmt: skip
    """The window's micro-batches for `steps` (micro-steps -> rows -> sequence indices): each row becomes one pass,
    a (rows, columns) sub-batch trimmed to its own widest prompt and completion, carrying the window's
    `aggregation.Window` under `batching.WINDOW` (`window_of(window, total passes)`, as `batching.split_window`).

    The loss is computed on this padded layout (cheap, element-wise); only the forward is packed."""
    prompt = batching.prompt_spans(window["prompt_mask"]).tolist()
    completion = batching.completion_spans(window["completion_mask"]).tolist()
    prompt_limit, completion_limit = window["prompt_mask"].size(1), window["completion_mask"].size(1)
    total = sum(len(step) for step in steps)
    shared = {batching.WINDOW: (window_of or batching.planned_windows())(window, total)}
    micro = []
    for step in steps:
        passes = []
        for row in step:
            widths = (min(max(1, *(prompt[i] for i in row)), prompt_limit),
                      min(max(1, *(completion[i] for i in row)), completion_limit))  # fmt: skip
            passes.append({**batching.take(window, row, *widths), **shared})
        micro.append(passes[0] if len(passes) == 1 else batching.Passes(passes))
    return micro


def plan_generation_batch(buffered: list[dict], micro_steps: int, budget: int | None = None,
                          max_over_processes: Callable = lambda counts: counts, window_of: Callable | None = None,
                          ) -> list[dict | batching.Passes]:  # fmt: skip
    """`batching.plan_generation_batch` for packed forwards: every accumulation window of TRL's buffered generation
    batch becomes rows of whole sequences (`plan_windows`), each row one pass."""
    windows = [batching.concat(buffered[i : i + micro_steps]) for i in range(0, len(buffered), micro_steps)]
    lengths = [token_counts(window["prompt_mask"], window["completion_mask"]) for window in windows]
    plans = plan_windows(lengths, micro_steps, budget, max_over_processes)
    return [micro for window, plan in zip(windows, plans, strict=True)
            for micro in split_window(window, plan, window_of)]  # fmt: skip


def packed_fraction(micro_batches: list[dict]) -> tuple[int, int]:
    """(real tokens, forwarded tokens) of packed passes: a packed forward carries only real tokens."""
    real = sum(sum(token_counts(part["prompt_mask"], part["completion_mask"])) for part in micro_batches)
    return real, real


def packed_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                   batch_size: int | None, budget: int | None, max_over_processes: Callable, compute_entropy: bool,
                   compute_aux_loss: bool, autocast):  # fmt: skip
    """TRL's `_get_per_token_logps_and_entropies` on packed rows: `(logps, entropies, aux_loss)` in TRL's
    (B, logits_to_keep) layout.

    A policy pass (`batch_size` None) is one packed row: its micro-batch was planned to fit the budget. The passes
    over the whole generation batch (old and reference log-probs) run TRL's number of rows, `ceil(B / batch_size)`,
    or more when the budget needs more, agreed over processes (ZeRO-3 gathers parameters in every forward)."""
    lengths = attention_mask.sum(1).clamp(min=1).tolist()
    count = 1
    if batch_size is not None:
        count = math.ceil(input_ids.size(0) / batch_size)
        if budget is not None:
            count = max_over_processes([max(count, rows_needed(lengths, budget))])[0]
    rows = plan_rows(lengths, count, budget if count > 1 else None)
    packed = pack(input_ids, attention_mask, logits_to_keep, rows)
    return forward_packed(model, packed, (input_ids.size(0), logits_to_keep), compute_entropy, compute_aux_loss,
                          autocast)  # fmt: skip


# ------------------------------------------------------------------------------------------------- packing
@dataclass
class PackedRow:
    """One forward: (1, L) ids, positions and fused-head labels, the sequences' boundaries, and where each scored
    token goes back in the (B, logits_to_keep) layout."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor  # -100 except on completion tokens that have a previous token in their sequence
    cu_seqlens: torch.Tensor  # int32 (sequences + 1,): row offsets of the sequences
    max_length: int
    rows: torch.Tensor  # (M,) batch row of each scored token
    columns: torch.Tensor  # (M,) its completion column
    outputs: torch.Tensor  # (M,) its index in the fused head's (1, L - 1) outputs (label position - 1)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
         rows: list[list[int]]) -> list[PackedRow]:  # fmt: skip
    """Pack the (B, T) batch (the last `logits_to_keep` columns are completions) into one `PackedRow` per row of
    sequence indices. A sequence keeps its attended tokens in column order; one with none keeps its last prompt
    column."""
    mask = attention_mask.bool().clone()
    prompt_width = input_ids.size(1) - logits_to_keep
    empty = ~mask.any(1)
    mask[empty, max(prompt_width - 1, 0)] = True
    packed = []
    for sequences in rows:
        index = torch.as_tensor(sequences, dtype=torch.long, device=input_ids.device)
        sub = mask.index_select(0, index)
        row_of, column = sub.nonzero(as_tuple=True)  # row-major: sequences in the given order, columns ascending
        ids = input_ids.index_select(0, index)[row_of, column]
        lengths = sub.sum(1)
        starts = torch.cumsum(lengths, 0) - lengths
        position = torch.arange(ids.numel(), device=ids.device) - starts.repeat_interleave(lengths)
        scored = (column >= prompt_width) & (position > 0)  # the first token of a sequence has no prediction
        where = scored.nonzero(as_tuple=True)[0]
        packed.append(PackedRow(
            input_ids=ids.unsqueeze(0), position_ids=position.unsqueeze(0),
            labels=torch.where(scored, ids, torch.full_like(ids, -100)).unsqueeze(0),
            cu_seqlens=torch.cat([starts, lengths.sum().reshape(1)]).to(torch.int32),
            max_length=int(lengths.max()), rows=index[row_of[where]], columns=column[where] - prompt_width,
            outputs=where - 1,
        ))  # fmt: skip
    return packed


def scatter(values: torch.Tensor, row: PackedRow, out: torch.Tensor) -> None:
    """Write the fused head's (1, L - 1) per-token `values` of `row` into `out` (B, logits_to_keep), in place."""
    out[row.rows, row.columns] = values[0, row.outputs].to(out.dtype)


# ----------------------------------------------------------------------------------------------- attention
def packed_sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention over each packed sequence on its own: `query` (1, heads, L, dim), boundaries from
    `cu_seq_lens_q`. No mask is built; each sequence costs its own length squared.

    One SDPA call per sequence (measured in benchmarks/bench_dynamic_batching.py's padding-free arm).
    """
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None or attention_mask is not None or query.size(0) != 1:
        raise ValueError(
            "padding_free's per-sequence attention runs only on packed rows (batch 1, cu_seq_lens_q given, no "
            "attention mask), as DHPOTrainer's padding_free forwards pass them."
        )
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"padding_free's per-sequence SDPA attention cannot apply `{name}`: load the model with "
                "attn_implementation='flash_attention_2', or set padding_free=False."
            )
    bounds = bounds.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=False)]
    gqa = key.size(1) != query.size(1)
    # split, not slicing: the backward of one split is one concatenation, while each slice's backward would
    # allocate and fill a zero gradient of the whole row (sequences x row length of memory traffic).
    pieces = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
        if q.size(2) else q
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)
    ]
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous(), None


# The model keeps one of these dispatching implementations from its first packed forward on: a packed forward
# (cu_seq_lens_* in the attention kwargs, which gradient checkpointing's recomputation in backward replays too)
# gets `packed_sdpa_attention`; every other call (generation, TRL's padded passes) the model's own implementation
# and mask, unchanged. A switch around the forward alone would be undone before checkpointed layers recompute.
_PACKING = threading.local()


def _original_attention(original: str, module):
    if original == "eager":  # each model file defines its own eager function
        function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if function is None:
            raise ValueError(f"{type(module).__name__} has no eager_attention_forward: use attn_implementation='sdpa'")
        return function
    return ALL_ATTENTION_FUNCTIONS[original]


def _dispatching_attention(original: str):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if kwargs.get("cu_seq_lens_q") is not None and attention_mask is None and query.size(0) == 1:
            packed = kwargs.pop("packed_attention", None) or packed_sdpa_attention  # shared_prompts' layout passes its own
            return packed(module, query, key, value, attention_mask, *args, **kwargs)
        return _original_attention(original, module)(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


def _dispatching_mask(original: str):
    def mask(*args, **kwargs):
        if getattr(_PACKING, "active", False):  # a packed forward: attention is confined per sequence, no mask
            return None
        return ALL_MASK_ATTENTION_FUNCTIONS[original](*args, **kwargs)

    return mask


def dispatching_name(original: str) -> str:
    return f"dhpo_packed_{original}"


for _original in REPLACEABLE_IMPLEMENTATIONS:
    AttentionInterface.register(dispatching_name(_original), _dispatching_attention(_original))
    AttentionMaskInterface.register(dispatching_name(_original), _dispatching_mask(_original))


def base_model(model):
    """The transformers model inside DDP / DeepSpeed / PEFT wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def unsupported_model_reason(model) -> str | None:
    """Why packed rows would not give this model's per-sequence outputs, or None."""
    model = base_model(model)
    config = getattr(model, "config", None)
    if config is None:
        return f"{type(model).__name__} has no transformers config"
    text = config.get_text_config()
    implementation = config._attn_implementation or "eager"
    if implementation.startswith("dhpo_packed_"):  # already switched by an earlier packed forward
        implementation = implementation.removeprefix("dhpo_packed_")
    if not getattr(model, "_supports_attention_backend", False):
        return (f"{type(model).__name__}'s attention does not go through transformers' AttentionInterface, so "
                "packed sequences could attend to each other")  # fmt: skip
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"]) - {"full_attention"}
    varlen = implementation in VARLEN_IMPLEMENTATIONS or "flash" in str(implementation)
    if kinds - {"sliding_attention"}:
        return f"layers of type {sorted(kinds)} do not read position_ids (no per-sequence attention)"
    if kinds and not varlen:
        return "sliding-window layers need the varlen flash path (attn_implementation='flash_attention_2')"
    if getattr(text, "attn_logit_softcapping", None) and not varlen:
        return "attention logit soft-capping needs the varlen flash path (attn_implementation='flash_attention_2')"
    if not varlen and implementation not in REPLACEABLE_IMPLEMENTATIONS:
        return f"attn_implementation={implementation!r} cannot run packed rows (use 'sdpa' or 'flash_attention_2')"
    return None


@contextmanager
def packed_attention(model):
    """Within the block the model's forwards are packed: it runs its dispatching implementation (installed on first
    use; `packed_sdpa_attention` for packed rows, its own attention otherwise) and gets no mask. A varlen flash
    implementation reads the same `cu_seq_lens_*` and is left alone."""
    config = base_model(model).config
    original = config._attn_implementation or "eager"
    if original in REPLACEABLE_IMPLEMENTATIONS:
        config._attn_implementation = dispatching_name(original)
    _PACKING.active = True
    try:
        yield
    finally:
        _PACKING.active = False


def forward_packed(model, packed: list[PackedRow], shape: tuple[int, int], compute_entropy: bool,
                   compute_aux_loss: bool, autocast):  # fmt: skip
    """Run every packed row through TRL's fused LM head (`fused_lm_head=True`, `use_cache=False`: with a cache
    transformers skips packed-sequence detection) and scatter log-probs / entropies back to `shape`.

    Returns (logps, entropies or None, mean aux loss over the forwards or None), as TRL's method does.
    """
    logps = entropies = None
    aux_losses = []
    with packed_attention(model):
        for row in packed:
            inputs = dict(
                input_ids=row.input_ids, position_ids=row.position_ids, labels=row.labels, use_cache=False,
                cu_seq_lens_q=row.cu_seqlens, cu_seq_lens_k=row.cu_seqlens, max_length_q=row.max_length,
                max_length_k=row.max_length,
                **getattr(row, "attention_kwargs", {}),  # shared_prompts.SharedRow: its per-group attention
            )  # fmt: skip
            if compute_aux_loss:
                inputs["output_router_logits"] = True
            with autocast():
                outputs = model(**inputs, fused_lm_head=True)
            if logps is None:
                logps = outputs.log_probs.new_zeros(shape)
                entropies = outputs.log_probs.new_zeros(shape) if compute_entropy else None
            scatter(outputs.log_probs, row, logps)
            if compute_entropy:
                scatter(outputs.entropy, row, entropies)
            if compute_aux_loss:
                aux_losses.append(outputs.aux_loss)
    return logps, entropies, (torch.stack(aux_losses).mean() if compute_aux_loss else None)
