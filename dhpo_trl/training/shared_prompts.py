"""Shared prompts (`DHPOConfig.share_prompts`): in a packed row, a GRPO group's prompt is forwarded once.

`padding_free` packs whole sequences end to end, so a prompt with `num_generations` completions in one row is
forwarded `num_generations` times. Here sequences of one row whose attended prompt tokens are identical form a group
laid out as

    [prompt minus its last token] [last prompt token, completion 1] [last prompt token, completion 2] ...

* the prefix (the prompt minus its last token, positions 0 .. p - 2) is forwarded once, causally over itself;
* each suffix (the last prompt token, then the completion; positions p - 1 onwards) attends to the whole prefix and
  causally to itself only: one SDPA per suffix with keys [prefix; suffix] and a small lower-right causal mask (never
  a row x row mask). The last prompt token is repeated in every suffix so that its hidden state, which predicts the
  completion's first token, is computed per completion (the same value: same token, position and context) and the
  fused head's shifted labels stay inside each suffix;
* the prefix's keys and values enter every suffix's attention, so its activations receive the sum of every
  completion's gradient, as the prompt copies do when each sequence is forwarded on its own: the same update, to float
  rounding. A prompt of one token, or a group of one sequence in the row, is laid out as `padding_free` lays it.

The plan keeps a group in one row where it can (`plan_rows`): rows are planned over groups, a group is split only
when the token budget or the agreed row count needs it. Rows never leave their accumulation window (TRL shuffles the
generation batch before cutting it, so a window holds the groups' completions that the shuffle put there; the
benchmark measures how much that shares). Everything but `shared_sdpa_attention`'s SDPA calls is a pure function of
tensors and lengths; the packed forward itself is `packing.forward_packed`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..core import metrics
from . import batching, packing


# ------------------------------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class Sequences:
    """What the plan needs of a batch's sequences: each one's prompt key (its attended prompt token ids), prompt
    length and completion length (attended tokens)."""

    keys: list[tuple[int, ...]]
    prompts: list[int]
    completions: list[int]


def sequences(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> Sequences:
    """The `Sequences` of a TRL batch (left-padded prompts, right-padded completions). A sequence with no attended
    token at all keeps its last prompt column, as `packing.pack` forwards it."""
    completions = completion_mask.sum(1)
    if prompt_mask.size(1):
        prompt_mask = packing.attended(torch.cat([prompt_mask, completion_mask], 1), prompt_mask.size(1))
        prompt_mask = prompt_mask[:, : prompt_ids.size(1)]
    ids = prompt_ids.tolist()
    keys = [tuple(token for token, kept in zip(row, mask, strict=True) if kept)
            for row, mask in zip(ids, prompt_mask.tolist(), strict=True)]  # fmt: skip
    return Sequences(keys, [len(key) for key in keys], completions.tolist())


def groups(keys: list) -> list[list[int]]:
    """Indices of equal keys, in order of first appearance (each group in index order)."""
    found: dict = {}
    for index, key in enumerate(keys):
        found.setdefault(key, []).append(index)
    return list(found.values())


def shares(prompt: int, members: int) -> bool:
    """Whether a group of `members` sequences with a `prompt`-token prompt is laid out shared: only when there is a
    prefix to share (at least two sequences, a prompt of at least two tokens)."""
    return members >= 2 and prompt >= 2


def tokens(seqs: Sequences, members: list[int]) -> int:
    """Tokens one row forwards for `members`, all of one group: prefix once, then each suffix."""
    prompt = seqs.prompts[members[0]]
    completions = sum(seqs.completions[i] for i in members)
    if shares(prompt, len(members)):
        return prompt - 1 + len(members) + completions
    return len(members) * prompt + completions


def row_tokens(seqs: Sequences, row: list[int]) -> int:
    """Tokens one shared row of sequence indices forwards (its groups laid out as `pack` lays them)."""
    return sum(tokens(seqs, [row[i] for i in group]) for group in groups([seqs.keys[i] for i in row]))


# ------------------------------------------------------------------------------------------------- the plan
def units(seqs: Sequences, budget: int | None) -> list[list[int]]:
    """The groups of `seqs`, each cut into as few parts as fit `budget` (first-fit-decreasing over its completions,
    every part carrying the prefix); a sequence longer than the budget is a part of its own."""
    out = []
    for group in groups(seqs.keys):
        if budget is None or tokens(seqs, group) <= budget:
            out.append(group)
            continue
        parts: list[list[int]] = []
        for index in sorted(group, key=lambda i: (-seqs.completions[i], i)):
            for part in parts:
                if tokens(seqs, [*part, index]) <= budget:
                    part.append(index)
                    break
            else:
                parts.append([index])
        out.extend(sorted(part) for part in parts)
    return out


def rows_needed(seqs: Sequences, budget: int | None) -> int:
    """The fewest rows the shared plan needs under `budget` (first-fit-decreasing over the groups' parts)."""
    if not seqs.keys:
        return 0
    parts = units(seqs, budget)
    return 1 if budget is None else batching.rows_needed([tokens(seqs, part) for part in parts], budget)


def plan_rows(seqs: Sequences, count: int, budget: int | None = None) -> list[list[int]]:
    """`batching.plan_rows` over groups: exactly `count` non-empty rows of sequence indices, each within `budget`
    unless it holds a single longer sequence, every sequence in exactly one row, a group split only when the budget
    or the count needs it (the part with the most tokens is halved until there are `count` parts)."""
    if not 1 <= count <= len(seqs.keys):
        raise ValueError(f"cannot pack {len(seqs.keys)} sequences into {count} non-empty rows")
    parts = units(seqs, budget)
    while len(parts) < count:  # halving a part keeps both halves within the budget (subsets, the same prefix)
        widest = max((p for p in range(len(parts)) if len(parts[p]) > 1),
                     key=lambda p: (tokens(seqs, parts[p]), -p))  # fmt: skip
        order = sorted(parts[widest], key=lambda i: (-seqs.completions[i], i))
        halves = batching.balanced([1 + seqs.completions[i] for i in order], 2)  # suffix tokens: both halves non-empty
        parts[widest : widest + 1] = [sorted(order[i] for i in half) for half in halves]
    rows = batching.plan_rows([tokens(seqs, part) for part in parts], count, budget)
    return [sorted(i for p in row for i in parts[p]) for row in rows]


def window_sequences(window: dict) -> Sequences:
    return sequences(window["prompt_ids"], window["prompt_mask"], window["completion_mask"])


def plan_generation_batch(buffered: list[dict], micro_steps: int, budget: int | None = None,
                          max_over_processes: Callable = lambda counts: counts, window_of: Callable | None = None,
                          ) -> tuple[list[dict | batching.Passes], dict]:  # fmt: skip
    """`batching.plan_packed_generation_batch` with shared rows: each row one pass (`batching.split_window_into_rows`),
    and this process's metric sums of those rows, counted on the plan: the packed rows' padding
    (`metrics.padding_sums`) and their prompt tokens (`prompt_sums`)."""
    windows = batching.windows(buffered, micro_steps)
    seqs = [window_sequences(window) for window in windows]
    passes = batching.passes_per_step([rows_needed(s, budget) for s in seqs], micro_steps, budget, max_over_processes)
    rows = [plan_rows(s, micro_steps * per_step, budget)
            for s, per_step in zip(seqs, passes, strict=True)]  # over prompt groups  # fmt: skip
    prompts = [prompt_tokens(s, r) for s, r in zip(seqs, rows, strict=True)]
    planned = [micro for window, r in zip(windows, rows, strict=True)
               for micro in batching.split_window_into_rows(window, batching.steps_of(r, micro_steps), window_of)]
    padding = metrics.padding_sums(*batching.packed_fraction(batching.forward_passes(planned)))
    return planned, {**padding, **prompt_sums(sum(p[0] for p in prompts), sum(p[1] for p in prompts))}


def prompt_tokens(seqs: Sequences, rows: list[list[int]]) -> tuple[int, int]:
    """(prompt tokens the shared `rows` of `seqs` forward, prompt tokens of the same sequences)."""
    shared = total = 0
    for row in rows:
        total += sum(seqs.prompts[i] for i in row)
        for group in groups([seqs.keys[i] for i in row]):
            prompt = seqs.prompts[row[group[0]]]
            shared += prompt - 1 + len(group) if shares(prompt, len(group)) else prompt * len(group)
    return shared, total


def prompt_sums(forwarded: int, total: int) -> dict:
    """This process's (forwarded, total) prompt tokens of its update rows, as tensors to be summed over processes."""
    return {"shared_prompt_forwarded": torch.tensor(float(forwarded)), "shared_prompt_total": torch.tensor(float(total))}


def saved_fraction(sums: dict) -> float:
    """`batching/prompt_tokens_saved`: the share of the update rows' prompt tokens that sharing did not forward, all
    processes (0 without prompts)."""
    total = float(sums["shared_prompt_total"])
    return (total - float(sums["shared_prompt_forwarded"])) / max(total, 1.0)


class Shared(packing.Packed):
    """The update path of `share_prompts`: packed rows planned over prompt groups, each group's prompt forwarded
    once, and the share of prompt tokens saved (`batching/prompt_tokens_saved`)."""

    name = "shared"
    fallback = "share_prompts, padding_free and dynamic_batching keep"

    def plan(self, buffered: list[dict], run) -> tuple[list, dict]:
        return plan_generation_batch(buffered, run.micro_steps, run.budget, run.agree, run.window_of)

    def forward(self, model, trl, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, run):  # fmt: skip
        return packed_forward(model, input_ids, attention_mask, logits_to_keep, batch_size, run.budget, run.agree,
                              compute_entropy, compute_aux_loss, run.autocast)  # fmt: skip

    def unplanned(self, buffered: list[dict]) -> dict:
        return {**super().unplanned(buffered), **prompt_sums(0, 0)}

    def logged(self, sums: dict) -> dict:
        return {**super().logged(sums), "batching/prompt_tokens_saved": saved_fraction(sums)}


SHARED = Shared()


# ------------------------------------------------------------------------------------------------- packing
@dataclass(frozen=True)
class Segments:
    """The attention layout of one shared row, passed to `shared_sdpa_attention` with every layer call (gradient
    checkpointing replays it): each segment's length, the segment it attends to as prefix (-1: none) and, for a
    suffix, its (suffix, prefix + suffix) lower-right causal mask."""

    lengths: tuple[int, ...]
    prefix: tuple[int, ...]
    masks: tuple = field(repr=False)


@dataclass
class SharedRow(packing.PackedRow):
    segments: Segments | None = None

    @property
    def attention_kwargs(self) -> dict:
        """The extra forward arguments `packing.forward_packed` passes: the per-group attention and its layout."""
        return {"packed_attention": shared_sdpa_attention, "shared_segments": self.segments}


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
         rows: list[list[int]]) -> list[SharedRow]:  # fmt: skip
    """`packing.pack` with each row's groups laid out shared (module docstring). Predictors, targets, scatter indices and
    `cu_seqlens` (the segments' bounds) have `packing.PackedRow`'s meaning."""
    prompt_width = input_ids.size(1) - logits_to_keep
    mask = packing.attended(attention_mask, prompt_width)
    return [_pack_row(input_ids, mask, prompt_width, row) for row in rows]


