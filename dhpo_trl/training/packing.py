"""Padding-free policy update: each forward is one row of whole sequences laid end to end, no padding.

TRL hands `_get_per_token_logps_and_entropies` a (B, T) batch: left-padded prompts, right-padded completions.
Here the real tokens of several sequences are concatenated into one row (batch 1), `position_ids` restart at 0
for every sequence, and attention never crosses a sequence boundary:

* with `attn_implementation="sdpa"` or `"eager"`, `packed_sdpa_attention` runs `scaled_dot_product_attention`
  causally over each sequence on its own, so attention costs the sum of the squared sequence lengths, not the square
  of the row. The model is switched to `dhpo_packed_sdpa` / `dhpo_packed_eager` (registered in transformers'
  `AttentionInterface` and `AttentionMaskInterface` by `packed_attention`, when a model first runs packed), which
  dispatch: packed rows get the per-sequence attention, everything else (generation, padded forwards) the model's
  own attention and mask (`_dispatching_attention` is the one place a packed row's kernel is picked);
* with `attn_implementation="flash_attention_2"/"_3"/"_4"` (or a hub flash kernel) transformers' own varlen path
  runs on the `cu_seq_lens_*` passed with every packed forward; the model's implementation is then left alone.

The per-token log-probs and entropies are scattered back to TRL's (B, logits_to_keep) layout, 0 where there is no
completion token (as TRL's fused head leaves them), so every objective, mask and metric downstream is unchanged.

The plan (which sequences share a row, within one process's accumulation window, the same number of forwards on
every process) is `batching.py`'s, pure and tested on its own. Everything here but `forward_packed` and
`packed_attention` is a pure function of tensors and lengths.
"""

from __future__ import annotations

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

from ..core import metrics
from . import attention_kernels, batching

# Implementations whose own kernel reads `cu_seq_lens_*` (transformers' varlen flash path): left in place.
VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
# Implementations the per-sequence SDPA function replaces exactly (same math, no mask needed).
REPLACEABLE_IMPLEMENTATIONS = ("eager", "sdpa")


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
        count = batching.forward_count(input_ids.size(0), batch_size, lambda: batching.rows_needed(lengths, budget),
                                       budget, max_over_processes)  # fmt: skip
    rows = batching.plan_rows(lengths, count, budget if count > 1 else None)
    packed = pack(input_ids, attention_mask, logits_to_keep, rows)
    return forward_packed(model, packed, (input_ids.size(0), logits_to_keep), compute_entropy, compute_aux_loss,
                          autocast)  # fmt: skip


class Packed(batching.Padded):
    """The update path of `padding_free`: rows of whole sequences (`batching.plan_packed_generation_batch`), every
    forward packed (`packed_forward`)."""

    name = "packed"
    fallback = "padding_free and dynamic_batching keep"

    def plan(self, buffered: list[dict], run) -> tuple[list, dict]:
        planned = batching.plan_packed_generation_batch(buffered, run.micro_steps, run.budget, run.agree,
                                                        run.window_of)  # fmt: skip
        return planned, self.sums(batching.forward_passes(planned))

    def forward(self, model, trl, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, run):  # fmt: skip
        return packed_forward(model, input_ids, attention_mask, logits_to_keep, batch_size, run.budget, run.agree,
                              compute_entropy, compute_aux_loss, run.autocast)  # fmt: skip

    def sums(self, passes: list[dict]) -> dict:
        return metrics.padding_sums(*batching.packed_fraction(passes))


PACKED = Packed()


# ------------------------------------------------------------------------------------------------- packing
@dataclass
class PackedRow:
    """One forward: (1, L) ids and positions, the sequences' boundaries, the scored tokens and where each goes back in
    the (B, logits_to_keep) layout."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor  # int32 (sequences + 1,): row offsets of the sequences
    max_length: int
    predictors: torch.Tensor  # (K,) row positions whose hidden state predicts a scored token (its position - 1)
    targets: torch.Tensor  # (1, K) the scored tokens: completion tokens with a previous token in their sequence
    rows: torch.Tensor  # (M,) batch row of each scored token
    columns: torch.Tensor  # (M,) its completion column

    @property
    def attention_kwargs(self) -> dict:
        """Extra forward arguments for the row's attention (none: the per-sequence attention needs only `cu_seq_lens_*`)."""
        return {}


