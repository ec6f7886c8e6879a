"""Dynamic batching through the real trainer: the same update as TRL's batching, with less padding.

Completions come from a deterministic `rollout_func` with long-tailed lengths (and one truncated completion that
`mask_truncated_completions` turns into an all-padding sequence), so runs with and without dynamic batching see
identical sequences, rewards and advantages. Plain SGD makes the parameter change a sum of the window gradients,
so a wrong normalisation of an unevenly filled micro-batch shows up at 1e-2 or more, while trimming left padding
(RoPE positions shift) only moves logits by float rounding.
"""

import json
import math

import pytest
import torch
from long_tail import MAX_COMPLETION, dataset, length_reward, long_tailed_rollout
from transformers import Qwen3ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from dhpo_trl import DHPOTrainer
from dhpo_trl.core.presets import PAPER_ALGORITHMS
from dhpo_trl.core.presets import config_for as preset_config
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.training import batching

CPU = dict(use_cpu=True, bf16=False, report_to="none", seed=0, data_seed=0, save_strategy="no", logging_steps=1)


def config_for(name, **kwargs):
    """This file tests dynamic batching itself: padding_free=False (the automatic default packs rows on CPU;
    tests/test_padding_free.py tests packing)."""
    return preset_config(name, padding_free=False, **kwargs)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def parameter_change(tok, config, trainer_cls=DHPOTrainer, truncated_every=0, model=None, **trainer_kwargs):
    trainer = trainer_cls(
        model=model or build_tiny_qwen3(tok, seed=0), reward_funcs=length_reward, args=config,
        train_dataset=dataset(), processing_class=tok, rollout_func=long_tailed_rollout(tok, truncated_every),
        **trainer_kwargs,
    )  # fmt: skip
    trained = [p for p in trainer.model.parameters() if p.requires_grad]  # after any PEFT wrapping
    start = [p.detach().clone() for p in trained]
    trainer.train()
    change = torch.cat([(p.detach() - s).flatten() for p, s in zip(trained, start, strict=True)])
    return change, trainer


def relative_gap(a, b):
    return ((a - b).norm() / b.norm()).item()


RUN = dict(
    per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2, steps_per_generation=4,
    max_completion_length=MAX_COMPLETION, max_steps=4, optim="sgd", learning_rate=0.5, mask_truncated_completions=True,
)  # fmt: skip


# The settings dynamic batching cannot honour are refused: tests/test_contracts.py.


@pytest.mark.parametrize("row", ["GRPO", "GSPO", "GMPO", "CISPO", "DHPO-A"])
def test_rows_update_as_with_trl_batching(tok, row, tmp_path):
    base, _ = parameter_change(tok, config_for(row, output_dir=str(tmp_path), dynamic_batching=False, **RUN, **CPU),
                               truncated_every=5)  # fmt: skip
    dynamic, trainer = parameter_change(tok, config_for(row, output_dir=str(tmp_path), **RUN, **CPU), truncated_every=5)
    assert base.norm() > 1e-3  # the runs trained
    assert relative_gap(dynamic, base) < 1e-3
    padding = [entry["batching/padding_fraction"] for entry in trainer.state.log_history if "batching/padding_fraction" in entry]
    assert padding and all(0.0 <= value < 1.0 for value in padding)


def test_grpo_row_updates_as_trl_grpo_trainer(tok, tmp_path):
    """The GRPO row, dynamically batched, against `trl.GRPOTrainer` with the row's clip settings (dual clip too)."""
    row = {key: value for key, value in PAPER_ALGORITHMS["GRPO"].items() if key != "algorithm"}
    trl_config = GRPOConfig(str(tmp_path / "trl"), loss_type="grpo", **row, **RUN, **CPU)
    trl, _ = parameter_change(tok, trl_config, trainer_cls=GRPOTrainer, truncated_every=5)
    ours, trainer = parameter_change(tok, config_for("GRPO", output_dir=str(tmp_path), **RUN, **CPU), truncated_every=5)
    assert trl.norm() > 1e-3 and relative_gap(ours, trl) < 1e-3
    assert trainer._update.path is batching.DYNAMIC and len({p["completion_mask"].size(0) for p in passes_of(trainer)}) > 1