class _Segments:
    """The segments of one shared row as they are laid out, left to right."""

    def __init__(self, prompt_width: int, device):
        self.prompt_width, self.device = prompt_width, device
        self.ids, self.positions, self.targets, self.rows, self.columns, self.predictors = [], [], [], [], [], []
        self.lengths, self.prefix, self.masks = [], [], []
        self.offset = 0

    def add(self, tokens, position, label, prefix_segment, batch_row=None, completion_columns=None):
        self.ids.append(tokens)
        self.positions.append(position)
        self.lengths.append(tokens.numel())
        self.prefix.append(prefix_segment)
        if prefix_segment < 0:
            self.masks.append(None)
        else:
            width = self.lengths[prefix_segment]
            self.masks.append(torch.ones(tokens.numel(), width + tokens.numel(), dtype=torch.bool, device=self.device)
                              .tril(width))  # fmt: skip
        if batch_row is not None:
            where = (label != -100).nonzero(as_tuple=True)[0]
            self.rows.append(torch.full_like(where, batch_row))
            self.columns.append(completion_columns[where] - self.prompt_width)
            self.targets.append(label[where])
            self.predictors.append(self.offset + where - 1)  # the hidden state before a scored token predicts it
        self.offset += tokens.numel()

    def row(self) -> SharedRow:
        bounds = torch.tensor([0, *self.lengths], device=self.device).cumsum(0).to(torch.int32)
        scored, predictors = torch.cat(self.targets), self.predictors
        if scored.numel() == 0:  # as `packing.pack`: one ignored target keeps the forward connected to the model
            scored, predictors = scored.new_full((1,), -100), [scored.new_zeros(1)]
        return SharedRow(
            input_ids=torch.cat(self.ids).unsqueeze(0), position_ids=torch.cat(self.positions).unsqueeze(0),
            cu_seqlens=bounds, max_length=max(self.lengths), predictors=torch.cat(predictors),
            targets=scored.unsqueeze(0), rows=torch.cat(self.rows), columns=torch.cat(self.columns),
            segments=Segments(tuple(self.lengths), tuple(self.prefix), tuple(self.masks)),
        )  # fmt: skip


