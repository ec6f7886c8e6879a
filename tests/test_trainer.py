"""`DHPOTrainer` end to end on a tiny Qwen3: equivalence with TRL, the seven paper rows (and their losses against
VERL's definitions), checkpoints, LoRA, bad input, and every TRL loss feature kept working.

Runs are short, off-policy (several optimizer steps per generation batch, or `num_iterations > 1`) and shared
between asserts through module-scoped fixtures, to keep the file within its CPU budget.
"""

import math

import pytest
import torch
from datasets import Dataset
from reference_losses import (
    constant_weights,
    reference_dhpo,
    reference_entropy_weights,
    seq_mean_token_mean,
    verl_cispo_terms,
    verl_geo_mean_loss,
    verl_gspo_terms,
    verl_vanilla_terms,
)
from transformers import Qwen3ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.core.losses import dhpo_per_token_loss
from dhpo_trl.core.objectives import OBJECTIVE_SETTINGS, get_objective
from dhpo_trl.core.presets import PAPER_ALGORITHMS, config_for
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3

CPU = dict(use_cpu=True, bf16=False, report_to="none", seed=0, data_seed=0)
# One group of 4 completions per micro-batch; 2 optimizer steps per generation batch: steps 2, 4, ... are off-policy.
SMALL_RUN = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    gradient_accumulation_steps=1,
    steps_per_generation=2,
    max_completion_length=8,
    max_steps=4,
    logging_steps=1,
    learning_rate=3e-2,
    save_strategy="no",
)
TRL_CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                    "clip_ratio/high_max")  # fmt: skip
DHPO_METRICS = (
    "dhpo/mixing_weight/mean", "dhpo/mixing_weight/std", "dhpo/token_ratio/mean", "dhpo/token_ratio/min",
    "dhpo/token_ratio/max", "dhpo/sequence_ratio/mean", "dhpo/sequence_ratio/min", "dhpo/sequence_ratio/max",
    "dhpo/clip_fraction/token_low", "dhpo/clip_fraction/token_high", "dhpo/clip_fraction/sequence_low",
    "dhpo/clip_fraction/sequence_high", "dhpo/clipped_term_fraction",
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models on a shared CPU: intra-op threads only add synchronisation (measured ~15x slower with 2)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def prompts(n=16, offset=0):
    return Dataset.from_dict({"prompt": [f"{a + offset}+{2 * a + 1}=" for a in range(n)]})


def digit_share(completions, **kwargs):
    """Deterministic reward that varies within a group: share of digits in the completion."""
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


def recording_reward():
    """`digit_share` that also records every completion it scores, to compare generations between runs."""
    seen = []

    def digit_share_recorded(completions, **kwargs):
        seen.extend(completions)
        return digit_share(completions)

    return digit_share_recorded, seen


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def saved_tiny_model(tok, directory, seed=0):
    """The tiny model saved and reloaded, so that TRL can build a reference model from its path (beta > 0)."""
    build_tiny_qwen3(tok, hidden_size=32, seed=seed).save_pretrained(directory)
    return Qwen3ForCausalLM.from_pretrained(directory)


def run(trainer_cls, args, tok, reward=digit_share, model=None, **kwargs):
    model = build_tiny_qwen3(tok, hidden_size=32, seed=0) if model is None else model
    trainer = trainer_cls(model=model, reward_funcs=reward, args=args, train_dataset=prompts(), processing_class=tok,
                          **kwargs)  # fmt: skip
    trainer.train()
    return trainer


# =============================================================================== (a) equivalence with TRL
# Two off-policy regimes: each batch reused for a second iteration, and two accumulated micro-batches per
# optimizer step with two optimizer steps per generation batch (checks the accumulation normalisation too).
# TRL's batching (dynamic_batching=False), so parameters and per-micro-batch metrics must match to float precision;
# tests/test_dynamic_batching.py holds dynamic batching to the same updates.
EQUIVALENCE = {
    "iterations": dict(SMALL_RUN, steps_per_generation=2, num_iterations=2, max_steps=6),
    "accumulation": dict(SMALL_RUN, gradient_accumulation_steps=2, steps_per_generation=4, max_steps=4),
}


def assert_same_parameters(model_a, model_b, atol=1e-5):
    params_b = dict(model_b.named_parameters())
    for name, param in model_a.named_parameters():
        torch.testing.assert_close(param, params_b[name], atol=atol, rtol=0, msg=name)


def assert_moved_from_init(model, tok):
    init = dict(build_tiny_qwen3(tok, hidden_size=32, seed=0).named_parameters())
    change = max((param - init[name]).abs().max().item() for name, param in model.named_parameters())
    assert change > 1e-3


@pytest.mark.parametrize("regime", list(EQUIVALENCE))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_token_weight_one_and_zero_reproduce_trl(tmp_path, tok, level, regime):
    """w = 1 trains exactly like TRL's GRPO, w = 0 exactly like TRL's GSPO, through off-policy steps."""
    eps_low, eps_high = (0.2, 0.28) if level == "token" else (0.03, 0.04)
    reward_ours, seen_ours = recording_reward()
    reward_trl, seen_trl = recording_reward()
    if level == "token":
        branch = dict(token_weight=1.0, epsilon_low_token=eps_low, epsilon_high_token=eps_high)
    else:
        branch = dict(token_weight=0.0, epsilon_low_seq=eps_low, epsilon_high_seq=eps_high)
    setup = EQUIVALENCE[regime]
    ours = run(DHPOTrainer, DHPOConfig(str(tmp_path / "dhpo"), mixing="averaged", **branch, **setup, **CPU,
                                       dynamic_batching=False), tok, reward=reward_ours)  # fmt: skip
    trl_args = GRPOConfig(str(tmp_path / "trl"), loss_type="grpo", epsilon=eps_low, epsilon_high=eps_high,
                          importance_sampling_level=level, **setup, **CPU)  # fmt: skip
    trl = run(GRPOTrainer, trl_args, tok, reward=reward_trl)

    assert ours.state.global_step == trl.state.global_step == setup["max_steps"]
    generated = {"iterations": 2 * 8, "accumulation": 2 * 16}[regime]  # generation batches x completions each
    assert len(seen_ours) == generated and seen_ours == seen_trl  # identical sampling: same seed, same completions
    assert logged(ours, "reward") == logged(trl, "reward")
    # off-policy for real: the ratios left 1, and TRL's clip fired somewhere
    token_min, token_max = logged(ours, "dhpo/token_ratio/min"), logged(ours, "dhpo/token_ratio/max")
    assert min(token_min) < 0.99 and max(token_max) > 1.01
    assert max(logged(trl, "clip_ratio/region_mean")) > 0
    assert_moved_from_init(ours.model, tok)
    assert_same_parameters(ours.model, trl.model)
    for a, b in zip(logged(ours, "loss"), logged(trl, "loss"), strict=True):
        assert a == pytest.approx(b, abs=1e-5)


# The GRPO and GSPO rows themselves (VERL's dual clip delta = 3 for GRPO, GSPO's 3e-4 / 4e-4) against TRL's trainer.
TRL_ROWS = {
    "GRPO": dict(loss_type="grpo", epsilon=0.2, epsilon_high=0.2, delta=3.0),
    "GSPO": dict(loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4, importance_sampling_level="sequence"),
}


@pytest.mark.parametrize("regime", list(EQUIVALENCE))
@pytest.mark.parametrize("row", list(TRL_ROWS))
def test_grpo_and_gspo_rows_reproduce_trl(tmp_path, tok, row, regime):
    """The rows run our own loss path (not TRL's `_compute_loss`) and still train exactly like TRL, metrics too."""
    reward_ours, seen_ours = recording_reward()
    reward_trl, seen_trl = recording_reward()
    setup = EQUIVALENCE[regime]
    ours_args = config_for(row, output_dir=str(tmp_path / "dhpo"), dynamic_batching=False, **setup, **CPU)
    ours = run(DHPOTrainer, ours_args, tok, reward=reward_ours)
    trl = run(GRPOTrainer, GRPOConfig(str(tmp_path / "trl"), **TRL_ROWS[row], **setup, **CPU), tok, reward=reward_trl)
    assert ours.state.global_step == trl.state.global_step == setup["max_steps"]
    assert seen_ours == seen_trl and len(seen_ours) > 0
    assert_moved_from_init(ours.model, tok)
    assert_same_parameters(ours.model, trl.model)
    for key in ("loss", "entropy", *TRL_CLIP_METRICS):
        ours_values, trl_values = logged(ours, key), logged(trl, key)
        assert len(ours_values) == len(trl_values) == setup["max_steps"], key
        assert ours_values == pytest.approx(trl_values, abs=1e-5), key
    assert max(logged(trl, "clip_ratio/region_mean")) > 0  # off-policy for real: the clip fired
    assert not any(key.startswith(("dhpo/", "gmpo/")) for entry in ours.state.log_history for key in entry)


# =============================================================================== (b) the seven rows, end to end
@pytest.fixture(scope="module")
def preset_runs(tok, tmp_path_factory):
    """Each of the paper's seven rows trained 4 off-policy steps, checkpointing at steps 2 and 4."""
    runs = {}
    for name in PAPER_ALGORITHMS:
        output_dir = tmp_path_factory.mktemp(name.lower())
        small = dict(SMALL_RUN, save_strategy="steps", save_steps=2)
        args = config_for(name, output_dir=str(output_dir), **small, **CPU)
        runs[name] = run(DHPOTrainer, args, tok)
    return runs


def finite(values):
    return all(math.isfinite(v) for v in values)


@pytest.mark.parametrize("name", list(PAPER_ALGORITHMS))
def test_every_paper_row_trains_and_logs_sane_metrics(preset_runs, name):
    trainer = preset_runs[name]
    assert trainer.state.global_step == 4
    losses = logged(trainer, "loss")
    assert len(losses) == 4 and finite(losses)
    algorithm = PAPER_ALGORITHMS[name]["algorithm"]
    if algorithm == "dhpo":
        for key in DHPO_METRICS:
            values = logged(trainer, key)
            assert len(values) == 4 and finite(values), key
        for key in ("dhpo/token_ratio/min", "dhpo/sequence_ratio/min"):
            assert min(logged(trainer, key)) > 0
        for key in DHPO_METRICS:
            if "mixing_weight" in key or "clip" in key:
                assert all(0.0 <= v <= 1.0 for v in logged(trainer, key)), key
        weights = logged(trainer, "dhpo/mixing_weight/mean")
        if name == "DHPO-A":
            assert weights == pytest.approx([0.5] * 4) and logged(trainer, "dhpo/mixing_weight/std") == pytest.approx([0] * 4, abs=1e-6)
        else:
            assert min(logged(trainer, "dhpo/mixing_weight/std")) > 0.05  # entropy actually spreads w
        # steps 2 and 4 reuse a generation batch after an update: ratios differ from 1 there
        assert max(abs(r - 1) for r in logged(trainer, "dhpo/token_ratio/max")) > 1e-3
        assert logged(trainer, "dhpo/token_ratio/min")[0] == pytest.approx(1.0)  # on-policy first step
        if name == "DHPO-E-unified":  # one clip on m, reported under the token branch
            assert logged(trainer, "dhpo/clip_fraction/sequence_low") == [0.0] * 4
        assert logged(trainer, "dhpo/clip_fraction/dual") == []  # the paper's rows have no dual clip
    elif algorithm == "gmpo":
        for key in ("gmpo/token_ratio/mean", "gmpo/sequence_ratio/min", "gmpo/clip_fraction"):
            values = logged(trainer, key)
            assert len(values) == 4 and finite(values) and min(values) >= 0, key
        assert all(0 <= v <= 1 for v in logged(trainer, "gmpo/clip_fraction"))
        assert max(abs(r - 1) for r in logged(trainer, "gmpo/token_ratio/max")) > 1e-3
    elif algorithm in ("grpo", "gspo"):
        assert not any(key.startswith("dhpo/") for entry in trainer.state.log_history for key in entry)
        if algorithm == "gspo":  # GSPO's tiny 3e-4 / 4e-4 trust region binds once the policy moved
            assert max(logged(trainer, "clip_ratio/region_mean")) > 0
    if algorithm == "cispo":  # TRL's key for CISPO
        values = logged(trainer, "cispo_clip_ratio")
        assert len(values) == 4 and all(0 <= v <= 1 for v in values)
        assert logged(trainer, "clip_ratio/region_mean") == []
    else:  # TRL's clip_ratio keys for every clipped-surrogate row, DHPO and GMPO included
        for key in TRL_CLIP_METRICS:
            values = logged(trainer, key)
            assert len(values) == 4 and all(0 <= v <= 1 for v in values), key
        region, low, high = (logged(trainer, f"clip_ratio/{k}_mean") for k in ("region", "low", "high"))
        assert region == pytest.approx([a + b for a, b in zip(low, high, strict=True)])


@pytest.mark.parametrize("name", list(PAPER_ALGORITHMS))
def test_checkpoint_reloads_and_model_card_names_dhpo(preset_runs, name):
    trainer = preset_runs[name]
    output_dir = trainer.args.output_dir
    checkpoint = f"{output_dir}/checkpoint-4"
    reloaded = Qwen3ForCausalLM.from_pretrained(checkpoint)
    assert_same_parameters(reloaded, trainer.model, atol=0)
    # TRL writes the card to output_dir each time it saves a checkpoint; DHPOTrainer copies it into the checkpoint
    with open(f"{output_dir}/README.md", encoding="utf-8") as handle:
        card = handle.read()
    with open(f"{checkpoint}/README.md", encoding="utf-8") as handle:
        assert handle.read() == card
    assert "DHPO" in card and "min-etal-2026-orchestrating" in card
    assert card.count("@inproceedings{min-etal-2026-orchestrating") == 1
    settings = PAPER_ALGORITHMS[name]
    for field, value in settings.items():
        assert f"| `{field}` | `{getattr(trainer.args, field)}` |" in card, field
    assert f"| `algorithm` | `{settings['algorithm']}` |" in card
    # only the settings the objective reads
    reads = get_objective(settings["algorithm"]).settings(trainer.args)
    for field in OBJECTIVE_SETTINGS:
        assert (f"| `{field}` |" in card) == (field in reads), field
    assert "| `loss_type` | `grpo` |" in card


def test_training_resumes_from_checkpoint(preset_runs, tok, tmp_path):
    """Resuming DHPO-E at step 2 reaches step 4 with the weights of the uninterrupted run."""
    original = preset_runs["DHPO-E"]
    args = config_for("DHPO-E", output_dir=str(tmp_path), **SMALL_RUN, **CPU)
    model = build_tiny_qwen3(tok, hidden_size=32, seed=1)  # overwritten by the checkpoint
    trainer = DHPOTrainer(model=model, reward_funcs=digit_share, args=args, train_dataset=prompts(),
                          processing_class=tok)  # fmt: skip
    trainer.train(resume_from_checkpoint=f"{original.args.output_dir}/checkpoint-2")
    assert trainer.state.global_step == 4
    assert [e["step"] for e in trainer.state.log_history if "dhpo/token_ratio/max" in e][-2:] == [3, 4]
    assert_same_parameters(trainer.model, original.model, atol=1e-5)


def test_lora_trains_adapters_only(tok, tmp_path):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = config_for("DHPO-E", output_dir=str(tmp_path), **SMALL_RUN, **CPU)
    base = build_tiny_qwen3(tok, hidden_size=32, seed=0)
    before = {name: param.detach().clone() for name, param in base.named_parameters()}
    trainer = DHPOTrainer(model=base, reward_funcs=digit_share, args=args, train_dataset=prompts(),
                          processing_class=tok, peft_config=peft_config)  # fmt: skip
    trainer.train()
    lora = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert lora and all(p.requires_grad for p in lora.values())
    assert max(p.abs().max().item() for n, p in lora.items() if "lora_B" in n) > 0  # lora_B starts at zero
    frozen = {n.replace("base_model.model.", "").replace(".base_layer", ""): p
              for n, p in trainer.model.named_parameters() if "lora_" not in n}  # fmt: skip
    assert set(frozen) == set(before)
    for name, param in frozen.items():
        assert torch.equal(param, before[name]), name
    assert finite(logged(trainer, "dhpo/token_ratio/mean"))


# =============================================================================== (c) bad input
def test_none_and_nan_rewards_do_not_break_training(tok, tmp_path):
    def flaky_reward(completions, **kwargs):
        scores = digit_share(completions)
        return [None if i % 4 == 0 else math.nan if i % 4 == 1 else s for i, s in enumerate(scores)]

    args = config_for("DHPO-E", output_dir=str(tmp_path), **SMALL_RUN, **CPU)
    trainer = run(DHPOTrainer, args, tok, reward=flaky_reward)
    assert trainer.state.global_step == 4
    assert finite(logged(trainer, "loss")) and finite(logged(trainer, "dhpo/token_ratio/mean"))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_plain_grpo_config_is_converted_to_trls_objective(tok, tmp_path, capsys):
    args = GRPOConfig(str(tmp_path), importance_sampling_level="sequence", epsilon=0.1, **CPU)
    trainer = DHPOTrainer(model=build_tiny_qwen3(tok, hidden_size=32), reward_funcs=digit_share, args=args,
                          train_dataset=prompts(), processing_class=tok)  # fmt: skip
    assert isinstance(trainer.args, DHPOConfig)
    assert (trainer.args.algorithm, trainer.args.loss_type, trainer.args.epsilon) == ("gspo", "dapo", 0.1)  # TRL's
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "GRPOConfig" in line]
    assert "algorithm='gspo'" in line and "DHPOConfig" in line


