"""MoE routing replay: a later forward routes every token through the experts an earlier forward chose for it.

Off-policy, a router's top-k choice can flip between the pass that computed pi_old and a policy pass; the token's
log-ratio then jumps by the difference between two experts, not by one optimizer step (R3, arXiv 2510.11370).
Replay forces the recorded *selection* only: the gate weights are recomputed from the live router logits at the
replayed experts (softmax, then renormalised where the model renormalises), so the router still gets gradients.

Tokens are keyed by their prefix, not by their place in a batch: in a causal model a token's routing is a function
of the tokens up to it, so the key of a token is a 2 x 64-bit hash of (token id, position) over its sequence up to
and including it. The same key comes out of a padded row, a trimmed row, a packed row (`position_ids`,
`cu_seq_lens_q`) and a shared-prompt row (`shared_segments`: a completion continues its prompt's hash), so the
replayed routing follows the tokens through every batching layout without the layout code knowing about it.

Pieces: `Routing` (keys and experts of a set of tokens, `lookup` by key), `gate_weights` (the recomputed gate),
`RoutingReplay` (hooks on the routers and on the decoder: `record()` / `replay(routing)` contexts), `to_rows` /
`from_rows` (a generation batch's routing as one int16 row tensor, carried in the batch dict like the old log-probs:
shuffled, split, cut into micro-batches and saved for resume with it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .moe import is_moe_config

# Routers whose forward is `softmax(logits) -> top-k -> [renormalise]` returning (logits, scores, indices): the
# class name and the attribute that says whether the top-k weights are renormalised (None: always, as Mixtral).
SUPPORTED_ROUTERS = {
    "Qwen3MoeTopKRouter": "norm_topk_prob",
    "Qwen2MoeTopKRouter": "norm_topk_prob",
    "Qwen3NextTopKRouter": "norm_topk_prob",
    "OlmoeTopKRouter": "norm_topk_prob",
    "MixtralTopKRouter": None,
}
ROUTED_EXPERTS = "routed_experts"  # batch key: (B, prompt + completion columns, layers, top_k) int16, -1 at padding

_SEEDS = (0x2545F4914F6CDD1D, 0x1B873593CC9E2D51)


def _signed(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's `>>` is arithmetic on signed integers)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in wrapping int64 arithmetic: a bijection that scatters nearby inputs."""
    x = (x ^ _shift_right(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)


def prefix_keys(ids: torch.Tensor, positions: torch.Tensor, segment: torch.Tensor,
                prefix_of: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Two int64 keys per token: the wrapping sum over its segment up to it of a hash of (id, position).

    `ids`, `positions`, `segment` are 1-D over the tokens, each segment's tokens contiguous and in order.
    `prefix_of[s]` (or -1) names a segment whose tokens come before segment s in its sequence (a shared prompt):
    its total is added, so a completion's keys equal those it has laid out after its whole prompt.
    """
    ids, positions, segment = ids.long(), positions.long(), segment.long()
    count = int(segment.max()) + 1 if segment.numel() else 0
    first = torch.ones_like(segment, dtype=torch.bool)
    first[1:] = segment[1:] != segment[:-1]
    last = torch.ones_like(first)
    last[:-1] = first[1:]
    out = []
    for seed in _SEEDS:
        term = _mix(ids * _signed(0x9E3779B97F4A7C15) + positions * _signed(0xC2B2AE3D27D4EB4F) + _signed(seed))
        total = torch.cumsum(term, 0)
        before = torch.zeros(count, dtype=torch.long, device=ids.device)
        before[segment[first]] = (total - term)[first]
        keys = total - before[segment]
        if prefix_of is not None and bool((prefix_of >= 0).any()):
            ends = torch.zeros(count, dtype=torch.long, device=ids.device)
            ends[segment[last]] = keys[last]
            offsets = torch.where(prefix_of >= 0, ends[prefix_of.clamp(min=0)], torch.zeros_like(ends))
            keys = keys + offsets[segment]
        out.append(keys)
    return out[0], out[1]


@dataclass(frozen=True)
class Layout:
    """The tokens of one forward that carry routing: flat positions into its (batch x length) tokens, and keys."""

    where: torch.Tensor  # (n,) long: positions in the forward's flattened tokens
    keys: torch.Tensor  # (n,) int64
    checks: torch.Tensor  # (n,) int64: a second, independent key
    tokens: int  # the forward's flattened token count


def padded_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> Layout:
    """Rows of (possibly padded) sequences: each row one sequence, its attended tokens in column order."""
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if mask.shape != input_ids.shape:
        raise ValueError(f"routing replay: attention_mask {tuple(mask.shape)} does not match input_ids "
                         f"{tuple(input_ids.shape)}; it needs a 2-D padding mask")  # fmt: skip
    rows, _ = mask.nonzero(as_tuple=True)
    positions = (torch.cumsum(mask.long(), 1) - 1)[mask]
    keys, checks = prefix_keys(input_ids[mask], positions, rows)
    return Layout(mask.flatten().nonzero(as_tuple=True)[0], keys, checks, input_ids.numel())


def packed_layout(input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                  segments=None) -> Layout:  # fmt: skip
    """One row of sequences end to end: segment bounds from `shared_segments` (lengths, prefix segment), else from
    `cu_seq_lens_q`, else where `position_ids` restart at 0."""
    ids, positions = input_ids.reshape(-1), position_ids.reshape(-1)
    prefix_of = None
    if segments is not None:
        lengths = torch.as_tensor(segments.lengths, device=ids.device)
        prefix_of = torch.as_tensor(segments.prefix, device=ids.device)
    elif cu_seqlens is not None:
        lengths = cu_seqlens.long().diff()
    else:
        starts = (positions == 0).nonzero(as_tuple=True)[0]
        lengths = torch.cat([starts, starts.new_tensor([ids.numel()])]).diff()
    if int(lengths.sum()) != ids.numel():
        raise ValueError(f"routing replay: the packed row holds {ids.numel()} tokens, its segments "
                         f"{int(lengths.sum())}")  # fmt: skip
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=ids.device), lengths)
    keys, checks = prefix_keys(ids, positions, segment, prefix_of)
    return Layout(torch.arange(ids.numel(), device=ids.device), keys, checks, ids.numel())


def forward_layout(input_ids: torch.Tensor | None, kwargs: dict) -> Layout:
    """The layout of a decoder forward from its arguments (padded rows, or packed rows as `packing.py` passes)."""
    if input_ids is None:
        raise ValueError("routing replay keys tokens by their ids: the forward got inputs_embeds without input_ids")
    attention_mask, position_ids = kwargs.get("attention_mask"), kwargs.get("position_ids")
    packed = attention_mask is None and position_ids is not None and input_ids.size(0) == 1
    if packed and (kwargs.get("shared_segments") is not None or kwargs.get("cu_seq_lens_q") is not None
                   or bool((position_ids == 0).sum() > 1)):  # fmt: skip
        return packed_layout(input_ids, position_ids, kwargs.get("cu_seq_lens_q"), kwargs.get("shared_segments"))
    return padded_layout(input_ids, attention_mask)


# ------------------------------------------------------------------------------------------------ routing
@dataclass
class Routing:
    """The top-k experts of every MoE layer for a set of tokens, found by key (`lookup`)."""

    keys: torch.Tensor  # (N,) int64
    checks: torch.Tensor  # (N,) int64
    experts: torch.Tensor  # (layers, N, top_k) int16
    layers: tuple[str, ...] = ()  # the routers' module names, for errors
    _order: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        shape = self.experts.shape
        if len(shape) != 3 or self.keys.shape != self.checks.shape or shape[1] != self.keys.numel():
            raise ValueError(f"routing: experts {tuple(self.experts.shape)} must be (layers, tokens, top_k) for the "
                             f"{self.keys.numel()} keyed tokens")  # fmt: skip

    @staticmethod
    def concat(parts: list[Routing]) -> Routing:
        if not parts:
            raise ValueError("routing: nothing was recorded (no forward ran inside record())")
        return Routing(torch.cat([p.keys for p in parts]), torch.cat([p.checks for p in parts]),
                       torch.cat([p.experts for p in parts], 1), parts[0].layers)  # fmt: skip

    def lookup(self, keys: torch.Tensor, checks: torch.Tensor) -> torch.Tensor:
        """(layers, n, top_k) long experts of the tokens with these keys; ValueError if any has no record."""
        if self._order is None:
            self._order = torch.argsort(self.keys)
        sorted_keys = self.keys[self._order]
        at = torch.searchsorted(sorted_keys, keys.to(sorted_keys.device)).clamp(max=max(sorted_keys.numel() - 1, 0))
        index = self._order[at] if sorted_keys.numel() else at
        found = (sorted_keys[at] == keys) & (self.checks[index] == checks) if sorted_keys.numel() else keys != keys
        if not bool(found.all()):
            missing = int((~found).sum())
            raise ValueError(f"routing replay: {missing} of {keys.numel()} tokens of this forward have no recorded "
                             f"routing ({self.keys.numel()} recorded tokens): the routing was recorded for other "
                             "sequences (another batch, a truncated reply)")  # fmt: skip
        return self.experts[:, index].long()


def check_fits(routing: Routing, found: list[tuple[str, torch.nn.Module]]) -> None:
    """ValueError naming the layer where routing from elsewhere (another model) does not fit the model's routers:
    the number of MoE layers, a router's top-k, an expert index out of its range."""
    layers, _, top_k = routing.experts.shape
    if layers != len(found):
        raise ValueError(f"routing replay: the routing holds {layers} MoE layers (experts {tuple(routing.experts.shape)}"
                         f", layers x tokens x top_k), the model {len(found)} ({found[0][0]} ... {found[-1][0]})")
    for layer, (name, router) in enumerate(found):
        want = getattr(router, "top_k", top_k)
        experts = routing.experts[layer]
        if want != top_k:
            raise ValueError(f"routing replay: layer {layer} ({name}) picks top-{want}, the routing holds top-{top_k} "
                             f"(experts {tuple(routing.experts.shape)})")  # fmt: skip
        count = getattr(router, "num_experts", None)
        if experts.numel() and (int(experts.min()) < 0 or (count is not None and int(experts.max()) >= count)):
            raise ValueError(f"routing replay: layer {layer} ({name}) has {count} experts, the routing names experts "
                             f"{int(experts.min())}..{int(experts.max())}")  # fmt: skip


def gate_weights(router_logits: torch.Tensor, experts: torch.Tensor, normalise: bool,
                 dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The router's top-k weights at the given experts: softmax over all experts (float32), picked, renormalised
    where the model renormalises (`norm_topk_prob`), in `dtype`. Differentiable in the logits."""
    weights = F.softmax(router_logits.float(), dim=-1).gather(-1, experts.long())
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype)


def decisions_differ(live: torch.Tensor, replayed: torch.Tensor) -> torch.Tensor:
    """(n,) True where a token's live top-k set differs from the replayed one (order within the top-k ignored)."""
    return (live.sort(-1).values != replayed.sort(-1).values).any(-1)


def routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's MoE routers of a supported class, in module order."""
    return [(name, module) for name, module in model.named_modules() if type(module).__name__ in SUPPORTED_ROUTERS]


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why routing replay cannot act on `model` (None: it can)."""
    found = routers(model)
    config = getattr(model, "config", None)
    if not found:
        others = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Router")})
        if others:
            return f"its routers ({', '.join(others)}) are not ones replay supports ({', '.join(SUPPORTED_ROUTERS)})"
        if config is not None and is_moe_config(config):
            return "its mixture-of-experts blocks have no router module replay supports"
        return f"{type(model).__name__} is a dense model (no mixture-of-experts router)"
    return None


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The module that takes `input_ids` and holds the layers (`embed_tokens`): where a forward's layout is read."""
    for module in model.modules():
        if hasattr(module, "embed_tokens") and hasattr(module, "layers"):
            return module
    raise ValueError(f"routing replay: no decoder (a module with embed_tokens and layers) in {type(model).__name__}")


# ------------------------------------------------------------------------------------------------- hooks
@dataclass
class Stats:
    """Token-layer decisions of the replayed forwards: how many, how many forced, how many the live router flipped."""

    decisions: int = 0
    replayed: int = 0
    flipped: int = 0


@dataclass
class _Forward:
    layout: Layout
    mode: str  # "record" or "replay"
    experts: torch.Tensor | None = None  # replay: (layers, n, top_k)
    captured: list = field(default_factory=list)  # record: per layer
    counted: set = field(default_factory=set)  # replay: layers whose decisions are counted (not again on recompute)
    stats: Stats | None = None


class RoutingReplay:
    """Record / replay hooks on the routers of one or more models (a policy and its reference).

    `record()` collects a `Routing` over every forward inside it; `replay(routing)` forces it in every forward inside
    it. A forward's plan stays until the next forward of that model starts, so the recomputed forward of gradient
    checkpointing (after the context, in backward) replays the same selection.
    """

    def __init__(self, *models: torch.nn.Module):
        self._armed: tuple[str, object] | None = None
        self._handles = []
        for model in models:
            self.install(model)

    def install(self, model: torch.nn.Module) -> None:
        found = routers(model)
        if not found:
            raise ValueError(f"routing replay cannot act on this model: {unsupported_reason(model)}")
        slots: dict = {"forward": None}
        names = tuple(name for name, _ in found)
        decoder = _decoder(model)
        self._handles.append(decoder.register_forward_pre_hook(self._pre_hook(slots, names), with_kwargs=True))
        self._handles.append(decoder.register_forward_hook(self._post_hook(slots, names)))
        for layer, (name, router) in enumerate(found):
            attribute = SUPPORTED_ROUTERS[type(router).__name__]
            normalise = True if attribute is None else bool(getattr(router, attribute))
            self._handles.append(router.register_forward_hook(self._router_hook(slots, layer, name, normalise)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def record(self) -> Iterator[list]:
        """Inside: every forward records. Yields a list that holds the `Routing` once the block exits."""
        parts, out = [], []
        with self._arm(("record", parts)):
            yield out
        out.append(Routing.concat(parts))

    @contextlib.contextmanager
    def replay(self, routing: Routing) -> Iterator[Stats]:
        """Inside: every forward runs the experts `routing` holds for its tokens. Yields the decision counts."""
        stats = Stats()
        with self._arm(("replay", (routing, stats))):
            yield stats

    @contextlib.contextmanager
    def _arm(self, plan):
        if self._armed is not None:
            raise RuntimeError("routing replay: record() and replay() do not nest")
        self._armed = plan
        try:
            yield
        finally:
            self._armed = None

    # The hooks read `self._armed` when a decoder forward starts and keep that forward's plan in `slots`.
    def _pre_hook(self, slots, names):
        def hook(module, args, kwargs):
            if self._armed is None:
                slots["forward"] = None
                return None
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            layout = forward_layout(input_ids, kwargs)
            mode, payload = self._armed
            if mode == "record":
                slots["forward"] = _Forward(layout, mode, captured=[None] * len(names))
                return None
            routing, stats = payload
            if routing.experts.size(0) != len(names):
                raise ValueError(f"routing replay: the routing holds {routing.experts.size(0)} MoE layers, the model "
                                 f"{len(names)} ({names[0]} ... {names[-1]})")  # fmt: skip
            slots["forward"] = _Forward(layout, mode, experts=routing.lookup(layout.keys, layout.checks), stats=stats)
            return None

        return hook

    def _post_hook(self, slots, names):
        def hook(module, args, output):
            forward = slots["forward"]
            if forward is not None and forward.mode == "record" and self._armed is not None:
                _, parts = self._armed
                missing = [names[i] for i, c in enumerate(forward.captured) if c is None]
                if missing:
                    raise RuntimeError(f"routing replay: router {missing[0]} did not run in the recorded forward")
                parts.append(Routing(forward.layout.keys, forward.layout.checks, torch.stack(forward.captured), names))
            return None

        return hook

    @staticmethod
    def _router_hook(slots, layer, name, normalise):
        def hook(module, args, output):
            forward = slots["forward"]
            if forward is None:
                return None
            logits, scores, indices = output
            layout = forward.layout
            if indices.size(0) != layout.tokens:
                raise ValueError(f"routing replay: {name} routes {tuple(indices.shape)} (tokens, top_k), the "
                                 f"forward's layout has {layout.tokens} tokens")  # fmt: skip
            if forward.mode == "record":
                forward.captured[layer] = indices[layout.where].to(torch.int16)
                return None
            replayed = forward.experts[layer].to(indices.device)
            if replayed.shape != (layout.where.numel(), indices.size(1)):
                raise ValueError(f"routing replay: {name} picks top-{indices.size(1)} for {layout.where.numel()} "
                                 f"tokens, the routing holds {tuple(replayed.shape)} (tokens, top_k)")  # fmt: skip
            if layer not in forward.counted:  # once per forward: not again when gradient checkpointing recomputes
                forward.counted.add(layer)
                forward.stats.decisions += replayed.size(0)
                forward.stats.replayed += replayed.size(0)
                forward.stats.flipped += int(decisions_differ(indices[layout.where], replayed).sum())
            forced = indices.clone()
            forced[layout.where] = replayed
            return logits, gate_weights(logits, forced, normalise, scores.dtype), forced

        return hook


# -------------------------------------------------------------------------------------- batch dict rows
def _sequence_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    mask = attention_mask.bool()
    if mask.shape != input_ids.shape:
        raise ValueError(f"routing: attention_mask {tuple(mask.shape)} does not match input_ids "
                         f"{tuple(input_ids.shape)}")  # fmt: skip
    return mask


def to_rows(routing: Routing, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The routing of a padded batch's attended tokens as (B, T, layers, top_k) int16, -1 elsewhere."""
    mask = _sequence_mask(input_ids, attention_mask)
    layout = padded_layout(input_ids, mask)
    experts = routing.lookup(layout.keys, layout.checks)  # (layers, n, top_k)
    rows = torch.full((*input_ids.shape, *experts.shape[::2]), -1, dtype=torch.int16, device=input_ids.device)
    rows[mask] = experts.permute(1, 0, 2).to(device=input_ids.device, dtype=torch.int16)
    return rows


def from_rows(rows: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Routing:
    """The `Routing` of `to_rows` output whose rows may since have lost padding columns (`input_ids` is the rows'
    current layout): each row's recorded tokens, in order, are its attended tokens."""
    mask = _sequence_mask(input_ids, attention_mask)
    if rows.dim() != 4 or rows.size(0) != input_ids.size(0):
        raise ValueError(f"routing: {ROUTED_EXPERTS} {tuple(rows.shape)} must be (rows, columns, layers, top_k) for "
                         f"{input_ids.size(0)} rows")  # fmt: skip
    recorded = rows[:, :, 0, 0] >= 0
    have, need = recorded.sum(1), mask.sum(1)
    if not torch.equal(have, need.to(have.device)):
        row = int((have != need.to(have.device)).nonzero()[0])
        raise ValueError(f"routing: row {row} has routing for {int(have[row])} tokens, its sequence "
                         f"{int(need[row])} tokens ({ROUTED_EXPERTS} {tuple(rows.shape)}, input_ids "
                         f"{tuple(input_ids.shape)})")  # fmt: skip
    layout = padded_layout(input_ids, mask)
    experts = rows[recorded.to(rows.device)].permute(1, 0, 2)  # row-major, like the layout's tokens
    return Routing(layout.keys, layout.checks, experts.to(layout.keys.device))


# ------------------------------------------------------------------------------------------------ trainer
def sequence_inputs(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A TRL batch's (prompt + completion) ids and attention mask, as its forwards see them."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    return ids, torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)


class TrainerRouting:
    """`DHPOConfig.routing_replay` for `DHPOTrainer`; every method is inert under "none".

    "old" (R2): in a generation batch, the first log-prob pass (TRL's pi_old pass) records; the later ones (the
    reference) replay; the routing goes into the batch as `ROUTED_EXPERTS` rows and every policy pass replays it.
    "rollout" (R3): vLLM's routing of the batch (`rollout_routing.py`) is replayed by every log-prob pass and goes
    into the batch the same way.
    """

    def __init__(self, mode: str, model: torch.nn.Module, ref_model: torch.nn.Module | None = None, generation=None,
                 accelerator=None):  # fmt: skip
        self.mode = mode
        self.hooks = None
        self.rollout = None  # "rollout": the RolloutRouting that holds the server's routing of the batch
        self._routers = routers(model)
        if mode == "none":
            return
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"DHPOConfig.routing_replay={mode!r} replays mixture-of-experts routing, but {reason}: "
                             "set routing_replay='none'.")  # fmt: skip
        self.hooks = RoutingReplay(model, *([ref_model] if ref_model is not None else []))
        if mode == "rollout":
            self._read_rollout(generation, accelerator)

    @classmethod
    def of(cls, trainer) -> TrainerRouting:
        """`trainer.args.routing_replay` on its policy and reference (and, "rollout", its vLLM backend)."""
        return cls(trainer.args.routing_replay, trainer.model, trainer.ref_model,
                   getattr(trainer, "vllm_generation", None), trainer.accelerator)  # fmt: skip

    def _read_rollout(self, generation, accelerator) -> None:
        """Keep the routing TRL's vLLM backend (`generation`, server mode) receives with each generation batch."""
        from .rollout_routing import RolloutRouting

        if generation is None:
            raise ValueError("DHPOConfig.routing_replay='rollout' replays vLLM's routing: set use_vllm=True")
        self.rollout = RolloutRouting()
        self.rollout.install(generation, accelerator)

    def _batch_routing(self) -> Routing:
        """The server's routing of the batch just generated, checked against the model's routers."""
        routing = self.rollout.take()
        check_fits(routing, self._routers)
        return routing

    @contextlib.contextmanager
    def generation_batch(self, trainer) -> Iterator[dict]:
        """While TRL builds a generation batch: its first `_get_per_token_logps_and_entropies` call records, the
        later ones replay (wrapped on the instance for the block). Yields a dict holding "routing" afterwards."""
        held: dict = {"routing": None}
        if self.hooks is None:
            yield held
            return
        original = trainer._get_per_token_logps_and_entropies

        def log_probs(*args, **kwargs):
            if held["routing"] is None and self.rollout is not None:
                held["routing"] = self._batch_routing()
            if held["routing"] is None:
                with self.hooks.record() as out:
                    result = original(*args, **kwargs)
                held["routing"] = out[0]
                return result
            with self.hooks.replay(held["routing"]):
                return original(*args, **kwargs)

        shadowed = trainer.__dict__.get("_get_per_token_logps_and_entropies")  # an instance-level wrapper, kept
        trainer._get_per_token_logps_and_entropies = log_probs
        try:
            yield held
        finally:
            if shadowed is None:
                del trainer._get_per_token_logps_and_entropies
            else:
                trainer._get_per_token_logps_and_entropies = shadowed

    def attach(self, batch: dict, held: dict) -> dict:
        """The generation batch with its recorded routing as rows (`ROUTED_EXPERTS`), int16."""
        if self.hooks is None:
            return batch
        if held["routing"] is None and self.rollout is not None:  # no log-prob pass ran (on-policy)
            held["routing"] = self._batch_routing()
        if held["routing"] is None:
            raise RuntimeError(f"DHPOConfig.routing_replay={self.mode!r}: the generation batch ran no log-prob pass "
                               "to record routing from (TRL skips pi_old on-policy)")  # fmt: skip
        return {**batch, ROUTED_EXPERTS: to_rows(held["routing"], *sequence_inputs(batch))}

    def check_resumed(self, buffered: list | None) -> None:
        """A resumed generation batch carries its routing when replay is on: refused at `train()`, before any step."""
        parts = [part for step in buffered or [] for part in (step if isinstance(step, list) else [step])]
        if self.hooks is not None and any(part.get(ROUTED_EXPERTS) is None for part in parts):
            raise ValueError(f"DHPOConfig.routing_replay={self.mode!r}: the checkpoint's generation batch carries no "
                             f"recorded routing ({ROUTED_EXPERTS}): it was saved with routing_replay='none'; resume "
                             "with that setting, or from a checkpoint at a generation-batch boundary.")  # fmt: skip

    @contextlib.contextmanager
    def policy_pass(self, batch: dict) -> Iterator[Stats | None]:
        """Around a policy forward over `batch`: replay its recorded routing; yields the decision counts."""
        if self.hooks is None:
            yield None
            return
        if batch.get(ROUTED_EXPERTS) is None:
            raise ValueError(f"DHPOConfig.routing_replay={self.mode!r}: this micro-batch carries no recorded routing "
                             f"({ROUTED_EXPERTS}): it was generated with routing_replay='none' (resumed from such a "
                             "checkpoint?); resume with the setting it was saved with.")  # fmt: skip
        with self.hooks.replay(from_rows(batch[ROUTED_EXPERTS], *sequence_inputs(batch))) as stats:
            yield stats


def building_engine(args):
    """Around TRL's `__init__`: a colocated vLLM engine built to return routing where `routing_replay="rollout"`."""
    from .rollout_routing import colocated_engine_returns_routing

    return colocated_engine_returns_routing(args)


def metric_sums(stats: Stats | None) -> dict:
    """The counts behind the `moe/` metrics, to be summed over processes (empty without replay)."""
    if stats is None:
        return {}
    return {"moe_decisions": stats.decisions, "moe_replayed": stats.replayed, "moe_flipped": stats.flipped}

