"""share_prompts: grouping, positions and masks (pure), the per-group attention against a softmax written out here,
shared forwards against the unshared packed forward and the padded model (log-probs, entropies, gradients), and the
update through the real trainer against `share_prompts=False`."""

import json
import math
import random

import pytest
import shared_rows
import torch
from long_tail import dataset, length_reward
from test_padding_free import CPU, RUN, parameter_change, passes_of, relative_gap, sliding_qwen3, unpacked
from transformers import MambaConfig, MambaForCausalLM
from trl.trainer.utils import add_fused_lm_head

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.core.presets import config_for
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.training import batching, packing
from dhpo_trl.training import shared_prompts as sp
from zero3_config import assert_none_resident


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def batch(prompts, spec, prompt_width, completion_width, seed=0):
    """TRL's layout: row r holds prompts[p] left-padded and c random completion tokens right-padded, (p, c) = spec[r]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(spec), prompt_width + completion_width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(spec):
        prompt = torch.as_tensor(prompts[p])
        ids[row, prompt_width - len(prompt) : prompt_width] = prompt
        mask[row, prompt_width - len(prompt) : prompt_width] = 1
        ids[row, prompt_width : prompt_width + c] = torch.randint(3, 90, (c,), generator=gen)
        mask[row, prompt_width : prompt_width + c] = 1
    return ids, mask


# ----------------------------------------------------------------------------------------------- pure parts
def test_groups_and_sequences():
    assert sp.groups([(1, 2), (3,), (1, 2), (1, 2, 0), (3,)]) == [[0, 2], [1, 4], [3]]
    ids, mask = batch([[5, 6, 7], [5, 6], [9]], [(0, 2), (1, 3), (0, 0), (2, 1)], 4, 3)
    mask[3] = 0  # no attended token at all: keeps its last prompt column (as padding_free forwards it)
    seqs = sp.sequences(ids[:, :4], mask[:, :4], mask[:, 4:])
    assert seqs.keys == [(5, 6, 7), (5, 6), (5, 6, 7), (9,)]
    assert seqs.prompts == [3, 2, 3, 1] and seqs.completions == [2, 3, 0, 0]
    # prefix once (prompt - 1), then each suffix (last prompt token + completion); a 1-token prompt is not shared
    assert sp.tokens(seqs, [0, 2]) == 2 + 3 + 1 and sp.tokens(seqs, [0]) == 5
    assert sp.row_tokens(seqs, [0, 1, 2, 3]) == 6 + 5 + 1
    assert not sp.shares(1, 5) and not sp.shares(4, 1) and sp.shares(2, 2)


def test_pack_positions_labels_and_masks():
    a, b, c, x, y, z = 11, 12, 13, 21, 22, 23
    ids = torch.tensor([[a, b, c, x, y], [0, 0, 40, 41, 0], [a, b, c, z, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 0], [1, 1, 1, 1, 0]])
    (row,) = sp.pack(ids, mask, 2, [[0, 1, 2]])
    # group [0, 2] first (first appearance): prefix [a, b], suffixes [c, x, y] and [c, z]; then sequence 1 alone
    assert row.input_ids.tolist() == [[a, b, c, x, y, c, z, 40, 41]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3, 0, 1]]
    assert row.targets.tolist() == [[x, y, z, 41]]  # the scored tokens, in row order
    assert row.segments.lengths == (2, 3, 2, 2) and row.segments.prefix == (-1, 0, 0, -1)
    assert row.cu_seqlens.tolist() == [0, 2, 5, 7, 9]
    assert row.segments.masks[0] is None and row.segments.masks[3] is None
    assert row.segments.masks[1].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert row.segments.masks[2].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    # scored tokens: (batch row, completion column) <- the row position whose hidden state predicts it
    scored = sorted(zip(row.rows.tolist(), row.columns.tolist(), row.predictors.tolist()))
    assert scored == [(0, 0, 2), (0, 1, 3), (1, 0, 7), (2, 0, 5)]


def check_shared_rows(rows, seqs, count, budget):
    assert len(rows) == count and all(rows)
    assert sorted(i for row in rows for i in row) == list(range(len(seqs.keys)))
    for row in rows:
        assert len(row) == 1 or budget is None or sp.row_tokens(seqs, row) <= budget


def random_sequences(rng, n):
    prompts = [tuple(rng.randint(3, 9) for _ in range(rng.randint(1, 30))) for _ in range(rng.randint(1, 6))]
    keys = [rng.choice(prompts) for _ in range(n)]
    return sp.Sequences(keys, [len(k) for k in keys], [rng.choice([0, rng.randint(1, 20), rng.randint(1, 200)])
                                                       for _ in range(n)])  # fmt: skip


@pytest.mark.parametrize("seed", range(40))
def test_plan_rows_properties(seed):
    rng = random.Random(seed)
    seqs = random_sequences(rng, rng.randint(1, 30))
    budget = rng.choice([None, 1, rng.randint(30, 250), 10_000])
    needed = sp.rows_needed(seqs, budget)
    for count in sorted({needed, min(len(seqs.keys), needed + rng.randint(0, 5)), len(seqs.keys)}):
        rows = sp.plan_rows(seqs, count, budget)
        check_shared_rows(rows, seqs, count, budget)
        if budget is None and count <= len(sp.groups(seqs.keys)):  # nothing forces a split: a group stays whole
            assert all(len({tuple(r) for r in rows if i in r}) == 1 and set(g) <= set(next(r for r in rows if i in r))
                       for g in sp.groups(seqs.keys) for i in g[:1])  # fmt: skip
    with pytest.raises(ValueError, match="cannot pack"):
        sp.plan_rows(seqs, len(seqs.keys) + 1, budget)


def test_plan_keeps_groups_whole_and_saves_their_prompts():
    # 3 prompts x 4 completions, shuffled; 3 rows: each row one group, its prompt forwarded once
    keys = [tuple(range(10))] * 4 + [tuple(range(20))] * 4 + [tuple(range(30))] * 4
    order = random.Random(0).sample(range(12), 12)
    seqs = sp.Sequences([keys[i] for i in order], [len(keys[i]) for i in order], [5] * 12)
    rows = sp.plan_rows(seqs, 3)
    assert sorted(len({seqs.keys[i] for i in row}) for row in rows) == [1, 1, 1]
    # unshared these rows forward 12 prompts (240 tokens); shared: each prefix once and the last token 4 times
    assert sum(sp.row_tokens(seqs, row) for row in rows) == (9 + 19 + 29) + 12 * (1 + 5)
    # a budget below a whole group splits it into parts that each carry the prefix
    rows = sp.plan_rows(seqs, sp.rows_needed(seqs, 40), 40)
    check_shared_rows(rows, seqs, len(rows), 40)
    assert len(rows) > 3


def test_rows_never_mix_optimizer_steps():
    """Two accumulation windows holding the same prompts: every pass's sequences come from its own window."""
    prompts = [[5, 6, 7, 8], [9, 9, 4]]
    spec = [(0, 3), (1, 2), (0, 5), (1, 1)]
    micro = []
    for tag in range(4):  # 4 micro-batches, 2 per window; `advantages` tags each sequence with its micro-batch
        ids, mask = batch(prompts, spec, 4, 5, seed=tag)
        micro.append({"prompt_ids": ids[:, :4], "prompt_mask": mask[:, :4], "completion_ids": ids[:, 4:],
                      "completion_mask": mask[:, 4:], "advantages": torch.full((4,), float(tag))})  # fmt: skip
    for budget in (None, 6):  # 6: no two sequences of a group fit one row together
        planned, sums = sp.plan_generation_batch(micro, 2, budget)
        assert len(planned) == 4
        for step, passes in enumerate(planned):
            parts = passes if isinstance(passes, list) else [passes]
            tags = {float(t) for part in parts for t in part["advantages"]}
            assert tags <= ({0.0, 1.0} if step < 2 else {2.0, 3.0})
            assert all(part[batching.WINDOW].sequences == 8 for part in parts)
        passes = [p for m in planned for p in (m if isinstance(m, list) else [m])]
        forwarded, total = shared_rows.prompt_tokens(passes)
        assert total == 4 * (4 + 3 + 4 + 3) and (forwarded < total) == (budget is None)
        # the plan's own sums: its prompt tokens, and packed rows' real = forwarded tokens
        real = sum(int(p["prompt_mask"].sum() + p["completion_mask"].sum()) for p in passes)
        assert (sums["shared_prompt_forwarded"], sums["shared_prompt_total"]) == (forwarded, total)
        assert sums["padding_real"] == sums["padding_forwarded"] == real


