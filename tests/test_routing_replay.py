"""MoE routing replay (`dhpo_trl.training.routing_replay`): the experts every replayed forward runs, for every token
and layer, are the recorded ones, whatever the batching layout; the gate weights and their gradient equal a direct
computation with the selection forced; bad routing is a named error.

"Experts used" is read independently of the replay hooks: a pre-hook on each `experts` module sees the
`top_k_index` the block hands its experts.
"""

import contextlib

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.training import batching, resume
from dhpo_trl.training import routing_replay as rr
from dhpo_trl.training.shared_prompts import Segments

TOKENIZER = build_char_tokenizer()


def tiny_moe(seed=0, layers=2):
    return build_tiny_qwen3(TOKENIZER, moe=True, seed=seed, num_layers=layers)


def padded_batch(seed=0):
    """Three sequences, left-padded prompts and right-padded completions, as TRL lays them out."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a short prompt
    mask[1, 9:] = 0  # a short completion
    mask[2, :1] = 0
    mask[2, 10:] = 0
    ids = ids.masked_fill(mask == 0, TOKENIZER.pad_token_id)
    return ids, mask


@contextlib.contextmanager
def experts_used(model):
    """Per layer, the (tokens, top_k) expert indices every call of each experts module received, in call order."""
    calls = {}
    handles = []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            handles.append(module.register_forward_pre_hook(
                lambda m, args, name=name: calls.setdefault(name, []).append(args[1].clone())))  # fmt: skip
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def record(model, replay, ids, mask):
    with torch.no_grad(), replay.record() as out:
        model(input_ids=ids, attention_mask=mask)
    return out[0]


def scramble_routers(model, seed=1, scale=5.0):
    """Change every router's weights enough that the live top-k changes for many tokens."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, router in rr.routers(model):
            router.weight.add_(scale * torch.randn(router.weight.shape, generator=gen))


def live_routing(model, ids, mask):
    with torch.no_grad(), experts_used(model) as calls:
        model(input_ids=ids, attention_mask=mask)
    return [c[0].view(*ids.shape, -1) for c in calls.values()]


# ------------------------------------------------------------------------------------------------- keys
def test_prefix_keys_are_the_same_in_padded_packed_and_shared_layouts():
    ids, mask = padded_batch()
    padded = rr.padded_layout(ids, mask)
    seqs = [ids[i][mask[i].bool()] for i in range(3)]
    packed_ids = torch.cat(seqs).unsqueeze(0)
    positions = torch.cat([torch.arange(s.numel()) for s in seqs]).unsqueeze(0)
    bounds = torch.tensor([0, *[s.numel() for s in seqs]]).cumsum(0).int()
    for kwargs in ({"cu_seqlens": bounds}, {}):  # segment bounds given, or read from the position restarts
        packed = rr.packed_layout(packed_ids, positions, **kwargs)
        assert torch.equal(packed.keys, padded.keys) and torch.equal(packed.checks, padded.checks)
    # Shared prompt: two sequences with one prompt of 4 tokens: head = prompt[:-1], suffixes from the last prompt token.
    prompt, a, b = torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10]), torch.tensor([11])
    full = rr.padded_layout(torch.stack([torch.cat([prompt, a]), torch.cat([prompt, b, torch.tensor([0])])]),
                            torch.tensor([[1] * 6, [1] * 5 + [0]]))  # fmt: skip
    row = torch.cat([prompt[:-1], prompt[-1:], a, prompt[-1:], b]).unsqueeze(0)
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 3, 4]).unsqueeze(0)
    shared = rr.packed_layout(row, pos, segments=Segments((3, 3, 2), (-1, 0, 0), ()))
    expected = torch.cat([full.keys[:3], full.keys[3:6], full.keys[9:11]])  # sequence b's prompt head = a's
    assert torch.equal(shared.keys, expected)
    assert torch.equal(full.keys[:4], full.keys[6:10])  # the same prefix, the same key
    assert full.keys[4] != full.keys[10]  # same position, different history


def test_a_token_with_another_prefix_has_another_key():
    ids, mask = padded_batch()
    changed = ids.clone()
    changed[0, 4] += 1
    before, after = rr.padded_layout(ids, mask).keys, rr.padded_layout(changed, mask).keys
    first = int(mask[0].sum())
    assert torch.equal(before[:1], after[:1])  # the tokens before the change keep their keys
    assert (before[1:first] != after[1:first]).all() and torch.equal(before[first:], after[first:])