def passes_of(trainer):
    """Every forward pass of the last planned generation batch (a micro-step may hold several)."""
    return [part for micro in trainer._buffered_inputs for part in (micro if isinstance(micro, list) else [micro])]


def area(part):
    return part["prompt_mask"].numel() + part["completion_mask"].numel()


def test_token_budget_splits_micro_steps_into_passes_with_the_same_update(tok, tmp_path):
    run = {**RUN, "num_iterations": 2}  # the planned passes are reused by the second iteration
    base, _ = parameter_change(tok, config_for("DHPO-A", output_dir=str(tmp_path), dynamic_batching=False, **run, **CPU))
    budget = 30  # below one long sequence (its prompt + 40 completion tokens): those get a pass of their own
    dynamic, trainer = parameter_change(
        tok, config_for("DHPO-A", output_dir=str(tmp_path), max_tokens_per_micro_batch=budget, **run, **CPU)
    )
    assert relative_gap(dynamic, base) < 1e-3
    steps = trainer._buffered_inputs
    assert any(isinstance(step, batching.Passes) and len(step) > 1 for step in steps)
    passes = passes_of(trainer)
    assert all(area(part) <= budget or part["completion_mask"].size(0) == 1 for part in passes)
    assert any(area(part) > budget for part in passes)  # a sequence much longer than the budget, alone, not cut
    assert sum(part["completion_mask"].size(0) for part in passes) == 16  # every row once
    for window in (steps[0:2], steps[2:4]):  # two optimizer steps of two micro-steps each
        window_passes = [part for micro in window for part in (micro if isinstance(micro, list) else [micro])]
        assert {part[batching.WINDOW].passes for part in window_passes} == {len(window_passes)}
        assert {part[batching.WINDOW].sequences for part in window_passes} == {8}