@pytest.mark.parametrize(("settings", "selected"), [
    (dict(importance_sampling_level="sequence"), ("gspo", "importance_sampling_level='sequence'")),
    (dict(loss_type="sapo"), ("sapo", "loss_type='sapo'")),
    (dict(), None),  # DHPO: nothing to say
    (dict(algorithm="gspo"), None),  # asked for by name
])  # fmt: skip
def test_a_trl_spelling_that_selects_another_row_is_named_once(tok, tmp_path, capsys, settings, selected):
    """A GSPO user's `importance_sampling_level='sequence'` (or a TRL loss_type) in a DHPOConfig runs that row, not
    DHPO: the trainer says which row and what selected it, as it does for a GRPOConfig."""
    args = DHPOConfig(str(tmp_path), **dict(SMALL_RUN, **CPU), **settings)
    trainer = DHPOTrainer(model=build_tiny_qwen3(tok, hidden_size=32), reward_funcs=digit_share, args=args,
                          train_dataset=prompts(), processing_class=tok)  # fmt: skip
    lines = [line for line in capsys.readouterr().out.splitlines() if "not DHPO" in line]
    if selected is None:
        assert lines == []
        return
    algorithm, spelling = selected
    assert trainer.args.algorithm == algorithm
    (line,) = lines
    assert f"algorithm={algorithm!r}" in line and spelling in line