def _pack_row(input_ids: torch.Tensor, mask: torch.Tensor, prompt_width: int, row: list[int]) -> SharedRow:
    device = input_ids.device
    columns = torch.arange(input_ids.size(1), device=device)
    segments = _Segments(prompt_width, device)
    kept = [mask[i] for i in row]
    keys = [tuple(input_ids[i, kept_i & (columns < prompt_width)].tolist()) for i, kept_i in zip(row, kept)]
    for group in groups(keys):
        members = [row[g] for g in group]
        prompt = len(keys[group[0]])
        shared = shares(prompt, len(members))
        if shared:
            head = input_ids[members[0], kept[group[0]] & (columns < prompt_width)][:-1]
            segments.add(head, torch.arange(prompt - 1, device=device), torch.full_like(head, -100), -1)
            prefix_segment = len(segments.lengths) - 1
        for g, i in zip(group, members, strict=True):
            sequence_columns = kept[g].nonzero(as_tuple=True)[0]
            if shared:
                sequence_columns = sequence_columns[prompt - 1 :]
            tokens = input_ids[i, sequence_columns]
            start = prompt - 1 if shared else 0
            position = torch.arange(start, start + tokens.numel(), device=device)
            label = torch.where((sequence_columns >= prompt_width) & (position > 0), tokens,
                                torch.full_like(tokens, -100))  # fmt: skip
            segments.add(tokens, position, label, prefix_segment if shared else -1, i, sequence_columns)
    return segments.row()


