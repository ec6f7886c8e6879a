"""padding_free: the per-sequence attention, packed forwards, and the update through the real trainer against
`padding_free=False` (dynamic batching) and TRL's `GRPOTrainer`. The packing plan is tested on its own in
tests/test_batching.py.

References are independent computations: attention against a per-sequence softmax written out here, packed
log-probs against the unpacked padded forward TRL runs, parameter changes against runs that never pack.
"""

import json
import math
import warnings

import pytest
import torch
from long_tail import MAX_COMPLETION, dataset, length_reward, long_tailed_rollout
from transformers import MambaConfig, MambaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.core.presets import PAPER_ALGORITHMS, config_for
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.training import batching, packing, update_path

CPU = dict(use_cpu=True, bf16=False, report_to="none", seed=0, data_seed=0, save_strategy="no", logging_steps=1)
RUN = dict(
    per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2, steps_per_generation=4,
    max_completion_length=MAX_COMPLETION, max_steps=4, optim="sgd", learning_rate=0.5, mask_truncated_completions=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


# ----------------------------------------------------------------------------------------------- attention
def per_sequence_attention(query, key, value, bounds, scale):
    """Causal softmax attention of each sequence on its own, written out (key/value heads repeated for GQA)."""
    groups = query.size(1) // key.size(1)
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = torch.zeros_like(query)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        scores = query[0, :, start:end] @ key[0, :, start:end].transpose(-1, -2) * scale
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        out[0, :, start:end] = scores.masked_fill(~causal, -math.inf).softmax(-1) @ value[0, :, start:end]
    return out.transpose(1, 2)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_attention_equals_per_sequence_attention(kv_heads):
    gen = torch.Generator().manual_seed(0)
    bounds = [0, 5, 6, 19, 40]
    query = torch.randn(1, 4, 40, 8, generator=gen)
    key, value = torch.randn(1, kv_heads, 40, 8, generator=gen), torch.randn(1, kv_heads, 40, 8, generator=gen)
    out, weights = packing.packed_sdpa_attention(None, query, key, value, None, scaling=0.3,
                                                 cu_seq_lens_q=torch.tensor(bounds, dtype=torch.int32))  # fmt: skip
    assert weights is None and out.shape == (1, 40, 4, 8)
    torch.testing.assert_close(out, per_sequence_attention(query, key, value, bounds, 0.3), atol=1e-5, rtol=1e-5)
    # one attention over the whole row (what a packed row without boundaries would get) differs
    whole = per_sequence_attention(query, key, value, [0, 40], 0.3)
    assert (whole[:, 5:] - out[:, 5:]).abs().max() > 1e-2
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        packing.packed_sdpa_attention(None, query, key, value, None)
    with pytest.raises(ValueError, match="sliding_window"):
        packing.packed_sdpa_attention(None, query, key, value, None, cu_seq_lens_q=torch.tensor(bounds),
                                      sliding_window=4)  # fmt: skip


# -------------------------------------------------------------------------------------------- packed forward
def padded_batch(tok, vocab, seed=0):
    """Left-padded prompts, right-padded completions (one empty completion), as TRL concatenates them."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths, completion_lengths = [3, 10, 1, 7, 5, 10, 2], [20, 4, 1, 12, 0, 9, 17]
    prompt_width, completion_width = 10, 20
    rows = len(prompt_lengths)
    ids = torch.full((rows, prompt_width + completion_width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        ids[row, prompt_width - p : prompt_width + c] = torch.randint(3, vocab, (p + c,), generator=gen)
        mask[row, prompt_width - p : prompt_width + c] = 1
    return ids, mask, completion_width


def unpacked(model, ids, mask, keep):
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -keep:], out.entropy[:, -keep:]


@pytest.mark.parametrize("rows", [[[0, 1, 2, 3, 4, 5, 6]], [[6, 0, 3], [1, 2], [4, 5]], [[4], [0, 1, 2, 3, 5, 6]]])
def test_packed_forward_equals_the_unpacked_model(tok, rows):
    """Values and gradients; the third plan has a row whose only sequence has no completion token (nothing scored)."""
    model = build_tiny_qwen3(tok, seed=3)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids, mask, keep = padded_batch(tok, model.config.vocab_size)
    weights = torch.randn(7, keep, generator=torch.Generator().manual_seed(1))

    def gradient(logps, entropies):
        model.zero_grad()
        ((logps * weights).sum() + entropies.sum()).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    ref_logps, ref_entropies = unpacked(model, ids, mask, keep)
    ref_gradient = gradient(ref_logps, ref_entropies)
    packed = packing.pack(ids, mask, keep, rows)
    logps, entropies, aux = packing.forward_packed(model, packed, (7, keep), True, False, torch.enable_grad)
    packed_gradient = gradient(logps, entropies)
    with torch.no_grad():
        again_logps, _ = unpacked(model, ids, mask, keep)  # padded forwards keep the model's own attention
    assert aux is None and model.config._attn_implementation == "dhpo_packed_sdpa"
    torch.testing.assert_close(again_logps, ref_logps, atol=0, rtol=0)
    assert sum(row.input_ids.numel() for row in packed) == int(mask.sum())  # no padding forwarded
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropies, ref_entropies, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_gradient, ref_gradient, atol=1e-5, rtol=1e-4)
    assert (logps[mask[:, -keep:] == 0] == 0).all() and (logps[mask[:, -keep:] == 1] != 0).all()
    first = packed[0]
    assert first.position_ids[0, 0] == 0 and (first.position_ids[0, first.cu_seqlens[1:-1].long()] == 0).all()
    # the head runs on the scored positions only: one per completion token that has a previous token
    assert sum(row.predictors.numel() for row in packed if row.rows.numel()) == int(mask[:, -keep:].sum())


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_generation_keeps_the_models_attention(tok, implementation):
    model = build_tiny_qwen3(tok, seed=5)
    model.config._attn_implementation = implementation
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids, mask, keep = padded_batch(tok, model.config.vocab_size)
    prompts, prompt_mask = ids[:, :-keep], mask[:, :-keep]
    with torch.no_grad():
        before = model.generate(input_ids=prompts, attention_mask=prompt_mask, max_new_tokens=8, do_sample=False)
        packed = packing.pack(ids, mask, keep, [[0, 1, 2, 3], [4, 5, 6]])
        logps, _, _ = packing.forward_packed(model, packed, (7, keep), False, False, torch.enable_grad)
        ref_logps, _ = unpacked(model, ids, mask, keep)
        after = model.generate(input_ids=prompts, attention_mask=prompt_mask, max_new_tokens=8, do_sample=False)
    assert model.config._attn_implementation == f"dhpo_packed_{implementation}"
    assert torch.equal(before, after)  # left-padded generation: the model's own attention and mask
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=1e-5)


def test_with_a_cache_packed_sequences_attend_across_each_other(tok):
    """Why every packed forward passes use_cache=False: with a cache, transformers skips its packed-sequence
    detection (position_ids restarting at 0) and the second sequence attends to the first."""
    model = build_tiny_qwen3(tok, seed=4)
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randint(3, 90, (1, 6), generator=gen), torch.randint(3, 90, (1, 9), generator=gen)
    row = torch.cat([first, second], 1)
    positions = torch.cat([torch.arange(6), torch.arange(9)]).unsqueeze(0)
    with torch.no_grad():
        alone = model(input_ids=second).logits
        without_cache = model(input_ids=row, position_ids=positions, use_cache=False).logits[:, 6:]
        with_cache = model(input_ids=row, position_ids=positions, use_cache=True).logits[:, 6:]
    torch.testing.assert_close(without_cache, alone, atol=1e-5, rtol=1e-5)
    assert (with_cache - alone).abs().max() > 1e-2


def test_models_packing_cannot_serve_are_named(tok):
    assert packing.unsupported_model_reason(build_tiny_qwen3(tok)) is None
    mamba = MambaForCausalLM(MambaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, state_size=4))
    assert "AttentionInterface" in packing.unsupported_model_reason(mamba)
    config = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
                         max_window_layers=1)  # fmt: skip
    sliding = Qwen3ForCausalLM(config)
    assert "sliding" in packing.unsupported_model_reason(sliding)
    sliding.config._attn_implementation = "flash_attention_2"  # the varlen path applies the window per sequence
    assert packing.unsupported_model_reason(sliding) is None


# ------------------------------------------------------------------------------------------ through the trainer
def parameter_change(tok, config, trainer_cls=DHPOTrainer, model=None, truncated_every=5, **trainer_kwargs):
    trainer = trainer_cls(
        model=model or build_tiny_qwen3(tok, seed=0), reward_funcs=length_reward, args=config,
        train_dataset=dataset(), processing_class=tok, rollout_func=long_tailed_rollout(tok, truncated_every),
        **trainer_kwargs,
    )  # fmt: skip
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in trained]
    trainer.train()
    return torch.cat([(p.detach() - s).flatten() for p, s in zip(trained, start, strict=True)]), trainer


def relative_gap(a, b):
    return ((a - b).norm() / b.norm()).item()


def passes_of(trainer):
    return [part for micro in trainer._buffered_inputs for part in (micro if isinstance(micro, list) else [micro])]


def sliding_qwen3(tok):
    config = Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
                         max_window_layers=1, pad_token_id=tok.pad_token_id)  # fmt: skip
    return Qwen3ForCausalLM(config)


def test_settings_padding_free_cannot_honour_are_refused(tok, tmp_path):
    base = dict(output_dir=str(tmp_path), **CPU, **RUN)
    with pytest.raises(ValueError, match=r"padding_free=True .*dynamic_batching=True"):
        DHPOConfig(padding_free=True, dynamic_batching=False, **base)
    with pytest.raises(ValueError, match=r"padding_free='yes'"):
        DHPOConfig(padding_free="yes", **base)
    with pytest.raises(ValueError, match="padding_free"):  # the wording: test_update_path.py
        DHPOTrainer(model=sliding_qwen3(tok), reward_funcs=length_reward, processing_class=tok,
                    args=config_for("GRPO", padding_free=True, **base), train_dataset=dataset())  # fmt: skip


def test_automatic_choice_packs_on_cpu_and_on_cuda_with_flash_attention_only(tok):
    model, reference = build_tiny_qwen3(tok), build_tiny_qwen3(tok)
    assert packing.automatic_reason([model, reference], "cpu") is None
    assert "padding_free=True" in packing.automatic_reason([model], "cuda")  # sdpa on a GPU: unmeasured, opt in
    assert "padding_free=True" in packing.automatic_reason([model], "mps")
    model.config._attn_implementation = "flash_attention_2"  # transformers' varlen path
    assert packing.automatic_reason([model], "cuda") is None
    assert "sliding" in packing.automatic_reason([build_tiny_qwen3(tok), sliding_qwen3(tok)], "cpu")  # ref model
    mamba = MambaForCausalLM(MambaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, state_size=4))
    assert "AttentionInterface" in packing.automatic_reason([mamba], "cpu")


def logged_padding(trainer):
    return [entry["batching/padding_fraction"] for entry in trainer.state.log_history
            if "batching/padding_fraction" in entry]  # fmt: skip


def test_the_default_packs_on_cpu_and_keeps_dynamic_batching_where_packing_cannot_act(tok, tmp_path, capsys):
    """padding_free=None (the default): packed rows on CPU with the same update as padding_free=True; dynamic
    batching, with one printed line, on a model packing cannot serve; off with dynamic_batching=False."""
    run = dict(output_dir=str(tmp_path), **{**RUN, "max_steps": 2}, **CPU)
    assert DHPOConfig(**run).padding_free is None
    automatic, trainer = parameter_change(tok, config_for("DHPO-A", **run))
    assert logged_padding(trainer) and all(value == 0.0 for value in logged_padding(trainer))
    explicit, _ = parameter_change(tok, config_for("DHPO-A", padding_free=True, **run))
    assert automatic.norm() > 1e-3 and relative_gap(automatic, explicit) < 1e-6
    capsys.readouterr()
    _, trainer = parameter_change(tok, config_for("DHPO-A", **run), model=sliding_qwen3(tok))
    printed = [line for line in capsys.readouterr().out.splitlines() if "padding_free" in line]
    assert len(printed) == 1 and "sliding" in printed[0]
    assert logged_padding(trainer) and all(value > 0.0 for value in logged_padding(trainer))
    _, trainer = parameter_change(tok, config_for("DHPO-A", dynamic_batching=False, **run))
    assert logged_padding(trainer) and all(value > 0.0 for value in logged_padding(trainer))


@pytest.mark.parametrize("row", ["GRPO", "GSPO", "GMPO", "CISPO", "DHPO-A", "DHPO-E"])
def test_rows_update_as_without_packing(tok, row, tmp_path):
    # DHPO-E's default entropy min-max is per micro-batch, which any regrouping changes: per sequence here
    extra = dict(entropy_norm_scope="sequence") if row == "DHPO-E" else {}
    # against dynamic batching: the automatic default packs on CPU, so it would compare packed rows with themselves
    base, unpacked = parameter_change(tok, config_for(row, output_dir=str(tmp_path), padding_free=False, **extra,
                                                      **RUN, **CPU))  # fmt: skip
    packed, trainer = parameter_change(tok, config_for(row, output_dir=str(tmp_path), padding_free=True, **extra,
                                                       **RUN, **CPU))  # fmt: skip
    assert (unpacked._update.path, trainer._update.path) == (batching.DYNAMIC, packing.PACKED)
    assert base.norm() > 1e-3 and relative_gap(packed, base) < 1e-3
    padding = [entry["batching/padding_fraction"] for entry in trainer.state.log_history
               if "batching/padding_fraction" in entry]  # fmt: skip
    assert padding and all(value == 0.0 for value in padding)


def test_grpo_row_updates_as_trl_grpo_trainer(tok, tmp_path):
    row = {key: value for key, value in PAPER_ALGORITHMS["GRPO"].items() if key != "algorithm"}
    trl, _ = parameter_change(tok, GRPOConfig(str(tmp_path / "trl"), loss_type="grpo", **row, **RUN, **CPU),
                              trainer_cls=GRPOTrainer)  # fmt: skip
    ours, _ = parameter_change(tok, config_for("GRPO", output_dir=str(tmp_path), padding_free=True, **RUN, **CPU))
    assert trl.norm() > 1e-3 and relative_gap(ours, trl) < 1e-3


def test_token_budget_counts_real_tokens_with_the_same_update(tok, tmp_path):
    run = {**RUN, "num_iterations": 2}
    base, _ = parameter_change(tok, config_for("DHPO-A", output_dir=str(tmp_path), **run, **CPU))
    budget = 45  # below the longest sequences (prompt + 40 completion tokens + ...): those get a row of their own
    packed, trainer = parameter_change(tok, config_for("DHPO-A", output_dir=str(tmp_path), padding_free=True,
                                                       max_tokens_per_micro_batch=budget, **run, **CPU))  # fmt: skip
    assert relative_gap(packed, base) < 1e-3
    passes = passes_of(trainer)
    real = [sum(batching.token_counts(part["prompt_mask"], part["completion_mask"])) for part in passes]
    assert all(tokens <= budget or part["completion_mask"].size(0) == 1 for tokens, part in zip(real, passes))
    assert any(part["completion_mask"].size(0) > 1 for part in passes)  # rows hold several sequences
    assert sum(part["completion_mask"].size(0) for part in passes) == 16  # every sequence once
    for window in (trainer._buffered_inputs[0:2], trainer._buffered_inputs[2:4]):
        parts = [part for micro in window for part in (micro if isinstance(micro, list) else [micro])]
        assert {float(part[batching.WINDOW].passes) for part in parts} == {len(parts)}
        assert {float(part[batching.WINDOW].sequences) for part in parts} == {8}


def test_kl_and_every_forward_packed(tok, tmp_path):
    """KL (a reference pass) and num_iterations=2 (an old-log-prob pass): each forward of the run is one packed
    row, and the update is the unpacked one. (TRL's top-entropy threshold is per micro-batch, so a regrouping
    changes it: it is compared on identical micro-batches below.)"""
    build_tiny_qwen3(tok, seed=0).save_pretrained(tmp_path / "model")
    features = dict(beta=0.05, num_iterations=2)

    def run(**overrides):
        model = Qwen3ForCausalLM.from_pretrained(tmp_path / "model")
        shapes = []
        hook = model.model.register_forward_hook(
            lambda module, args, kwargs, output: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
        )
        config = config_for("DHPO-A", output_dir=str(tmp_path), **features, **overrides, **RUN, **CPU)
        change, trainer = parameter_change(tok, config, model=model)
        hook.remove()
        return change, trainer, shapes

    base, _, base_shapes = run(padding_free=False, max_tokens_per_micro_batch=200)
    packed, trainer, shapes = run(padding_free=True, max_tokens_per_micro_batch=200)
    assert trainer.ref_model is not None and relative_gap(packed, base) < 1e-3
    assert shapes and all(rows == 1 for rows, _ in shapes)  # policy and old-log-prob passes: one packed row each
    assert sum(rows * width for rows, width in shapes) < sum(rows * width for rows, width in base_shapes)


def test_gradient_checkpointing_lora_and_moe(tok, tmp_path):
    from peft import LoraConfig

    def pair(build, args=None, **kwargs):
        common = dict(output_dir=str(tmp_path), **RUN, **CPU, **(args or {}))
        packed, trainer = parameter_change(tok, config_for("DHPO-A", padding_free=True, **common), model=build(),
                                           **kwargs)  # fmt: skip
        base, _ = parameter_change(tok, config_for("DHPO-A", **common), model=build(), **kwargs)
        return packed, base, trainer

    packed, base, _ = pair(lambda: build_tiny_qwen3(tok, seed=0), args=dict(gradient_checkpointing=True))
    assert relative_gap(packed, base) < 1e-3
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    packed, base, _ = pair(lambda: build_tiny_qwen3(tok, seed=0), peft_config=lora)
    assert base.norm() > 0 and relative_gap(packed, base) < 1e-3

    def moe():
        model = build_tiny_qwen3(tok, seed=0, moe=True)
        model.config.output_router_logits = False
        return model

    # routing is per token: without the aux term the update is the unpacked one; the aux loss is a per-forward mean
    packed, base, _ = pair(moe, args=dict(router_aux_loss_coef=0.0))
    assert relative_gap(packed, base) < 1e-3
    _, _, trainer = pair(moe)
    aux = [entry["aux_loss"] for entry in trainer.state.log_history if "aux_loss" in entry]
    assert aux and all(math.isfinite(value) and value > 0 for value in aux)


def test_same_micro_batches_same_gradient_with_kl_masks_and_vllm_correction(tok, tmp_path):
    """On identical micro-batches, packing changes nothing that TRL computes per micro-batch either: KL,
    off-policy mask, top-entropy threshold, vLLM IS correction; the gradient is the unpacked one."""
    from test_dynamic_batching import padded_window, window_gradient

    build_tiny_qwen3(tok, seed=1).save_pretrained(tmp_path / "model")
    model = Qwen3ForCausalLM.from_pretrained(tmp_path / "model")
    window = padded_window(tok, model)
    features = dict(beta=0.05, off_policy_mask_threshold=0.05, top_entropy_quantile=0.5)
    args = config_for("DHPO-A", output_dir=str(tmp_path), **{**RUN, "max_completion_length": 32}, **features, **CPU)
    trainer = DHPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=dataset(),
                          processing_class=tok)  # fmt: skip
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    micro = batching.split_window(window, micro_steps=2)
    trainer._update = update_path.UpdatePath(batching.DYNAMIC)  # the padded forwards of the same micro-batches
    reference = window_gradient(trainer, micro)
    trainer._update = update_path.UpdatePath(packing.PACKED)
    assert relative_gap(window_gradient(trainer, micro), reference) < 1e-5


def test_multimodal_batches_fall_back_with_one_warning(tok, tmp_path):
    args = config_for("DHPO-A", output_dir=str(tmp_path), padding_free=True, **RUN, **CPU)
    trainer = DHPOTrainer(model=build_tiny_qwen3(tok), reward_funcs=length_reward, args=args, train_dataset=dataset(),
                          processing_class=tok)  # fmt: skip
    batch = {"prompt_mask": torch.ones(4, 3), "completion_mask": torch.ones(4, 5), "pixel_values": torch.ones(2, 3)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert trainer._plan_micro_batches([batch, batch]) == [batch, batch]
        trainer._plan_micro_batches([batch, batch])
    messages = [str(w.message) for w in caught if "micro-batches" in str(w.message)]
    assert len(messages) == 1 and "padding_free" in messages[0] and "pixel_values" in messages[0]


# ------------------------------------------------------------------------------------- two processes (gloo)
@pytest.mark.parametrize("engine", ["ddp", "zero3"])
def test_two_processes_agree_on_rows_and_update_as_trl(two_process_update_paths, engine):
    """2 ranks with a budget of real tokens: each micro-step runs the same number of packed rows on both ranks (the
    larger of what each rank's windows need), and the update equals TRL's batching on the same 2 ranks."""
    if engine == "zero3":
        pytest.importorskip("deepspeed")
    result, tmp_path = two_process_update_paths(engine)  # the launch every update path's test shares
    assert result["returncode"] == 0, result["stderr"]
    trl = torch.load(tmp_path / "trl" / "params.pt")
    packed = torch.load(tmp_path / "packed" / "params.pt")
    start = dict(build_tiny_qwen3(build_char_tokenizer(), seed=0).named_parameters())
    change_trl = torch.cat([(trl[n] - start[n]).flatten() for n in trl])
    change_packed = torch.cat([(packed[n] - start[n]).flatten() for n in trl])
    assert change_trl.norm() > 1e-3 and relative_gap(change_packed, change_trl) < 1e-3
    plans = [json.loads((tmp_path / "packed" / f"plan_rank{rank}.json").read_text()) for rank in (0, 1)]
    agreed_by_max = False
    for plan0, plan1 in zip(*plans, strict=True):  # one entry per generation batch
        assert [len(step) for step in plan0["rows_per_pass"]] == [len(step) for step in plan1["rows_per_pass"]]
        assert sum(map(sum, plan0["rows_per_pass"])) == sum(map(sum, plan1["rows_per_pass"])) == 16
        for plan in (plan0, plan1):
            for rows, tokens in zip(sum(plan["rows_per_pass"], []), sum(plan["tokens_per_pass"], []), strict=True):
                assert tokens <= 45 or rows == 1
        for window, (own0, own1) in enumerate(zip(plan0["own_needed"], plan1["own_needed"], strict=True)):
            passes = sum(len(step) for step in plan0["rows_per_pass"][2 * window : 2 * window + 2])
            assert passes == 2 * math.ceil(max(own0, own1) / 2)
            agreed_by_max |= own0 != own1
    assert agreed_by_max  # the ranks' own needs differed somewhere, so the all-reduce mattered