def test_trainer_validates_a_config_changed_after_construction(tok, tmp_path):
    def build(args):
        return DHPOTrainer(model=build_tiny_qwen3(tok, hidden_size=32), reward_funcs=digit_share, args=args,
                           train_dataset=prompts(), processing_class=tok)  # fmt: skip

    args = DHPOConfig(str(tmp_path), **dict(SMALL_RUN, **CPU))
    args.token_weight = 0.9  # would be ignored by entropy mixing
    with pytest.raises(ValueError, match=r"DHPOConfig\.token_weight=0\.9 has no effect .* mixing='averaged'"):
        build(args)
    args = DHPOConfig(str(tmp_path), **dict(SMALL_RUN, **CPU))
    args.loss_type = "lusp"  # would have fallen into the dapo branch
    with pytest.raises(ValueError, match=r"DHPOConfig\.loss_type='lusp'"):
        build(args)
    args = DHPOConfig(str(tmp_path), **dict(SMALL_RUN, **CPU))
    args.steps_per_generation = 1  # now on-policy
    with pytest.warns(UserWarning, match="algorithm='dhpo' runs on-policy"):
        build(args)


def test_unknown_loss_type_raises_instead_of_aggregating(feature_model, tok, tmp_path):
    args = config_for("GRPO", output_dir=str(tmp_path), **dict(SMALL_RUN, max_completion_length=7), **CPU)
    trainer = DHPOTrainer(model=feature_model, reward_funcs=digit_share, args=args, train_dataset=prompts(),
                          processing_class=tok)  # fmt: skip
    trainer.loss_type = "sapo"
    was_training = trainer.model.training
    for training in (False, True):  # also in train mode before train() has set the accumulation count
        trainer.model.train(training)
        with pytest.raises(ValueError, match="loss_type='sapo'"):
            trainer._compute_loss(trainer.model, fixed_batch(feature_model))
    trainer.model.train(was_training)