def attended(attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """The tokens each packed sequence forwards: its attended ones, or, for a sequence with none, its last prompt
    column (every row of a packed forward must be non-empty). A bool copy of `attention_mask`."""
    mask = attention_mask.bool().clone()
    mask[~mask.any(1), max(prompt_width - 1, 0)] = True
    return mask


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
         rows: list[list[int]]) -> list[PackedRow]:  # fmt: skip
    """Pack the (B, T) batch (the last `logits_to_keep` columns are completions) into one `PackedRow` per row of
    sequence indices. A sequence keeps its attended tokens in column order; one with none keeps its last prompt
    column. A row without a scored token keeps one ignored target (-100), so that its forward still has an output
    connected to the model, as TRL's head gives a fully masked micro-batch."""
    prompt_width = input_ids.size(1) - logits_to_keep
    mask = attended(attention_mask, prompt_width)
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
        targets = ids[where] if where.numel() else ids.new_full((1,), -100)
        packed.append(PackedRow(
            input_ids=ids.unsqueeze(0), position_ids=position.unsqueeze(0),
            cu_seqlens=torch.cat([starts, lengths.sum().reshape(1)]).to(torch.int32), max_length=int(lengths.max()),
            predictors=where - 1 if where.numel() else where.new_zeros(1), targets=targets.unsqueeze(0),
            rows=index[row_of[where]], columns=column[where] - prompt_width,
        ))  # fmt: skip
    return packed


def scatter(values: torch.Tensor, row: PackedRow, out: torch.Tensor) -> None:
    """Write the fused head's (1, K) per-token `values` of `row` (one per target) into `out` (B, logits_to_keep)."""
    out[row.rows, row.columns] = values[0, : row.rows.numel()].to(out.dtype)


@contextmanager
def head_on_predictors(backbone, predictors: torch.Tensor):
    """Within the block the backbone returns only the hidden states at `predictors`, so TRL's fused head (given
    them as `shift_labels`) projects and scores the completion tokens alone. On CPU (no Triton) TRL's head scores
    every position otherwise, prompts included: the LM head, log-softmax and entropy of tokens nobody reads."""

    def select(module, args, output):
        output.last_hidden_state = output.last_hidden_state.index_select(1, predictors)
        return output

    handle = backbone.register_forward_hook(select)
    try:
        yield
    finally:
        handle.remove()


# ----------------------------------------------------------------------------------------------- attention
# Not traced by torch.compile (`torch_compile=True`): the loop over a row's sequences reads their lengths in Python,
# so a traced one (resumed after the `cu_seq_lens` read) would compile again for every row layout, and past dynamo's
# recompile limit run eagerly. Its kernels run as without compile; the layers around it are compiled.
@torch.compiler.disable
def packed_sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention over each packed sequence on its own: `query` (1, heads, L, dim), boundaries from
    `cu_seq_lens_q`. No mask is built; each sequence costs its own length squared.

    One SDPA call per sequence (measured in benchmarks/bench_dynamic_batching.py's padding-free arm); on CUDA in
    half precision, one varlen kernel call over the row instead (`attention_kernels.select`).
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
    kernel = attention_kernels.select(query, dropout)  # CUDA: one varlen kernel call over the row where one applies
    if kernel != "sdpa":
        return attention_kernels.varlen_attention(kernel, query, key, value, bounds, kwargs.get("max_length_q"),
                                                  scaling), None  # fmt: skip
    bounds = bounds.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=False)]
    gqa = key.size(1) != query.size(1)
    # split, not slicing: the backward of one split is one concatenation, while each slice's backward would
    # allocate and fill a zero gradient of the whole row (sequences x row length of memory traffic).
    # Each piece is transposed to (1, length, heads, dim) before the one concatenation, which then writes the
    # (1, L, heads, dim) layout the model expects: one copy of the output instead of two.
    pieces = [
        (F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
         if q.size(2) else q).transpose(1, 2)
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)
    ]  # fmt: skip
    return torch.cat(pieces, dim=1), None


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


DISPATCHING_PREFIX = "dhpo_packed_"


def dispatching_name(original: str) -> str:
    return f"{DISPATCHING_PREFIX}{original}"


def register_dispatching_attention(original: str) -> str:
    """Register the dispatching attention and mask for `original` in transformers' interfaces (once per process;
    `packed_attention` calls it before switching a model to it). Returns its name."""
    name = dispatching_name(original)
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _dispatching_attention(original))
        AttentionMaskInterface.register(name, _dispatching_mask(original))
    return name


def base_model(model):
    """The transformers model inside DDP / DeepSpeed / PEFT wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def attention_implementation(model) -> str:
    """The model's own attention implementation (the one before an earlier packed forward switched it)."""
    implementation = base_model(model).config._attn_implementation or "eager"
    return implementation.removeprefix(DISPATCHING_PREFIX)