# ----------------------------------------------------------------------------------------------- attention
def reference_attention(query, key, value, segments, scale):
    """Softmax attention written out: each segment over [its prefix's keys; its own] (causal on its own)."""
    groups = query.size(1) // key.size(1)
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    bounds = [0, *torch.tensor(segments.lengths).cumsum(0).tolist()]
    out = torch.zeros_like(query)
    for index, prefix in enumerate(segments.prefix):
        start, end = bounds[index], bounds[index + 1]
        visible = list(range(bounds[prefix], bounds[prefix + 1])) if prefix >= 0 else []
        columns = visible + list(range(start, end))
        scores = query[0, :, start:end] @ key[0, :, columns].transpose(-1, -2) * scale
        allowed = torch.tensor([[c < start or c <= start + i for c in columns] for i in range(end - start)])
        out[0, :, start:end] = scores.masked_fill(~allowed, -math.inf).softmax(-1) @ value[0, :, columns]
    return out.transpose(1, 2)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_shared_attention_equals_the_written_out_softmax(kv_heads):
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0], [0, 0, 0, 0, 8, 9, 0, 0], [1, 2, 3, 4, 5, 6, 7, 7]])
    mask = torch.tensor([[1] * 8, [0, 0, 0, 0, 1, 1, 1, 0], [1] * 8])
    (row,) = sp.pack(ids, mask, 3, [[0, 1, 2]])
    segments = row.segments
    length = sum(segments.lengths)
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, length, 8, generator=gen)
    key, value = torch.randn(1, kv_heads, length, 8, generator=gen), torch.randn(1, kv_heads, length, 8, generator=gen)
    out, weights = sp.shared_sdpa_attention(None, query, key, value, None, scaling=0.3, shared_segments=segments)
    assert weights is None and out.shape == (1, length, 4, 8)
    torch.testing.assert_close(out, reference_attention(query, key, value, segments, 0.3), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shared_segments"):
        sp.shared_sdpa_attention(None, query, key, value, None)


# ------------------------------------------------------------------------------------------- shared forward
def forward_and_gradient(model, packed, shape, weights):
    model.zero_grad()
    logps, entropies, _ = packing.forward_packed(model, packed, shape, True, False, torch.enable_grad)
    ((logps * weights).sum() + 0.3 * entropies.sum()).backward()
    return logps.detach(), entropies.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_log_probs_entropies_and_gradient_equal_the_unshared_forward(tok, checkpointing):
    model = build_tiny_qwen3(tok, seed=3)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    if checkpointing:  # recomputation in backward replays the shared layout (it travels in the forward's kwargs)
        model.gradient_checkpointing_enable()
        model.train()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (7, 12, 1, 5)]
    spec = [(0, 9), (0, 3), (1, 20), (0, 0), (2, 4), (2, 6), (1, 11), (3, 7), (0, 1), (1, 2)]
    ids, mask = batch(prompts, spec, 12, 20, seed=2)
    shape = (len(spec), 20)
    weights = torch.randn(shape, generator=gen)
    rows = [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]] if not checkpointing else [[0, 1, 3, 6], [2, 4, 5, 7, 8, 9]]
    shared = sp.pack(ids, mask, 20, rows)
    assert sum(row.input_ids.numel() for row in shared) < int(mask.sum())  # prompts were shared
    logps, entropies, gradient = forward_and_gradient(model, shared, shape, weights)
    ref_logps, ref_entropies, ref_gradient = forward_and_gradient(model, packing.pack(ids, mask, 20, rows), shape,
                                                                  weights)  # fmt: skip
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropies, ref_entropies, atol=1e-5, rtol=1e-5)
    assert gradient.norm() > 0 and relative_gap(gradient, ref_gradient) < 1e-5
    with torch.no_grad():  # and the padded model TRL runs
        padded_logps, padded_entropies = unpacked(model, ids, mask, 20)
    torch.testing.assert_close(logps, padded_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropies, padded_entropies, atol=1e-5, rtol=1e-5)
    assert (logps[mask[:, 12:] == 0] == 0).all()