# =============================================================================== (d) TRL features, fixed batch
def fixed_batch(model, seed=0, batch=6, prompt_len=5, completion_len=7):
    """A crafted micro-batch: varying completion lengths, ratios far from 1, advantages of both signs."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (batch, prompt_len), generator=gen)
    completion_ids = torch.randint(3, vocab, (batch, completion_len), generator=gen)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])[:batch]
    completion_mask = (torch.arange(completion_len) < lengths.unsqueeze(1)).long()
    logps, _ = reference_logps_and_entropies(model, prompt_ids, completion_ids, completion_mask)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.2, -0.8, 0.5, -1.5, 0.9, -0.3])[:batch],
        "old_per_token_logps": logps + 0.3 * torch.randn(logps.shape, generator=gen),
        "ref_per_token_logps": logps + 0.2 * torch.randn(logps.shape, generator=gen),
        "num_items_in_batch": completion_mask.sum() * 2,  # the generation batch spans two micro-batches
    }


def reference_logps_and_entropies(model, prompt_ids, completion_ids, completion_mask):
    """Plain forward pass, log-softmax and entropy: no TRL helper involved."""
    with torch.no_grad():
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention = torch.cat([torch.ones_like(prompt_ids), completion_mask], dim=1)
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, prompt_ids.size(1) - 1 : -1].float()
        log_probs = logits.log_softmax(-1)
        logps = log_probs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        entropies = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropies


@pytest.fixture(scope="module")
def feature_model(tok, tmp_path_factory):
    return saved_tiny_model(tok, tmp_path_factory.mktemp("feature_model"), seed=3)


def loss_and_grad(trainer_cls, args, model, tok, inputs, accumulation=2):
    trainer = trainer_cls(model=model, reward_funcs=digit_share, args=args, train_dataset=prompts(),
                          processing_class=tok)  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    model.zero_grad()
    loss = trainer._compute_loss(trainer.model, dict(inputs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads, trainer


FEATURES = {
    "kl": dict(beta=0.05),
    "kl_no_bias_correction": dict(beta=0.05, use_bias_correction_kl=False),
    "top_entropy_quantile": dict(top_entropy_quantile=0.4),
    "entropy_bonus": dict(entropy_coef=0.1),
    "off_policy_mask": dict(off_policy_mask_threshold=0.02),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo": dict(loss_type="dapo"),
    "everything": dict(beta=0.05, top_entropy_quantile=0.6, entropy_coef=0.1, off_policy_mask_threshold=0.02,
                       loss_type="dapo"),
}  # fmt: skip


# (ours, TRL's): DHPO at w = 1, and the GRPO and GSPO objectives, which DHPOTrainer computes itself too.
TRL_EQUIVALENT = {
    "dhpo_w1": (dict(mixing="averaged", token_weight=1.0, epsilon_low_token=0.2, epsilon_high_token=0.28),
                dict(epsilon=0.2, epsilon_high=0.28)),
    "grpo_delta": (dict(algorithm="grpo", epsilon=0.2, epsilon_high=0.28, delta=1.5),
                   dict(epsilon=0.2, epsilon_high=0.28, delta=1.5)),
    "gspo": (dict(algorithm="gspo", epsilon=0.03, epsilon_high=0.04),
             dict(epsilon=0.03, epsilon_high=0.04, importance_sampling_level="sequence")),
}  # fmt: skip


@pytest.mark.parametrize("objective", list(TRL_EQUIVALENT))
@pytest.mark.parametrize("feature", list(FEATURES))
def test_trl_features_match_trl(objective, feature, feature_model, tok, tmp_path):
    """Each TRL feature gives TRL's loss, gradient and metrics on the same batch (to 1e-6), for DHPO at w = 1 and the
    GRPO (with TRL's delta) and GSPO objectives."""
    inputs = fixed_batch(feature_model)
    common = dict(SMALL_RUN, max_completion_length=7, **FEATURES[feature], **CPU)
    ours_settings, trl_settings = TRL_EQUIVALENT[objective]
    batching = {"dynamic_batching": False} if feature == "bnpo" else {}  # bnpo: per micro-batch, TRL's batching only
    ours_args = DHPOConfig(str(tmp_path / "dhpo"), **ours_settings, **common, **batching)
    trl_args = GRPOConfig(str(tmp_path / "trl"), **trl_settings, **{"loss_type": "grpo", **common})
    ours_loss, ours_grads, ours = loss_and_grad(DHPOTrainer, ours_args, feature_model, tok, inputs)
    trl_loss, trl_grads, trl = loss_and_grad(GRPOTrainer, trl_args, feature_model, tok, inputs)
    assert ours_loss.item() == pytest.approx(trl_loss.item(), abs=1e-6)
    assert ours_loss.item() != 0.0
    if "off_policy_mask_threshold" in FEATURES[feature]:  # the batch is built so that the mask drops sequences
        logps, _ = reference_logps_and_entropies(
            feature_model, inputs["prompt_ids"], inputs["completion_ids"], inputs["completion_mask"]
        )
        keep = GRPOTrainer.get_off_policy_mask(
            inputs["advantages"].unsqueeze(1), logps, inputs["old_per_token_logps"], inputs["completion_mask"], 0.02
        )
        assert 0 < keep.sum() < keep.numel()
    for name, grad in trl_grads.items():
        torch.testing.assert_close(ours_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    for key in ("kl", "entropy_coef", "policy_loss", "entropy", *TRL_CLIP_METRICS):  # TRL's metrics, logged by both
        assert (key in trl._metrics["train"]) == (key in ours._metrics["train"]), key
        if key in trl._metrics["train"]:
            assert ours._metrics["train"][key][-1] == pytest.approx(trl._metrics["train"][key][-1], abs=1e-6), key
    assert trl._metrics["train"]["clip_ratio/region_mean"][-1] > 0  # the batch makes the clip bind


CISPO_FEATURES = {name: FEATURES[name] for name in ("kl", "top_entropy_quantile", "entropy_bonus", "off_policy_mask")}


@pytest.mark.parametrize("feature", ["none", *CISPO_FEATURES])
def test_cispo_with_token_mean_is_trls_cispo(feature, feature_model, tok, tmp_path):
    """TRL's loss_type="cispo" is our CISPO aggregated by loss_type="dapo"; the CISPO row uses eq. 7's mean instead."""
    inputs = fixed_batch(feature_model)
    common = dict(SMALL_RUN, max_completion_length=7, **CISPO_FEATURES.get(feature, {}), **CPU)
    ours_args = DHPOConfig(str(tmp_path / "dhpo"), algorithm="cispo", epsilon_high=1.1, loss_type="dapo", **common)
    trl_args = GRPOConfig(str(tmp_path / "trl"), epsilon_high=1.1, loss_type="cispo", **common)
    ours_loss, ours_grads, ours = loss_and_grad(DHPOTrainer, ours_args, feature_model, tok, inputs)
    trl_loss, trl_grads, trl = loss_and_grad(GRPOTrainer, trl_args, feature_model, tok, inputs)
    assert ours_loss.item() == pytest.approx(trl_loss.item(), abs=1e-6) and ours_loss.item() != 0.0
    for name, grad in trl_grads.items():
        torch.testing.assert_close(ours_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    for key in ("cispo_clip_ratio", "kl", "entropy", "policy_loss"):
        assert (key in trl._metrics["train"]) == (key in ours._metrics["train"]), key
        if key in trl._metrics["train"]:
            assert ours._metrics["train"][key][-1] == pytest.approx(trl._metrics["train"][key][-1], abs=1e-6), key
    assert trl._metrics["train"]["cispo_clip_ratio"][-1] > 0


TRL_OBJECTIVE_FEATURES = {
    "none": {}, "kl": dict(beta=0.05), "kl_sequence": dict(beta=0.05, importance_sampling_level="sequence"),
    "top_entropy_quantile": dict(top_entropy_quantile=0.4), "entropy_bonus": dict(entropy_coef=0.1),
    "off_policy_mask": dict(off_policy_mask_threshold=0.02), "sequence": dict(importance_sampling_level="sequence"),
}  # fmt: skip
TRL_OBJECTIVES = {"sapo": dict(sapo_temperature_pos=2.0), "luspo": dict(epsilon=0.1, epsilon_high=0.1),
                  "vespo": dict(vespo_k_neg=2.0), "cispo": dict(epsilon_high=1.1)}  # fmt: skip


@pytest.mark.parametrize("loss_type", list(TRL_OBJECTIVES))
@pytest.mark.parametrize("feature", list(TRL_OBJECTIVE_FEATURES))
def test_trl_objectives_with_trl_features_match_trl(loss_type, feature, feature_model, tok, tmp_path):
    """TRL's SAPO, LUSPO, VESPO and CISPO, spelled as in TRL, give TRL's loss, gradient and metrics on the same batch
    with each TRL feature, at both importance-sampling levels (VESPO's level acts on the KL's weight only)."""
    if (loss_type, feature) == ("vespo", "sequence"):
        pytest.skip("VESPO's level acts on the bias-corrected KL only: refused without it (tests/test_config.py)")
    inputs = fixed_batch(feature_model)
    common = dict(SMALL_RUN, max_completion_length=7, loss_type=loss_type, **TRL_OBJECTIVES[loss_type],
                  **TRL_OBJECTIVE_FEATURES[feature], **CPU)  # fmt: skip
    ours_loss, ours_grads, ours = loss_and_grad(DHPOTrainer, DHPOConfig(str(tmp_path / "dhpo"), **common),
                                                feature_model, tok, inputs)  # fmt: skip
    trl_loss, trl_grads, trl = loss_and_grad(GRPOTrainer, GRPOConfig(str(tmp_path / "trl"), **common), feature_model,
                                             tok, inputs)  # fmt: skip
    assert ours.args.algorithm == loss_type
    assert ours_loss.item() == pytest.approx(trl_loss.item(), abs=1e-6) and ours_loss.item() != 0.0
    for name, grad in trl_grads.items():
        torch.testing.assert_close(ours_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    keys = ("kl", "entropy_coef", "policy_loss", "entropy", "cispo_clip_ratio", "vespo/phi_seq_mean", *TRL_CLIP_METRICS)
    for key in keys:
        assert (key in trl._metrics["train"]) == (key in ours._metrics["train"]), key
        if key in trl._metrics["train"]:
            assert ours._metrics["train"][key][-1] == pytest.approx(trl._metrics["train"][key][-1], abs=1e-6), key


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("scope", ["batch", "sequence", "global"])
def test_dhpo_e_aggregation_and_entropy_scope_by_hand(loss_type, scope, feature_model, tok, tmp_path):
    """DHPO-E's trainer loss on a fixed batch equals the per-token loss aggregated by hand."""
    inputs = fixed_batch(feature_model)
    accumulation = 2
    args = config_for("DHPO-E", output_dir=str(tmp_path), entropy_norm_scope=scope, loss_type=loss_type,
                      dynamic_batching=loss_type != "bnpo",  # bnpo normalises per micro-batch: TRL's batching only
                      **dict(SMALL_RUN, max_completion_length=7, steps_per_generation=2), **CPU)  # fmt: skip
    loss, _, _ = loss_and_grad(DHPOTrainer, args, feature_model, tok, inputs, accumulation=accumulation)

    mask = inputs["completion_mask"].float()
    logps, entropies = reference_logps_and_entropies(
        feature_model, inputs["prompt_ids"], inputs["completion_ids"], inputs["completion_mask"]
    )
    per_token, _ = dhpo_per_token_loss(
        logps, inputs["old_per_token_logps"], inputs["advantages"], mask, entropies,
        entropy_scope="sequence" if scope == "sequence" else "batch",
    )  # fmt: skip
    masked = (per_token * mask).sum(-1)
    if loss_type == "grpo":  # eq. 7, divided for gradient accumulation
        expected = (masked / mask.sum(-1)).mean() / accumulation
    elif loss_type == "bnpo":
        expected = masked.sum() / mask.sum() / accumulation
    elif loss_type == "dr_grpo":
        expected = masked.sum() / (mask.size(0) * 7) / accumulation
    else:  # DAPO: the generation batch's tokens, rescaled to one accumulation window
        expected = masked.sum() / (inputs["num_items_in_batch"] * accumulation / 2)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)


def test_all_masked_micro_batch_gives_finite_zero_loss(feature_model, tok, tmp_path):
    for name in PAPER_ALGORITHMS:
        inputs = fixed_batch(feature_model)
        inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
        inputs["num_items_in_batch"] = torch.tensor(0)
        args = config_for(name, output_dir=str(tmp_path / name), **dict(SMALL_RUN, max_completion_length=7), **CPU)
        loss, grads, trainer = loss_and_grad(DHPOTrainer, args, feature_model, tok, inputs)
        assert loss.item() == 0.0, name
        assert all(torch.isfinite(g).all() and (g == 0).all() for g in grads.values()), name
        # nothing to measure: NaN (skipped by TRL's log), never 0 or +-inf that would corrupt the step's averages
        prefix = get_objective(args.algorithm).metric_prefix
        if prefix is not None:
            logged_now = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith(f"{prefix}/")}
            assert len(logged_now) >= 7 and all(math.isnan(v) for v in logged_now.values()), logged_now


# =============================================================================== (e) the rows against VERL
def binding_batch(model):
    """`fixed_batch` with pi_old moved so that every row's clip binds: ratios far outside the trust regions both
    ways, and two A < 0 tokens with r = e^1.5 = 4.48 and e^1.3 = 3.67, past VERL's dual clip at 3."""
    inputs = fixed_batch(model, seed=1)
    logps, _ = reference_logps_and_entropies(
        model, inputs["prompt_ids"], inputs["completion_ids"], inputs["completion_mask"]
    )
    old = logps + 0.5 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(5))
    old[1, 0] = logps[1, 0] - 1.5  # advantage -0.8
    old[3, 0] = logps[3, 0] - 1.3  # advantage -1.5, a one-token response
    inputs["old_per_token_logps"] = old
    return inputs


DHPO_EPS = dict(epsilon_low_token=0.2, epsilon_high_token=0.28, epsilon_low_seq=0.2, epsilon_high_seq=0.28)
# row -> VERL's loss on (logps, old, advantages, mask, entropies), with the row's appendix D clip settings
VERL_ROWS = {
    "GRPO": lambda lp, old, a, m, h: seq_mean_token_mean(verl_vanilla_terms(lp, old, a, m, 0.2, 0.2, 3.0), m),
    "GSPO": lambda lp, old, a, m, h: seq_mean_token_mean(verl_gspo_terms(lp, old, a, m, 3e-4, 4e-4), m),
    "GMPO": lambda lp, old, a, m, h: verl_geo_mean_loss(lp, old, a, m, 0.4, 0.4),
    "CISPO": lambda lp, old, a, m, h: seq_mean_token_mean(verl_cispo_terms(lp, old, a, m, 10.0, 0.2), m),
    "DHPO-A": lambda lp, old, a, m, h: seq_mean_token_mean(
        reference_dhpo(lp, old, a, m, constant_weights(m, 0.5), "branch", DHPO_EPS), m),
    "DHPO-E": lambda lp, old, a, m, h: seq_mean_token_mean(
        reference_dhpo(lp, old, a, m, reference_entropy_weights(h, m), "branch", DHPO_EPS), m),
    "DHPO-E-unified": lambda lp, old, a, m, h: seq_mean_token_mean(
        reference_dhpo(lp, old, a, m, reference_entropy_weights(h, m), "unified", DHPO_EPS), m),
    # not a row: DHPO at w = 1 with delta = 3 is VERL's vanilla loss at 0.2 / 0.28 with clip_ratio_c = 3
    "DHPO-w1-delta3": lambda lp, old, a, m, h: seq_mean_token_mean(
        verl_vanilla_terms(lp, old, a, m, 0.2, 0.28, 3.0), m),
}  # fmt: skip


@pytest.mark.parametrize("row", list(VERL_ROWS))
def test_row_loss_and_gradient_are_verls(row, feature_model, tok, tmp_path):
    """Each preset through a real DHPOTrainer, against a loop over VERL's definition of the row, on a batch where
    the row's clips (and GRPO's dual clip) bind: same loss, same gradient for every parameter."""
    inputs = binding_batch(feature_model)
    setup = dict(SMALL_RUN, max_completion_length=7, **CPU)
    if row == "DHPO-w1-delta3":
        args = DHPOConfig(str(tmp_path), mixing="averaged", token_weight=1.0, delta=3.0, **setup)
    else:
        args = config_for(row, output_dir=str(tmp_path), **setup)
    loss, grads, trainer = loss_and_grad(DHPOTrainer, args, feature_model, tok, inputs, accumulation=1)

    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    feature_model.zero_grad()
    log_probs = feature_model(input_ids=input_ids, attention_mask=attention).logits[:, 4:-1].float().log_softmax(-1)
    logps = log_probs.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():  # the entropies the trainer mixes with: w is min-max normalised over a narrow range, where
        # the ~1e-6 float32 difference of a separate entropy computation would move w by ~1e-4
        _, entropies, _ = trainer._get_per_token_logps_and_entropies(
            feature_model, input_ids, attention, inputs["completion_ids"].size(1), compute_entropy=True
        )
    mask, old, advantages = inputs["completion_mask"].float(), inputs["old_per_token_logps"], inputs["advantages"]
    ratio = torch.exp(logps - old).detach()
    negative = advantages.unsqueeze(1) < 0
    assert ((ratio > 3) & negative & mask.bool()).sum() >= 2  # the dual clip binds
    assert ((ratio < 0.6) & negative & mask.bool()).any() and ((ratio > 1.4) & ~negative & mask.bool()).any()
    reference = VERL_ROWS[row](logps, old, advantages, mask, entropies)
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), abs=1e-5)
    for name, param in feature_model.named_parameters():
        def message(m, name=name):
            return f"{name}: {m}"

        torch.testing.assert_close(grads[name], param.grad, atol=2e-6, rtol=1e-4, msg=message)
    feature_model.zero_grad()