# ------------------------------------------------------------------------------------------------ replay
def test_replay_forces_the_recorded_experts_for_every_token_and_layer_after_the_routers_change():
    model = tiny_moe()
    replay = rr.RoutingReplay(model)
    ids, mask = padded_batch()
    recorded = live_routing(model, ids, mask)
    routing = record(model, replay, ids, mask)
    scramble_routers(model)
    live = live_routing(model, ids, mask)
    valid = mask.bool()
    assert any(not torch.equal(l[valid], r[valid]) for l, r in zip(live, recorded))  # the live routing moved
    with replay.replay(routing) as stats, torch.no_grad(), experts_used(model) as calls:
        model(input_ids=ids, attention_mask=mask)
    for used, old, new in zip(calls.values(), recorded, live):
        assert torch.equal(used[0].view(*ids.shape, -1)[valid], old[valid])
    flips = sum(int(rr.decisions_differ(n[valid], o[valid]).sum()) for n, o in zip(live, recorded))
    assert flips > 0 and stats.flipped == flips
    assert stats.decisions == stats.replayed == 2 * int(valid.sum())


def test_replay_follows_the_tokens_into_packed_and_reordered_trimmed_rows():
    model = tiny_moe()
    replay = rr.RoutingReplay(model)
    ids, mask = padded_batch()
    recorded = live_routing(model, ids, mask)
    routing = record(model, replay, ids, mask)
    scramble_routers(model)
    valid = mask.bool()
    # Reordered rows (2, 0), trimmed to the attended columns: prompt from column 1, completion to column 10.
    sub_ids, sub_mask = ids[[2, 0], 1:10], mask[[2, 0], 1:10]
    with replay.replay(routing), torch.no_grad(), experts_used(model) as calls:
        model(input_ids=sub_ids, attention_mask=sub_mask)
    for used, old in zip(calls.values(), recorded):
        assert torch.equal(used[0].view(*sub_ids.shape, -1)[sub_mask.bool()], old[[2, 0], 1:10][sub_mask.bool()])
    # One packed row of all three sequences, in the order 1, 2, 0.
    seqs = [ids[i][valid[i]] for i in (1, 2, 0)]
    packed = torch.cat(seqs).unsqueeze(0)
    positions = torch.cat([torch.arange(s.numel()) for s in seqs]).unsqueeze(0)
    with replay.replay(routing), torch.no_grad(), experts_used(model) as calls:
        model(input_ids=packed, position_ids=positions)
    for used, old in zip(calls.values(), recorded):
        assert torch.equal(used[0], torch.cat([old[i][valid[i]] for i in (1, 2, 0)]))


def block_and_router(model, layer=0):
    block = model.model.layers[layer].mlp
    return block, block.gate


def forced_block_output(block, hidden, experts, normalise):
    """The MoE block's output computed directly: router logits, softmax, the forced experts' weights."""
    flat = hidden.reshape(-1, hidden.size(-1))
    logits = flat @ block.gate.weight.T
    probs = torch.softmax(logits.double(), -1).to(logits.dtype)
    weights = torch.gather(probs, 1, experts)
    if normalise:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    for token in range(flat.size(0)):
        for slot in range(experts.size(1)):
            e = int(experts[token, slot])
            gate, up = (flat[token] @ block.experts.gate_up_proj[e].T).chunk(2)
            out[token] += weights[token, slot] * (block.experts.act_fn(gate) * up) @ block.experts.down_proj[e].T
    return out.view_as(hidden)


@pytest.mark.parametrize("normalise", [True, False])
def test_gate_weights_and_their_gradient_equal_a_direct_computation_with_the_selection_forced(normalise):
    model = tiny_moe()
    for _, router in rr.routers(model):
        router.norm_topk_prob = normalise
    replay = rr.RoutingReplay(model)
    ids, mask = padded_batch()
    routing = record(model, replay, ids, mask)
    scramble_routers(model, scale=1.0)
    block, router = block_and_router(model)
    captured = {}
    handle = block.register_forward_pre_hook(lambda m, args: captured.setdefault("h", args[0].detach()))
    with replay.replay(routing):
        model(input_ids=ids, attention_mask=mask)
    handle.remove()
    hidden = captured["h"].clone().requires_grad_(True)
    forced = routing.lookup(*[getattr(rr.padded_layout(ids, mask), k) for k in ("keys", "checks")])[0]
    full = torch.zeros(ids.numel(), 2, dtype=torch.long)
    full[mask.flatten().bool()] = forced
    live = router(hidden.detach().reshape(-1, hidden.size(-1)))[2]
    full[~mask.flatten().bool()] = live[~mask.flatten().bool()]  # padding keeps the live routing
    with replay.replay(routing):
        # a forward of the whole model sets the plan; then run the block alone under it
        model(input_ids=ids, attention_mask=mask)
        out = block(hidden)
    weight_grad = torch.autograd.grad(out.square().sum(), (router.weight, hidden))
    direct = forced_block_output(block, hidden, full, normalise)
    direct_grad = torch.autograd.grad(direct.square().sum(), (router.weight, hidden))
    assert torch.allclose(out, direct, atol=1e-5)
    for got, want in zip(weight_grad, direct_grad):
        assert got.abs().max() > 0 and torch.allclose(got, want, atol=1e-5)