def test_equal_lengths_and_one_micro_batch_per_window(tok, tmp_path):
    def equal_rollout(prompts, trainer):
        ids = [tok(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
        completions = [[5 + (index % 7)] * 11 + [tok.eos_token_id] for index in range(len(prompts))]
        return {"prompt_ids": ids, "completion_ids": completions, "logprobs": None}

    def run(**overrides):
        model = build_tiny_qwen3(tok, seed=0)
        start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        config = config_for("GMPO", output_dir=str(tmp_path), **{**RUN, **overrides}, **CPU)
        trainer = DHPOTrainer(model=model, reward_funcs=length_reward, args=config, train_dataset=dataset(),
                              processing_class=tok, rollout_func=equal_rollout)  # fmt: skip
        trainer.train()
        return torch.cat([p.detach().flatten() for p in model.parameters()]) - start, trainer

    base, _ = run(dynamic_batching=False)
    dynamic, trainer = run()
    assert relative_gap(dynamic, base) < 1e-3
    assert [part["completion_mask"].shape for part in passes_of(trainer)] == [(4, 12)] * 4  # even split
    single_base, _ = run(dynamic_batching=False, gradient_accumulation_steps=1, steps_per_generation=2)
    single, _ = run(gradient_accumulation_steps=1, steps_per_generation=2)
    assert relative_gap(single, single_base) < 1e-3


def test_gradient_checkpointing_lora_and_moe(tok, tmp_path):
    from peft import LoraConfig

    def pair(build, args=None, **kwargs):
        """(dynamic change with a token budget, TRL-batching change, the dynamic trainer) of one setup."""
        common = dict(output_dir=str(tmp_path), **RUN, **CPU, **(args or {}))
        dynamic, trainer = parameter_change(tok, config_for("DHPO-A", max_tokens_per_micro_batch=60, **common),
                                            model=build(), **kwargs)  # fmt: skip
        base, _ = parameter_change(tok, config_for("DHPO-A", dynamic_batching=False, **common), model=build(), **kwargs)
        return dynamic, base, trainer

    dynamic, base, _ = pair(lambda: build_tiny_qwen3(tok, seed=0), args=dict(gradient_checkpointing=True))
    assert relative_gap(dynamic, base) < 1e-3
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    dynamic, base, trainer = pair(lambda: build_tiny_qwen3(tok, seed=0), peft_config=lora)
    assert base.norm() > 0 and relative_gap(dynamic, base) < 1e-3
    assert any(isinstance(step, batching.Passes) for step in trainer._buffered_inputs)

    def moe():
        model = build_tiny_qwen3(tok, seed=0, moe=True)
        model.config.output_router_logits = False  # TRL asks for router logits itself
        return model

    # Routing is per token, so without the aux term the update is TRL's; the aux loss itself is a per-pass mean.
    dynamic, base, _ = pair(moe, args=dict(router_aux_loss_coef=0.0))
    assert relative_gap(dynamic, base) < 1e-3
    _, _, trainer = pair(moe)
    aux = [entry["aux_loss"] for entry in trainer.state.log_history if "aux_loss" in entry]
    assert aux and all(math.isfinite(value) and value > 0 for value in aux)


# ----------------------------------------------------------------------------- fixed batches, TRL features on
def padded_window(tok, model, rows=8, seed=0):
    """One accumulation window as TRL hands it over: left-padded prompts and right-padded completions of
    long-tailed lengths (one all-padding), old / reference / vLLM sampling log-probs and a vLLM IS ratio."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths = [3, 9, 5, 2, 7, 4, 6, 8][:rows]
    completion_lengths = [2, 30, 4, 0, 6, 3, 12, 5][:rows]
    prompt_width, completion_width = 9, 32  # the generation batch's widths: wider than any row here
    vocab = model.config.vocab_size
    prompt_ids = torch.full((rows, prompt_width), tok.pad_token_id)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    completion_ids = torch.full((rows, completion_width), tok.pad_token_id)
    completion_mask = torch.zeros(rows, completion_width, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        prompt_ids[row, prompt_width - p :] = torch.randint(3, vocab, (p,), generator=gen)
        prompt_mask[row, prompt_width - p :] = 1
        completion_ids[row, :c] = torch.randint(3, vocab, (c,), generator=gen)
        completion_mask[row, :c] = 1
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt_ids, completion_ids], 1),
                       attention_mask=torch.cat([prompt_mask, completion_mask], 1)).logits  # fmt: skip
        logps = logits[:, prompt_width - 1 : -1].float().log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1))[..., 0]
    noise = lambda scale: scale * torch.randn(logps.shape, generator=gen)  # noqa: E731
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.tensor([1.2, -0.8, 0.5, -1.5, 0.9, -0.3, 0.7, -1.1])[:rows],
        "old_per_token_logps": (logps + noise(0.3)) * completion_mask,
        "ref_per_token_logps": (logps + noise(0.2)) * completion_mask,
        "sampling_per_token_logps": (logps + noise(0.1)) * completion_mask,
        "importance_sampling_ratio": (1.0 + noise(0.1)).clamp(0.5, 2.0) * completion_mask,
        "num_items_in_batch": completion_mask.sum() * 2,  # the generation batch holds two such windows
    }  # fmt: skip


def window_gradient(trainer, micro_batches):
    """Sum over a window's micro-batches of the gradient of `_compute_loss` (what one optimizer step applies)."""
    model = trainer.model
    model.train()
    model.zero_grad()
    for micro in micro_batches:
        trainer._compute_loss(model, dict(micro)).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad()
    return grad


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_window_gradient_with_kl_off_policy_mask_and_vllm_correction(tok, tmp_path, loss_type):
    build_tiny_qwen3(tok, seed=1).save_pretrained(tmp_path / "model")  # the KL term loads a reference copy
    model = Qwen3ForCausalLM.from_pretrained(tmp_path / "model")
    window = padded_window(tok, model)
    features = dict(beta=0.05, off_policy_mask_threshold=0.05, loss_type=loss_type)
    args = config_for("DHPO-A", output_dir=str(tmp_path), **{**RUN, "max_completion_length": 32}, **features, **CPU)
    trainer = DHPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=dataset(), processing_class=tok)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True  # the correction multiplies the loss
    trainer.current_gradient_accumulation_steps = 2
    trl_slices = [batching.take(window, rows, 9, 32) for rows in ([0, 1, 2, 3], [4, 5, 6, 7])]
    reference = window_gradient(trainer, trl_slices)
    share = RUN["gradient_accumulation_steps"] / RUN["steps_per_generation"]  # dapo: the window's part of the batch
    micro = batching.split_window(window, micro_steps=2, window_of=batching.planned_windows(1, share))
    assert sorted(part["completion_mask"].size(0) for part in micro) != [4, 4]  # regrouped unevenly
    assert relative_gap(window_gradient(trainer, micro), reference) < 1e-4
    # the same micro-batches normalised as TRL does (per micro-batch rows x accumulation) give another update
    unnormalised = [{k: v for k, v in part.items() if not k.startswith("dhpo_window")} for part in micro]
    if loss_type != "dapo":
        assert relative_gap(window_gradient(trainer, unnormalised), reference) > 1e-2


def test_old_and_reference_passes_are_trimmed_chunks_with_trl_values(tok, tmp_path):
    model = build_tiny_qwen3(tok, seed=2)
    window = padded_window(tok, model)
    ids = torch.cat([window["prompt_ids"], window["completion_ids"]], 1)
    mask = torch.cat([window["prompt_mask"], window["completion_mask"]], 1)
    forwards = []
    hook = model.model.register_forward_hook(
        lambda module, args, kwargs, output: forwards.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )

    def logps(**overrides):
        args = config_for("DHPO-A", output_dir=str(tmp_path), **{**RUN, "max_completion_length": 32, **overrides}, **CPU)
        trainer = DHPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=dataset(),
                              processing_class=tok)  # fmt: skip
        forwards.clear()
        with torch.no_grad():
            out = trainer._get_per_token_logps_and_entropies(model, ids, mask, 32, batch_size=4, compute_entropy=True)
        return out, list(forwards)

    (trl_logps, trl_entropies, _), trl_forwards = logps(dynamic_batching=False)
    (dyn_logps, dyn_entropies, _), dyn_forwards = logps()
    (budget_logps, _, _), budget_forwards = logps(max_tokens_per_micro_batch=40)
    hook.remove()
    real = window["completion_mask"].bool()
    torch.testing.assert_close(dyn_logps[real], trl_logps[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dyn_entropies[real], trl_entropies[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(budget_logps[real], trl_logps[real], atol=1e-5, rtol=1e-5)
    assert (dyn_logps[~real] == 0).all()
    assert len(dyn_forwards) == len(trl_forwards) == 2  # as many forwards as TRL: ceil(8 rows / batch 4)
    assert sum(rows * width for rows, width in dyn_forwards) < sum(rows * width for rows, width in trl_forwards) / 2
    assert len(budget_forwards) > 2  # the budget asks for more, smaller forwards (the 30-token row alone)
    assert all(rows * width <= 40 or rows == 1 for rows, width in budget_forwards)


def test_no_grad_passes_keep_trl_defaults_padding_and_images(tok, tmp_path, monkeypatch):
    """What the trimmed passes hand TRL's forward: widths rounded up to `pad_to_multiple_of`, no entropies unless
    asked (TRL's default), and a vision-language batch untouched: one call of TRL's own chunked forward with the
    image tensors (their rows cannot be regrouped), while image keys that are all None still get trimmed chunks, each
    as wide as its own rows; an aux loss asked for is the mean of the chunks'."""
    model = build_tiny_qwen3(tok, seed=2)
    window = padded_window(tok, model)
    ids = torch.cat([window["prompt_ids"], window["completion_ids"]], 1)
    mask = torch.cat([window["prompt_mask"], window["completion_mask"]], 1)
    args = config_for("DHPO-A", output_dir=str(tmp_path), **{**RUN, "max_completion_length": 32}, **CPU)
    trainer = DHPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=dataset(),
                          processing_class=tok)  # fmt: skip
    calls = []
    trl_forward = GRPOTrainer._get_per_token_logps_and_entropies

    def recording(self, model, input_ids, attention_mask, logits_to_keep, *rest, **kwargs):
        calls.append({"shape": tuple(input_ids.shape), "keep": logits_to_keep, "rest": rest, **kwargs})
        if "pixel_values" in kwargs:  # the tiny text model has no vision tower: answer without a forward
            return torch.zeros(input_ids.size(0), logits_to_keep), None, None
        if kwargs["compute_aux_loss"]:  # nor a router: each chunk's aux loss is its call number
            return torch.zeros(input_ids.size(0), logits_to_keep), None, torch.tensor(float(len(calls)))
        return trl_forward(self, model, input_ids, attention_mask, logits_to_keep, *rest, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", recording)
    trainer.pad_to_multiple_of = 8
    with torch.no_grad():
        logps, entropies, aux = trainer._get_per_token_logps_and_entropies(model, ids, mask, 32, batch_size=4)
    assert entropies is None and aux is None and logps.shape == (8, 32)
    prompt_limit = ids.size(1) - 32
    widths = [(call["shape"][1] - call["keep"], call["keep"]) for call in calls]
    assert len(calls) == 2 and sum(prompt + completion for prompt, completion in widths) < 2 * ids.size(1)  # trimmed
    for prompt, completion in widths:  # each part rounded up to a multiple of 8, or to the batch's own width
        assert (prompt % 8 == 0 or prompt == prompt_limit) and (completion % 8 == 0 or completion == 32), widths
    assert any(completion % 8 == 0 and completion < 32 for _, completion in widths)
    assert all(call["compute_entropy"] is False and call["compute_aux_loss"] is False for call in calls)

    calls.clear()
    pixels, grid = torch.ones(2, 3), torch.tensor([[1, 2, 2]])
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(model, ids, mask, 32, batch_size=4, pixel_values=pixels,
                                                   image_grid_thw=grid, token_type_ids=None)  # fmt: skip
    (call,) = calls
    assert call["shape"] == tuple(ids.shape) and call["rest"] == (4, False, False)
    assert call["pixel_values"] is pixels and call["image_grid_thw"] is grid and call["token_type_ids"] is None

    calls.clear()
    trainer.pad_to_multiple_of = None
    short_prompts = mask.clone()
    short_prompts[[1, 6], : prompt_limit - 2] = 0  # the two longest completions (30 and 12 tokens) get 2-token prompts
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(model, ids, short_prompts, 32, batch_size=4, pixel_values=None)
    # image keys that are all None: trimmed chunks, each as wide as its own rows (the other rows' prompts are 3-8)
    assert [(call["shape"][1] - call["keep"], call["keep"]) for call in calls] == [(8, 6), (2, 30)]

    calls.clear()
    with torch.no_grad():
        _, _, aux = trainer._get_per_token_logps_and_entropies(model, ids, mask, 32, batch_size=4, compute_aux_loss=True)
    assert aux.item() == pytest.approx(1.5)  # the mean of the chunks' aux losses, 1 and 2


# ------------------------------------------------------------------------------------- two processes (gloo)
@pytest.mark.parametrize("engine", ["ddp", "zero3"])
def test_two_processes_agree_on_passes_and_update_as_trl(two_process_update_paths, engine):
    """2 ranks with a token budget: each micro-step runs the same number of passes on both ranks (the larger of
    what each rank's rows need), and the update equals TRL's batching on the same 2 ranks, under DDP and under
    DeepSpeed ZeRO-3 (whose engine must not step on the extra passes)."""
    if engine == "zero3":
        pytest.importorskip("deepspeed")
    result, tmp_path = two_process_update_paths(engine)  # the launch every update path's test shares
    assert result["returncode"] == 0, result["stderr"]
    trl = torch.load(tmp_path / "trl" / "params.pt")
    dynamic = torch.load(tmp_path / "budget" / "params.pt")
    start = dict(build_tiny_qwen3(build_char_tokenizer(), seed=0).named_parameters())
    change_trl = torch.cat([(trl[n] - start[n]).flatten() for n in trl])
    change_dynamic = torch.cat([(dynamic[n] - start[n]).flatten() for n in trl])
    assert change_trl.norm() > 1e-3
    assert relative_gap(change_dynamic, change_trl) < 1e-3
    plans = [json.loads((tmp_path / "budget" / f"plan_rank{rank}.json").read_text()) for rank in (0, 1)]
    agreed_by_max = False
    for plan0, plan1 in zip(*plans, strict=True):  # one entry per generation batch
        assert [len(step) for step in plan0["rows_per_pass"]] == [len(step) for step in plan1["rows_per_pass"]]
        assert sum(map(sum, plan0["rows_per_pass"])) == sum(map(sum, plan1["rows_per_pass"])) == 16
        for window, (own0, own1) in enumerate(zip(plan0["own_needed"], plan1["own_needed"], strict=True)):
            passes = sum(len(step) for step in plan0["rows_per_pass"][2 * window : 2 * window + 2])
            assert passes == 2 * math.ceil(max(own0, own1) / 2)
            agreed_by_max |= own0 != own1
    assert agreed_by_max  # the ranks' own needs differed somewhere, so the all-reduce mattered


ADAPTIVE = dict(use_adaptive_entropy=True, entropy_coef=0.0, entropy_target=1e6, entropy_coef_delta=0.01,
                entropy_coef_min=0.0, entropy_coef_max=1.0)  # fmt: skip


@pytest.mark.parametrize("budget", [None, 30])
def test_adaptive_entropy_coefficient_moves_once_per_optimizer_step_under_a_token_budget(tok, tmp_path, budget):
    """Issue 26: a budget splits the step's last micro-step into passes, and the once-per-step update ran on each.
    The world entropy is always below the huge target, so the coefficient rises by exactly delta per step."""
    config = config_for("DHPO-A", output_dir=str(tmp_path), max_tokens_per_micro_batch=budget, **RUN, **ADAPTIVE, **CPU)
    _, trainer = parameter_change(tok, config)
    if budget is not None:
        assert isinstance(trainer._buffered_inputs[1], batching.Passes)  # the step's last micro-step: several passes
    assert trainer.entropy_coef == pytest.approx(0.01 * RUN["max_steps"])
    logged = [entry["entropy_coef"] for entry in trainer.state.log_history if "entropy_coef" in entry]
    assert logged == pytest.approx([0.01 * step for step in range(1, RUN["max_steps"] + 1)])


def test_windowed_entropy_bonus_with_a_top_entropy_mask_matches_trl(tok, tmp_path):
    """Issue 26: over a planned window the bonus divided by all the window's tokens where TRL divides by the
    high-entropy tokens it acts on. One micro-batch per window: the same tokens, so the same update as TRL's."""
    run = {**RUN, "gradient_accumulation_steps": 1, "steps_per_generation": 2, "top_entropy_quantile": 0.5,
           "entropy_coef": 0.5}  # fmt: skip
    base, _ = parameter_change(tok, config_for("DHPO-A", output_dir=str(tmp_path), dynamic_batching=False, **run, **CPU))
    dynamic, _ = parameter_change(tok, config_for("DHPO-A", output_dir=str(tmp_path), **run, **CPU))
    without_bonus, _ = parameter_change(
        tok, config_for("DHPO-A", output_dir=str(tmp_path), dynamic_batching=False, **{**run, "entropy_coef": 0.0}, **CPU)
    )
    assert relative_gap(base, without_bonus) > 1e-2  # the bonus moves the update
    assert relative_gap(dynamic, base) < 1e-3


def test_evaluation_leaves_the_adaptive_entropy_controller_alone(tok, tmp_path):
    """Evaluation neither moves the coefficient nor adds its tokens to the next training window's entropy."""
    config = config_for("DHPO-A", output_dir=str(tmp_path), **{**RUN, "max_steps": 2}, **ADAPTIVE, **CPU)
    _, trainer = parameter_change(tok, config, eval_dataset=dataset())
    coefficient, world_entropy = trainer.entropy_coef, trainer._last_world_entropy
    assert coefficient == pytest.approx(0.02)
    trainer.evaluate()
    assert (trainer.entropy_coef, trainer._last_world_entropy) == (coefficient, world_entropy)
    assert trainer._entropy_window_stats is None  # nothing carried into the next window