# =============================================================================== (d) TRL features, end to end
@pytest.fixture(scope="module")
def feature_runs(tok, tmp_path_factory):
    """Two short DHPO-E runs that switch on every TRL feature between them, one with evaluation."""
    eval_prompts = prompts(8, offset=100)
    runs = {}
    for name, features in {
        "kl_bonus_topk_dapo_sequence_eval": dict(
            beta=0.05, entropy_coef=0.01, top_entropy_quantile=0.5, loss_type="dapo", entropy_norm_scope="sequence",
            eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4,
        ),
        "opsm_bnpo_global": dict(off_policy_mask_threshold=0.01, loss_type="bnpo", entropy_norm_scope="global",
                                 dynamic_batching=False),
    }.items():  # fmt: skip
        args = config_for("DHPO-E", output_dir=str(tmp_path_factory.mktemp(name)), **SMALL_RUN, **features, **CPU)
        eval_dataset = eval_prompts if "eval_strategy" in features else None
        model = saved_tiny_model(tok, tmp_path_factory.mktemp(f"{name}_model"))
        runs[name] = run(DHPOTrainer, args, tok, model=model, eval_dataset=eval_dataset)
    return runs


def test_kl_entropy_bonus_topk_dapo_sequence_scope_and_eval(feature_runs):
    trainer = feature_runs["kl_bonus_topk_dapo_sequence_eval"]
    assert trainer.ref_model is not None and trainer.state.global_step == 4
    kl = logged(trainer, "kl")
    # eval logs carry their own kl, so take the training entries (they have "loss")
    train_kl = [e["kl"] for e in trainer.state.log_history if "loss" in e]
    assert len(train_kl) == 4 and train_kl[0] == pytest.approx(0.0, abs=1e-7) and max(train_kl) > 0 and finite(kl)
    assert logged(trainer, "entropy_coef") == pytest.approx([0.01] * 4)
    assert finite(logged(trainer, "policy_loss")) and len(logged(trainer, "policy_loss")) == 4
    eval_entries = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["step"] for e in eval_entries] == [2, 4]
    for entry in eval_entries:
        assert math.isfinite(entry["eval_loss"])
        assert 0 <= entry["eval_dhpo/mixing_weight/mean"] <= 1
        assert entry["eval_dhpo/token_ratio/mean"] == pytest.approx(1.0)  # eval is on-policy
        assert math.isfinite(entry["eval_kl"])