# ------------------------------------------------------------------------------------------ through the trainer
def test_settings_and_models_share_prompts_cannot_serve_are_refused(tok, tmp_path):
    base = dict(output_dir=str(tmp_path), **CPU, **RUN)
    with pytest.raises(ValueError, match=r"share_prompts=True .*padding_free=True"):
        DHPOConfig(share_prompts=True, padding_free=False, **base)
    with pytest.raises(ValueError, match=r"share_prompts=True .*dynamic_batching=True"):
        DHPOConfig(share_prompts=True, dynamic_batching=False, **base)
    assert DHPOConfig(share_prompts=True, **base).padding_free is None  # automatic: the trainer decides
    # automatic padding_free that stays off for this model: sharing cannot act, refused naming padding_free
    sliding = sliding_qwen3(tok)
    with pytest.raises(ValueError, match="share_prompts"):  # the wording: test_update_path.py
        DHPOTrainer(model=sliding, reward_funcs=length_reward, processing_class=tok,
                    args=config_for("GRPO", share_prompts=True, **base), train_dataset=dataset())
    with pytest.raises(ValueError, match=r"share_prompts=1 must be True or False"):
        DHPOConfig(share_prompts=1, padding_free=True, **base)
    assert DHPOConfig(**base).share_prompts is False  # the default
    flash = build_tiny_qwen3(tok)
    flash.config._attn_implementation = "flash_attention_2"  # packed rows run, but not the per-group attention
    assert packing.unsupported_model_reason(flash) is None
    args = config_for("GRPO", padding_free=True, share_prompts=True, **base)
    with pytest.raises(ValueError, match="share_prompts"):  # the wording: test_update_path.py
        DHPOTrainer(model=flash, reward_funcs=length_reward, processing_class=tok, args=args, train_dataset=dataset())
    mamba = MambaForCausalLM(MambaConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, state_size=4))
    assert "AttentionInterface" in sp.unsupported_model_reason(mamba)