def test_replay_across_an_optimizer_step_forces_the_old_selection():
    model = tiny_moe()
    replay = rr.RoutingReplay(model)
    ids, mask = padded_batch()
    recorded = live_routing(model, ids, mask)
    routing = record(model, replay, ids, mask)
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
    labels = ids.masked_fill(mask == 0, -100)
    for _ in range(3):  # a learning rate high enough that the routing drifts
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    valid = mask.bool()
    live = live_routing(model, ids, mask)
    assert any(not torch.equal(l[valid], r[valid]) for l, r in zip(live, recorded))
    with replay.replay(routing) as stats, experts_used(model) as calls:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    for used, old in zip(calls.values(), recorded):
        assert torch.equal(used[0].view(*ids.shape, -1)[valid], old[valid])
    assert stats.flipped > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, r in rr.routers(model) for p in r.parameters())


def test_gradient_checkpointing_recomputes_with_the_replayed_selection():
    ids, mask = padded_batch()
    grads = []
    for checkpointing in (False, True):
        model = tiny_moe()
        replay = rr.RoutingReplay(model)
        routing = record(model, replay, ids, mask)
        scramble_routers(model)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with experts_used(model) as calls:
            with replay.replay(routing) as stats:
                loss = model(input_ids=ids, attention_mask=mask).logits.square().mean()
            loss.backward()  # after the block, as the Trainer backpropagates: the recompute still replays
        assert len(next(iter(calls.values()))) == (2 if checkpointing else 1)
        assert all(torch.equal(c[-1], c[0]) for c in calls.values())
        assert stats.decisions == 2 * int(mask.sum())  # counted once, not again on recompute
        grads.append([p.grad.clone() for p in model.parameters()])
    for without, with_checkpointing in zip(*grads):
        assert torch.allclose(without, with_checkpointing, atol=1e-6)


def test_replay_acts_through_a_lora_model():
    peft = pytest.importorskip("peft")
    model = tiny_moe()
    ids, mask = padded_batch()
    recorded = live_routing(model, ids, mask)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    replay = rr.RoutingReplay(lora)
    routing = record(lora, replay, ids, mask)
    scramble_routers(lora)
    with replay.replay(routing), experts_used(lora) as calls:
        lora(input_ids=ids, attention_mask=mask).logits.sum().backward()
    valid = mask.bool()
    for used, old in zip(calls.values(), recorded):
        assert torch.equal(used[0].view(*ids.shape, -1)[valid], old[valid])
    assert any(p.grad is not None for n, p in lora.named_parameters() if "lora_" in n)


def tiny_other(kind):
    common = dict(vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)  # fmt: skip
    torch.manual_seed(0)
    if kind == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4))
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=32, norm_topk_prob=False))  # fmt: skip


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_replay_on_mixtral_and_qwen2_moe(kind):
    model = tiny_other(kind)
    replay = rr.RoutingReplay(model)
    ids, mask = padded_batch()
    recorded = live_routing(model, ids, mask)
    routing = record(model, replay, ids, mask)
    scramble_routers(model)
    router = rr.routers(model)[0][1]
    scores = {}
    handle = router.register_forward_hook(lambda m, a, out: scores.setdefault("s", out) and None)
    with replay.replay(routing), torch.no_grad(), experts_used(model) as calls:
        model(input_ids=ids, attention_mask=mask)
    handle.remove()
    valid = mask.bool()
    for used, old in zip(calls.values(), recorded):
        assert torch.equal(used[0].view(*ids.shape, -1)[valid], old[valid])
    logits, weights, experts = scores["s"]
    direct = torch.softmax(logits.float(), -1).gather(1, experts)
    if kind == "mixtral":  # Mixtral always renormalises; this Qwen2-MoE does not (norm_topk_prob=False)
        direct = direct / direct.sum(-1, keepdim=True)
    assert torch.allclose(weights.float(), direct, atol=1e-6)