def test_off_policy_mask_bnpo_global_scope(feature_runs):
    trainer = feature_runs["opsm_bnpo_global"]
    assert trainer.state.global_step == 4
    assert finite(logged(trainer, "loss"))
    weights = logged(trainer, "dhpo/mixing_weight/mean")
    assert len(weights) == 4 and all(0 < w < 1 for w in weights)
    assert min(logged(trainer, "dhpo/mixing_weight/std")) > 0.05


# One math reward call per generation batch, 8 answers, all right (12 written as a fraction), graded by a stand-in
# worker on its own clock (tests/grader_stand_in.py) that takes 30 s to start (a start is no answer's cost: the budget
# counts from the first comparison). Budget 10 s: the answers get 9.5 s (the kill margin is kept back); first-pass
# deadline 0.59 s (half of 9.5 s over 8 answers); a slow answer takes 3 s, a quick one 0.01 s.
BUDGET_CALLS = (  # (positions of the slow answers, seconds the worker loses before the first answer)
    ({0, 1, 2, 4, 5, 6}, 0.0),  # first pass 3.58 s; second pass: answer 0 ends at 6.58 s, answer 1 is cut at 9.5 s
    ({0, 2, 4, 6}, 0.0),  # first pass 2.42 s; answers 0 and 2 end at 5.42 s and 8.42 s, answer 4 is cut
    ({0, 1, 2, 3, 4, 5, 6}, 8.0),  # 8 s lost: answers 0 and 1 overrun 0.59 s, answer 2 is cut at 9.5 s, and the
)  # quick answer 7 is never started: answers after the budget ran out score 0 however quick they are
BUDGET_SCORES = ([1, 0, 0, 1, 0, 0, 0, 1], [1, 1, 1, 1, 0, 1, 0, 1], [0] * 8)  # worked out by hand from the above