def is_varlen(implementation: str) -> bool:
    """Whether transformers' varlen flash path runs packed rows (`cu_seq_lens_*`) with this implementation."""
    return implementation in VARLEN_IMPLEMENTATIONS or "flash" in str(implementation)


def unsupported_model_reason(model) -> str | None:
    """Why packed rows would not give this model's per-sequence outputs, or None."""
    model = base_model(model)
    config = getattr(model, "config", None)
    if config is None:
        return f"{type(model).__name__} has no transformers config"
    text = config.get_text_config()
    implementation = attention_implementation(model)
    if not getattr(model, "_supports_attention_backend", False):
        return (f"{type(model).__name__}'s attention does not go through transformers' AttentionInterface, so "
                "packed sequences could attend to each other")  # fmt: skip
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"]) - {"full_attention"}
    varlen = is_varlen(implementation)
    if kinds - {"sliding_attention"}:
        return f"layers of type {sorted(kinds)} do not read position_ids (no per-sequence attention)"
    if kinds and not varlen:
        return "sliding-window layers need the varlen flash path (attn_implementation='flash_attention_2')"
    if getattr(text, "attn_logit_softcapping", None) and not varlen:
        return "attention logit soft-capping needs the varlen flash path (attn_implementation='flash_attention_2')"
    if not varlen and implementation not in REPLACEABLE_IMPLEMENTATIONS:
        return f"attn_implementation={implementation!r} cannot run packed rows (use 'sdpa' or 'flash_attention_2')"
    return None


def automatic_reason(models: list, device_type: str) -> str | None:
    """`padding_free=None`: why this run keeps dynamic batching, or None to pack. Packed where it is supported and
    measured faster or runs one varlen kernel call per layer: CPU (measured: benchmarks/bench_dynamic_batching.py)
    and CUDA with transformers' varlen flash path (what VERL and OpenRLHF pack with) or, with `sdpa`/`eager`, a
    varlen kernel of `attention_kernels`.
    Without one, the per-sequence SDPA loop would launch a kernel per sequence and layer, on a GPU whose update is
    already bound by launches (docs/performance_gpu.md): dynamic batching there, and on every other device."""
    for model in models:
        reason = unsupported_model_reason(model)
        if reason:
            return reason
    implementation = attention_implementation(models[0])
    if device_type == "cpu" or (device_type == "cuda" and is_varlen(implementation)):
        return None
    if device_type == "cuda" and implementation in REPLACEABLE_IMPLEMENTATIONS:  # packed rows run a varlen kernel
        return attention_kernels.cuda_packing_reason()
    return (f"packed rows are not measured faster on {device_type} with attn_implementation={implementation!r}; "
            "set padding_free=True to pack anyway")


@contextmanager
def packed_attention(model):
    """Within the block the model's forwards are packed: it runs its dispatching implementation (installed on first
    use; `packed_sdpa_attention` for packed rows, its own attention otherwise) and gets no mask. A varlen flash
    implementation reads the same `cu_seq_lens_*` and is left alone."""
    config = base_model(model).config
    original = config._attn_implementation or "eager"
    if original in REPLACEABLE_IMPLEMENTATIONS:
        config._attn_implementation = register_dispatching_attention(original)
    _PACKING.active = True
    try:
        yield
    finally:
        _PACKING.active = False


def forward_packed(model, packed: list[PackedRow], shape: tuple[int, int], compute_entropy: bool,
                   compute_aux_loss: bool, autocast):  # fmt: skip
    """Run every packed row through TRL's fused LM head (`fused_lm_head=True`, `use_cache=False`: with a cache
    transformers skips packed-sequence detection), the head on the scored positions alone (`head_on_predictors`),
    and scatter log-probs / entropies back to `shape`.

    Returns (logps, entropies or None, mean aux loss over the forwards or None), as TRL's method does.
    """
    logps = entropies = None
    aux_losses = []
    backbone = base_model(model).base_model  # what TRL's fused head runs before the head
    with packed_attention(model):
        for row in packed:
            inputs = dict(
                input_ids=row.input_ids, position_ids=row.position_ids, shift_labels=row.targets, use_cache=False,
                cu_seq_lens_q=row.cu_seqlens, cu_seq_lens_k=row.cu_seqlens, max_length_q=row.max_length,
                max_length_k=row.max_length,
                **row.attention_kwargs,  # shared_prompts.SharedRow: its per-group attention
            )  # fmt: skip
            if compute_aux_loss:
                inputs["output_router_logits"] = True
            with autocast(), head_on_predictors(backbone, row.predictors):
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