# ------------------------------------------------------------------------------------------------ rows
def test_rows_travel_with_their_batch_through_micro_batch_cutting_and_resume(tmp_path):
    model = tiny_moe()
    replay = rr.RoutingReplay(model)
    ids, mask = padded_batch()
    routing = record(model, replay, ids, mask)
    prompt_width = 5
    batch = {"prompt_ids": ids[:, :prompt_width], "prompt_mask": mask[:, :prompt_width],
             "completion_ids": ids[:, prompt_width:], "completion_mask": mask[:, prompt_width:],
             rr.ROUTED_EXPERTS: rr.to_rows(routing, ids, mask)}  # fmt: skip
    assert batch[rr.ROUTED_EXPERTS].dtype == torch.int16
    # The micro-batch cutter: rows 2 and 1, completions trimmed to their 5 attended columns.
    part = batching.take(batch, [2, 1], 5, 5)
    state = resume.decode(resume.encode(part))  # a checkpoint of the buffered micro-batch
    sub_ids = torch.cat([state["prompt_ids"], state["completion_ids"]], 1)
    sub_mask = torch.cat([state["prompt_mask"], state["completion_mask"]], 1)
    again = rr.from_rows(state[rr.ROUTED_EXPERTS], sub_ids, sub_mask)
    layout = rr.padded_layout(sub_ids, sub_mask)
    assert torch.equal(again.lookup(layout.keys, layout.checks), routing.lookup(layout.keys, layout.checks))
    recorded = live_routing(model, ids, mask)
    expected = torch.stack([r[[2, 1], :10][sub_mask.bool()] for r in recorded])
    assert torch.equal(again.lookup(layout.keys, layout.checks), expected)


# --------------------------------------------------------------------------------------------- bad input
def test_routing_of_another_model_or_other_tokens_is_a_named_error():
    ids, mask = padded_batch()
    deeper = tiny_moe(layers=3)
    routing = record(deeper, rr.RoutingReplay(deeper), ids, mask)
    model = tiny_moe()
    replay = rr.RoutingReplay(model)
    with pytest.raises(ValueError, match=r"3 MoE layers, the model 2 \(model.layers.0.mlp.gate"):
        with replay.replay(routing):
            model(input_ids=ids, attention_mask=mask)
    own = record(model, replay, ids, mask)
    top_one = rr.Routing(own.keys, own.checks, own.experts[:, :, :1], own.layers)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate picks top-2 for 27 tokens.*\(27, 1\)"):
        with replay.replay(top_one):
            model(input_ids=ids, attention_mask=mask)
    longer = torch.cat([ids, ids[:, :2]], 1)
    with pytest.raises(ValueError, match="2 of 11 tokens .* no recorded routing"):
        with replay.replay(own):  # the last row's two extra tokens follow a padded completion
            model(input_ids=longer[2:], attention_mask=torch.cat([mask, mask[:, -2:] * 0 + 1], 1)[2:])
    rows = rr.to_rows(own, ids, mask)
    with pytest.raises(ValueError, match=r"row 1 has routing for 9 tokens, its sequence 8 tokens"):
        truncated = mask.clone()
        truncated[1, 8] = 0
        rr.from_rows(rows, ids, truncated)
    with pytest.raises(ValueError, match=r"experts \(2, 26, 2\) must be \(layers, tokens, top_k\) for the 27"):
        rr.Routing(own.keys, own.checks, own.experts[:, :26])


def test_a_dense_model_is_refused_by_name():
    dense = build_tiny_qwen3(TOKENIZER)
    assert "dense" in rr.unsupported_reason(dense)
    with pytest.raises(ValueError, match="dense model"):
        rr.RoutingReplay(dense)
    assert rr.unsupported_reason(tiny_moe()) is None


def test_routers_of_another_shape_are_refused_by_name():
    class DeepseekV3TopKRouter(torch.nn.Module):  # grouped top-k with a bias: not a shape replay supports
        pass

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), DeepseekV3TopKRouter())
    assert "DeepseekV3TopKRouter" in rr.unsupported_reason(model)
    with pytest.raises(ValueError, match="DeepseekV3TopKRouter"):
        rr.RoutingReplay(model)