def test_answers_the_reward_budget_cut_are_logged_per_generation_batch(tok, tmp_path, monkeypatch):
    """A math reward call that runs out of its budget scores the answers it did not decide 0, and the trainer logs
    how many at that generation batch (not a running total); a run whose rewards never call the math grader logs
    nothing under that key. Which answers fit the budget is set by construction, whatever the machine's load."""
    from grader_stand_in import StandInClock, StandInWorker, installed

    from dhpo_trl.scoring.rewards import make_math_verify_reward, pop_grading_counts

    texts = [[rf"\frac{{{12 * m}}}{{{m}}}" for m in range(2 + 8 * call, 10 + 8 * call)] for call in range(3)]
    costs = {texts[call][k]: 3.0 for call, (slow, _) in enumerate(BUDGET_CALLS) for k in slow}
    late = {texts[call][0]: lost for call, (_, lost) in enumerate(BUDGET_CALLS) if lost}
    clock = StandInClock()
    graded, calls = make_math_verify_reward(budget_s=10.0, timeout_s=4.0, workers=1), []

    def slow_math(completions, **kwargs):
        answers = texts[len(calls)]
        assert len(answers) == len(completions)
        calls.append(graded([rf"\boxed{{{text}}}" for text in answers], answer=["12"] * len(answers)))
        return calls[-1]

    pop_grading_counts()
    args = DHPOConfig(output_dir=str(tmp_path), **{**SMALL_RUN, "max_steps": 6}, **CPU)  # 3 generation batches
    with installed(monkeypatch, clock, StandInWorker(clock, costs, late, start_s=30.0)):
        trainer = run(DHPOTrainer, args, tok, reward=slow_math)
    assert calls == [[float(score) for score in scores] for scores in BUDGET_SCORES]
    cut = [(entry["step"], entry["reward/over_budget"]) for entry in trainer.state.log_history
           if "reward/over_budget" in entry]  # fmt: skip
    assert cut == [(1, 5), (3, 2), (5, 8)]  # the first step of each generation batch, each batch's own count
    assert [value for _, value in cut] == [scores.count(0.0) for scores in calls]  # every 0 is a right answer cut
    plain = run(DHPOTrainer, DHPOConfig(output_dir=str(tmp_path / "plain"), **{**SMALL_RUN, "max_steps": 2}, **CPU), tok)
    assert not logged(plain, "reward/over_budget")