@pytest.mark.parametrize("budget", [None, 60])
def test_trainer_update_equals_the_unshared_update(tok, tmp_path, budget):
    """DHPO-E off-policy (steps_per_generation = 2 x accumulation), old-log-prob passes (num_iterations=2), with and
    without a token budget: the same parameters as share_prompts=False; prompts really were shared."""
    run = {**RUN, "num_iterations": 2, "max_tokens_per_micro_batch": budget}
    common = dict(output_dir=str(tmp_path), entropy_norm_scope="sequence", padding_free=True, **run, **CPU)
    base, _ = parameter_change(tok, config_for("DHPO-E", **common))
    shared, trainer = parameter_change(tok, config_for("DHPO-E", share_prompts=True, **common))
    assert base.norm() > 1e-3 and relative_gap(shared, base) < 1e-4
    passes = passes_of(trainer)
    assert sum(part["completion_mask"].size(0) for part in passes) == 16  # every sequence once
    forwarded, total = shared_rows.prompt_tokens(passes)
    assert forwarded < total
    # the logged share of prompt tokens not forwarded, once per generation batch: the last one counted here
    saved = [entry["batching/prompt_tokens_saved"] for entry in trainer.state.log_history
             if "batching/prompt_tokens_saved" in entry]  # fmt: skip
    assert saved and saved[-1] == pytest.approx((total - forwarded) / total, rel=1e-6)
    if budget is not None:  # the row each pass forwards, counted on the packed row itself
        for part in passes:
            ids = torch.cat([part["prompt_ids"], part["completion_ids"]], 1)
            mask = torch.cat([part["prompt_mask"], part["completion_mask"]], 1)
            (row,) = sp.pack(ids, mask, part["completion_ids"].size(1), [list(range(ids.size(0)))])
            assert ids.size(0) == 1 or row.input_ids.numel() <= budget