def packed_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                   batch_size: int | None, budget: int | None, max_over_processes: Callable, compute_entropy: bool,
                   compute_aux_loss: bool, autocast):  # fmt: skip
    """`packing.packed_forward` with shared rows: a policy pass (`batch_size` None) is one row; the passes over the
    whole generation batch run TRL's number of rows, or more when the budget needs more, agreed over processes."""
    prompt_width = input_ids.size(1) - logits_to_keep
    seqs = sequences(input_ids[:, :prompt_width], attention_mask[:, :prompt_width], attention_mask[:, prompt_width:])
    count = 1
    if batch_size is not None:
        count = batching.forward_count(input_ids.size(0), batch_size, lambda: rows_needed(seqs, budget), budget,
                                       max_over_processes)  # fmt: skip
    rows = plan_rows(seqs, count, budget if count > 1 else None)
    packed = pack(input_ids, attention_mask, logits_to_keep, rows)
    return packing.forward_packed(model, packed, (input_ids.size(0), logits_to_keep), compute_entropy,
                                  compute_aux_loss, autocast)  # fmt: skip


# ----------------------------------------------------------------------------------------------- attention
# Not traced by torch.compile (`torch_compile=True`): the loop reads the row's segments (lengths, prefixes, masks) in
# Python, so a traced one would compile the model again for every row layout, and past dynamo's recompile limit the
# whole model would run eagerly. Its SDPA calls run as without compile; the layers around it are compiled.
@torch.compiler.disable
def shared_sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over a shared row (`query` (1, heads, L, dim)): a prefix or unshared sequence causally over itself,
    a suffix over [its prefix; itself] under its lower-right causal mask. Returns (1, L, heads, dim), None."""
    segments = kwargs.get("shared_segments")
    if segments is None or attention_mask is not None or query.size(0) != 1:
        raise ValueError("share_prompts' per-group attention runs only on shared rows (batch 1, shared_segments "
                         "given, no attention mask), as DHPOTrainer's share_prompts forwards pass them.")  # fmt: skip
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"share_prompts' per-group SDPA attention cannot apply `{name}`: set share_prompts=False.")
    gqa = key.size(1) != query.size(1)
    queries, keys, values = (t.split(list(segments.lengths), 2) for t in (query, key, value))
    pieces = []
    for q, k, v, prefix, mask in zip(queries, keys, values, segments.prefix, segments.masks, strict=True):
        if prefix < 0:
            pieces.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                                         enable_gqa=gqa))  # fmt: skip
        else:
            k, v = torch.cat([keys[prefix], k], 2), torch.cat([values[prefix], v], 2)
            pieces.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                         enable_gqa=gqa))  # fmt: skip
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous(), None


def unsupported_model_reason(model) -> str | None:
    """Why shared rows would not give this model's per-sequence outputs, or None: `packing`'s reasons, and a
    varlen flash implementation (its kernel cannot attend to another segment's prefix)."""
    reason = packing.unsupported_model_reason(model)
    if reason is not None:
        return reason
    implementation = packing.attention_implementation(model)
    if implementation not in packing.REPLACEABLE_IMPLEMENTATIONS:
        return (f"attn_implementation={implementation!r}: the per-group attention runs on SDPA (load the model with "
                "attn_implementation='sdpa')")  # fmt: skip
    return None