def fractions(first: int) -> list[str]:
    """Eight right answers to "12" (12 written as a fraction), distinct for each `first`: no cached verdict."""
    return [rf"\frac{{{12 * m}}}{{{m}}}" for m in range(first, first + 8)]


def cut_at(trainer) -> list[tuple[int, float]]:
    return [(entry["step"], entry["reward/over_budget"]) for entry in trainer.state.log_history
            if "reward/over_budget" in entry]  # fmt: skip


def graded_math(graded, texts: list[list[str]], calls: list):
    """A reward function grading `texts[call]` (all right) by the math reward, the call's scores kept in `calls`."""

    def math_reward(completions, **kwargs):
        calls.append(graded([rf"\boxed{{{text}}}" for text in texts[len(calls)]], answer=["12"] * 8))
        return calls[-1]

    return math_reward


def test_over_budget_is_the_training_batch_own_count_not_a_held_out_evaluations(tok, tmp_path, monkeypatch):
    """The embedded demo's held-out evaluation (`HeldoutAccuracyCallback`: greedy completions scored by the math
    reward, before training and after every step) grades in the same process as the training batches: the answers
    its budget cuts are not theirs. `reward/over_budget` at each generation batch is that batch's count (5, 0, 2),
    however many the evaluations cut (every answer is right, so each 0 is a cut)."""
    from grader_stand_in import StandInClock, StandInWorker, installed

    from dhpo_trl.demo.arithmetic import Problem
    from dhpo_trl.demo.embedded import HeldoutAccuracyCallback, greedy_accuracy
    from dhpo_trl.scoring.rewards import make_math_verify_reward

    train_texts = [fractions(2 + 8 * call) for call in range(3)]
    slow = ({0, 1, 2, 4, 5, 6}, set(), {0, 2, 4, 6})  # BUDGET_CALLS' first two, a quick batch between them
    eval_texts = [fractions(100 + 8 * call) for call in range(7)]  # before training, then after each of 6 steps
    costs = {texts[k]: 3.0 for texts, positions in zip(train_texts, slow) for k in positions}
    costs.update({text: 3.0 for texts in eval_texts for text in texts[:7]})
    clock, graded = StandInClock(), make_math_verify_reward(budget_s=10.0, timeout_s=4.0, workers=1)
    calls, evaluations = [], []
    evaluated = graded_math(graded, eval_texts, evaluations)

    def evaluation(texts, answers):  # the demo's reward(texts, answers), grading slow right answers instead
        return evaluated(texts)

    problems = [Problem(left, 1) for left in range(8)]
    args = DHPOConfig(output_dir=str(tmp_path), **{**SMALL_RUN, "max_steps": 6}, **CPU)  # 3 generation batches
    model = build_tiny_qwen3(tok, hidden_size=32, seed=0)
    with installed(monkeypatch, clock, StandInWorker(clock, costs)):
        before = greedy_accuracy(model, tok, problems, max_new_tokens=4, reward=evaluation)  # as run_embedded does
        callback = HeldoutAccuracyCallback(tok, problems, every=1, max_new_tokens=4, initial=before, reward=evaluation)
        trainer = run(DHPOTrainer, args, tok, reward=graded_math(graded, train_texts, calls), model=model,
                      callbacks=[callback])  # fmt: skip
    assert len(evaluations) == 7 and min(scores.count(0.0) for scores in evaluations) > 0  # each evaluation cut some
    assert cut_at(trainer) == [(1, 5), (3, 0), (5, 2)]
    assert [value for _, value in cut_at(trainer)] == [scores.count(0.0) for scores in calls]


def test_over_budget_after_an_interrupted_reward_call_is_the_next_batch_own_count(tok, tmp_path, monkeypatch):
    """A KeyboardInterrupt in a reward function after the math reward graded its batch (5 answers cut): the next
    `train()`'s generation batches log their own counts (0, then 2), not the interrupted batch's added to the first."""
    from grader_stand_in import StandInClock, StandInWorker, installed

    from dhpo_trl.scoring.rewards import make_math_verify_reward

    texts = [fractions(2 + 8 * call) for call in range(3)]
    slow = ({0, 1, 2, 4, 5, 6}, set(), {0, 2, 4, 6})
    costs = {batch[k]: 3.0 for batch, positions in zip(texts, slow) for k in positions}
    clock, graded, calls = StandInClock(), make_math_verify_reward(budget_s=10.0, timeout_s=4.0, workers=1), []

    def interrupting(completions, **kwargs):  # after the math reward, in its first batch only
        if len(calls) == 1:
            raise KeyboardInterrupt
        return [0.0] * len(completions)

    args = DHPOConfig(output_dir=str(tmp_path), **{**SMALL_RUN, "max_steps": 4}, **CPU)  # 2 generation batches
    trainer = DHPOTrainer(model=build_tiny_qwen3(tok, hidden_size=32, seed=0), args=args, train_dataset=prompts(),
                          reward_funcs=[graded_math(graded, texts, calls), interrupting], processing_class=tok)
    with installed(monkeypatch, clock, StandInWorker(clock, costs)):
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        assert trainer.state.global_step == 0 and calls[0].count(0.0) == 5
        trainer.train()
    assert cut_at(trainer) == [(1, 0), (3, 2)]
    assert [value for _, value in cut_at(trainer)] == [scores.count(0.0) for scores in calls[1:]]