def test_gradient_checkpointing_lora_and_moe_update_as_unshared(tok, tmp_path):
    from peft import LoraConfig

    def pair(build, args=None, **kwargs):
        common = dict(output_dir=str(tmp_path), padding_free=True, **RUN, **CPU, **(args or {}))
        shared, trainer = parameter_change(tok, config_for("DHPO-A", share_prompts=True, **common), model=build(),
                                           **kwargs)  # fmt: skip
        base, _ = parameter_change(tok, config_for("DHPO-A", **common), model=build(), **kwargs)
        forwarded, total = shared_rows.prompt_tokens(passes_of(trainer))
        assert forwarded < total and base.norm() > 0
        return relative_gap(shared, base)

    assert pair(lambda: build_tiny_qwen3(tok, seed=0), args=dict(gradient_checkpointing=True)) < 1e-4
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    assert pair(lambda: build_tiny_qwen3(tok, seed=0), peft_config=lora) < 1e-4

    def moe():  # routing is per token: without the aux term (which counts a shared prompt once) the same update
        model = build_tiny_qwen3(tok, seed=0, moe=True)
        model.config.output_router_logits = False
        return model

    assert pair(moe, args=dict(router_aux_loss_coef=0.0)) < 1e-4


@pytest.mark.parametrize("engine", ["ddp", "zero3"])
def test_two_processes_agree_on_shared_rows_and_update_as_trl(two_process_update_paths, engine):
    """2 ranks, a budget of real tokens (45), shared prompts: every micro-step runs the same number of rows on both
    ranks (the shared plan's counts agreed by the all-reduce), and the update equals TRL's batching on 2 ranks."""
    if engine == "zero3":
        pytest.importorskip("deepspeed")
    result, tmp_path = two_process_update_paths(engine)  # the launch every update path's test shares
    assert result["returncode"] == 0, result["stderr"]
    if engine == "zero3":  # every run's parameters partitioned, none resident: an unagreed pass blocks the launch
        for run in ("trl", "budget", "packed", "shared"):
            assert_none_resident(*(json.loads((tmp_path / run / f"residency_rank{rank}.json").read_text())
                                   for rank in (0, 1)))  # fmt: skip
    trl = torch.load(tmp_path / "trl" / "params.pt")
    shared = torch.load(tmp_path / "shared" / "params.pt")
    start = dict(build_tiny_qwen3(build_char_tokenizer(), seed=0).named_parameters())
    change_trl = torch.cat([(trl[n] - start[n]).flatten() for n in trl])
    change_shared = torch.cat([(shared[n] - start[n]).flatten() for n in trl])
    assert change_trl.norm() > 1e-3 and relative_gap(change_shared, change_trl) < 1e-3
    plans = [json.loads((tmp_path / "shared" / f"plan_rank{rank}.json").read_text()) for rank in (0, 1)]
    for plan0, plan1 in zip(*plans, strict=True):  # one entry per generation batch
        assert [len(step) for step in plan0["rows_per_pass"]] == [len(step) for step in plan1["rows_per_pass"]]
        assert sum(map(sum, plan0["rows_per_pass"])) == sum(map(sum, plan1["rows_per_pass"])) == 16
        for plan in (plan0, plan1):  # the prompts really were shared
            forwarded, total = plan["prompt_tokens"]
            assert forwarded < total
