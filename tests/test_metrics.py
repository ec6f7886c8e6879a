"""Every logged `dhpo/` and `gmpo/` metric, `entropy` and `kl` against a hand computation on a fixed batch.

The batch (tests/metric_batch.py) has chosen ratios, both advantage signs, ragged lengths and an all-padding row;
the expected values are computed token by token on Python floats. Two processes: tests/test_metrics_distributed.py.
"""

import math

import pytest
import torch
from datasets import Dataset
from metric_batch import (
    CLIP_EXPECTED,
    GMPO_EPSILONS,
    KL_SHIFTS,
    LOG_RATIOS,
    WIDTH,
    _per_token,
    build_policy,
    clip_info,
    epsilons_for,
    expected_metrics,
    full_batch_entropies,
    inputs_for,
)
from transformers import Qwen3ForCausalLM

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.core import metrics
from dhpo_trl.demo.tiny import build_char_tokenizer

CASES = {  # name: (config overrides, expected_metrics arguments)
    "dhpo_e": (dict(), dict()),
    "dhpo_e_sequence_scope": (dict(entropy_norm_scope="sequence"), dict(scope="sequence")),
    "dhpo_e_unified": (dict(clipping="unified"), dict(clipping="unified")),
    "dhpo_a_plain_kl": (dict(mixing="averaged", token_weight=0.3, use_bias_correction_kl=False),
                        dict(mixing="averaged", token_weight=0.3, bias_corrected_kl=False)),
    "gmpo": (dict(algorithm="gmpo", **GMPO_EPSILONS), dict(algorithm="gmpo")),
}  # fmt: skip


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """The tiny policy, saved and reloaded so that TRL can build the reference model (beta > 0) from its path."""
    path = tmp_path_factory.mktemp("metric_policy")
    build_policy(build_char_tokenizer()).save_pretrained(path)
    return Qwen3ForCausalLM.from_pretrained(path)


def make_trainer(policy, output_dir, **overrides):
    args = DHPOConfig(
        output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        per_device_train_batch_size=5, num_generations=5, max_completion_length=WIDTH, beta=0.04,
        **{**epsilons_for(overrides), **overrides},
    )  # fmt: skip
    tokenizer = build_char_tokenizer()
    return DHPOTrainer(
        policy, lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 5}), processing_class=tokenizer,
    )  # fmt: skip


def training_trainer(policy, output_dir, **overrides):
    """A trainer in train mode whose loss is scaled for one micro-batch per optimizer step."""
    trainer = make_trainer(policy, output_dir, **overrides)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def logged(trainer, mode):
    return {key: values[-1] for key, values in trainer._metrics[mode].items()}


def assert_metrics(actual, expected):
    prefix = "gmpo/" if any(key.startswith("gmpo/") for key in expected) else "dhpo/"
    ours = {key for key in actual if key.startswith(prefix)}
    assert ours == {key for key in expected if key.startswith(prefix)}, ours  # no metric missing or unexplained
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("case", list(CASES))
def test_logged_metrics_match_the_hand_computation(case, policy, tmp_path):
    overrides, expectation = CASES[case]
    trainer = training_trainer(policy, tmp_path, **overrides)
    trainer.compute_loss(trainer.model, inputs_for(trainer.model))
    expected = expected_metrics(full_batch_entropies(trainer.model), **expectation)
    assert_metrics(logged(trainer, "train"), expected)
    assert "eval" not in trainer._metrics or not trainer._metrics["eval"]


def test_the_batch_exercises_every_metric(policy):
    """Guards the fixture: each clip fraction is strictly between 0 and 1, and the weight spread tells std from
    variance; the sequence ratio's mean (over sequences) differs from a token-weighted one."""
    entropies = full_batch_entropies(policy)
    branch = expected_metrics(entropies)
    for key in ("token_low", "token_high", "sequence_low", "sequence_high"):
        assert 0 < branch[f"dhpo/clip_fraction/{key}"] < 1, key
    assert 0 < branch["dhpo/clipped_term_fraction"] < 1
    unified = expected_metrics(entropies, clipping="unified")
    assert 0 < unified["dhpo/clip_fraction/token_high"] < 1 and 0 < unified["dhpo/clipped_term_fraction"] < 1
    std = branch["dhpo/mixing_weight/std"]
    assert 0.1 < std < 0.9 and abs(std - std**2) > 0.05
    rows = [row for row in LOG_RATIOS if row]
    ratios = [math.exp(sum(row) / len(row)) for row in rows]
    token_weighted = sum(r * len(row) for r, row in zip(ratios, rows)) / sum(len(row) for row in rows)
    assert abs(branch["dhpo/sequence_ratio/mean"] - token_weighted) > 0.01
    gmpo = expected_metrics(entropies, algorithm="gmpo")
    assert 0 < gmpo["gmpo/clip_fraction"] < 1
    # GMPO logs the clipped geometric mean: the clip moved it away from the plain one
    assert gmpo["gmpo/sequence_ratio/min"] > branch["dhpo/sequence_ratio/min"] + 0.01


def test_eval_mode_logs_under_eval(policy, tmp_path):
    trainer = make_trainer(policy, tmp_path)
    trainer.model.eval()
    trainer.compute_loss(trainer.model, inputs_for(trainer.model))
    assert not trainer._metrics["train"]
    assert_metrics(logged(trainer, "eval"), expected_metrics(full_batch_entropies(trainer.model)))


@pytest.mark.parametrize("algorithm", ["dhpo", "gmpo"])
def test_all_padding_batch_logs_nan_not_zero(algorithm, policy, tmp_path):
    """Nothing to measure: NaN (which TRL's log skips) for every ratio metric, never 0 or +-inf."""
    trainer = training_trainer(policy, tmp_path, algorithm=algorithm, **(GMPO_EPSILONS if algorithm == "gmpo" else {}))
    loss = trainer.compute_loss(trainer.model, inputs_for(trainer.model, all_padding=True))
    assert loss.item() == 0.0
    metrics = logged(trainer, "train")
    ours = {k: v for k, v in metrics.items() if k.startswith(f"{algorithm}/") or k in ("entropy", "kl")}
    assert len(ours) >= (15 if algorithm == "dhpo" else 9)
    assert all(math.isnan(v) for v in ours.values()), ours


def test_metrics_reduce_over_the_whole_micro_batch_not_the_last_row(policy, tmp_path):
    """Two calls log two entries; the second (a sub-batch) has its own hand-computed values."""
    trainer = training_trainer(policy, tmp_path, mixing="averaged", token_weight=0.3)
    trainer.compute_loss(trainer.model, inputs_for(trainer.model))
    trainer.compute_loss(trainer.model, inputs_for(trainer.model, rows=[1]))
    series = trainer._metrics["train"]["dhpo/token_ratio/mean"]
    assert len(series) == 2
    row1 = [math.exp(x) for x in (-0.40, -0.10, 0.20, -0.30)]
    assert series[1] == pytest.approx(sum(row1) / 4, rel=1e-5)
    assert trainer._metrics["train"]["dhpo/token_ratio/min"][1] == pytest.approx(min(row1), rel=1e-5)
    assert trainer._metrics["train"]["dhpo/sequence_ratio/mean"][1] == pytest.approx(math.exp(-0.15), rel=1e-5)


def test_a_single_valid_token_is_measured_not_nan(policy, tmp_path):
    """The all-padding guard must not swallow the smallest real batch: one valid token in the whole micro-batch."""
    trainer = training_trainer(policy, tmp_path, mixing="averaged", token_weight=0.3)
    inputs = inputs_for(trainer.model, rows=[3, 2])  # row 3 has two tokens, row 2 none
    inputs["completion_mask"][0, 1] = 0  # keep only row 3's first token (log-ratio 0.60)
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    trainer.compute_loss(trainer.model, inputs)
    metrics = logged(trainer, "train")
    ratio = math.exp(0.60)
    shift = KL_SHIFTS[3][0]  # ref minus pi_theta on that token
    expected = {
        "entropy": full_batch_entropies(trainer.model)[(3, 0)],
        "kl": (math.exp(shift) - shift - 1) * ratio,  # bias-corrected: scaled by the mixed ratio, here r = s
        "off_policy/abs_log_ratio": 0.60,
        "dhpo/token_ratio/mean": ratio, "dhpo/token_ratio/min": ratio, "dhpo/token_ratio/max": ratio,
        "dhpo/sequence_ratio/mean": ratio, "dhpo/sequence_ratio/min": ratio, "dhpo/sequence_ratio/max": ratio,
        "dhpo/mixing_weight/mean": 0.3, "dhpo/mixing_weight/std": 0.0,
    }  # fmt: skip
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def clip_logged(info, mask, kind="clip_ratio"):
    """TRL's clip metrics of one process from the pure metric functions."""
    sums, maxima = metrics.clip_sums(kind, info, mask)
    return metrics.clip_metrics(kind, *metrics.reduce_across(sums, maxima, metrics.local_all_reduce))


def test_trl_clip_metrics_match_the_hand_computation():
    """TRL's `clip_ratio/*` from the objective's indicators: padding never counts, a row with padding can hold the
    extreme share, one valid token is a share of 1, and GSPO's one-per-sequence indicators count every row."""
    assert clip_logged(*clip_info([0, 1, 2, 3])) == pytest.approx(CLIP_EXPECTED, rel=1e-6)
    info, mask = clip_info([2, 0])
    mask[1] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # one valid token, clipped below
    assert clip_logged(info, mask) == pytest.approx({
        "clip_ratio/low_mean": 1.0, "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 1.0,
        "clip_ratio/low_min": 1.0, "clip_ratio/high_max": 0.0,
    })  # fmt: skip
    info, _ = clip_info([3, 1])
    info["clipped_low"][:] = False
    empty = clip_logged(info, torch.zeros(2, 4))  # nothing valid anywhere: NaN, never +-inf
    assert all(math.isnan(empty[key]) for key in ("clip_ratio/low_min", "clip_ratio/high_max"))
    # GSPO: one indicator per sequence, (B, 1); TRL counts each row, an all-padding one included
    sequence = {"clipped_low": torch.tensor([[False], [True], [True]]), "clipped_high": torch.tensor([[True], [False], [False]])}
    mask = torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    assert clip_logged(sequence, mask) == pytest.approx({
        "clip_ratio/low_mean": 2 / 3, "clip_ratio/high_mean": 1 / 3, "clip_ratio/region_mean": 1.0,
        "clip_ratio/low_min": 0.0, "clip_ratio/high_max": 1.0,
    })  # fmt: skip


# ------------------------------------------------------------------ inputs TRL may add or leave out
def test_tool_masked_tokens_count_as_padding(policy, tmp_path):
    """TRL's `tool_mask` marks tool-output tokens: they stay in the forward (attention) but leave the loss and every
    metric, token and sequence means alike."""
    trainer = training_trainer(policy, tmp_path, mixing="averaged", token_weight=0.3)
    tool_mask = torch.ones(len(LOG_RATIOS), WIDTH, dtype=torch.long)
    tool_mask[0, 1:3] = 0  # row 0's tokens 1 and 2 (log-ratios 0.30, 0.35) came from a tool
    tool_mask[4, 0] = 0  # and row 4's first (0.05)
    loss = trainer.compute_loss(trainer.model, {**inputs_for(trainer.model), "tool_mask": tool_mask})
    metrics = logged(trainer, "train")
    kept = [[0.40, -0.05, 0.50, 0.20], [-0.40, -0.10, 0.20, -0.30], [0.60, -0.02], [-0.30, 0.10, 0.00, -0.08]]
    tokens = [x for row in kept for x in row]
    sequences = [math.exp(sum(row) / len(row)) for row in kept]
    expected = {
        "dhpo/token_ratio/mean": sum(math.exp(x) for x in tokens) / len(tokens),
        "dhpo/token_ratio/max": math.exp(0.60), "dhpo/token_ratio/min": math.exp(-0.40),
        "dhpo/sequence_ratio/mean": sum(sequences) / 4, "dhpo/sequence_ratio/max": max(sequences),
        "off_policy/abs_log_ratio": sum(abs(x) for x in tokens) / len(tokens),
    }  # fmt: skip
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5), key
    assert torch.isfinite(loss)
    full = trainer.compute_loss(trainer.model, inputs_for(trainer.model))
    assert abs(full.item() - loss.item()) > 1e-3  # the tool tokens' terms left the loss too


def test_on_policy_batch_without_old_logps_has_unit_ratios(policy, tmp_path):
    """TRL leaves `old_per_token_logps` out when the batch is exactly on-policy: pi_old is then pi_theta itself, so
    every ratio is 1 and the loss is that of explicit old log-probs equal to the policy's own."""
    trainer = training_trainer(policy, tmp_path)
    inputs = inputs_for(trainer.model)
    explicit = {**inputs, "old_per_token_logps": inputs["old_per_token_logps"] + _per_token(LOG_RATIOS, range(5))}
    on_policy = {k: v for k, v in inputs.items() if k != "old_per_token_logps"}
    loss = trainer.compute_loss(trainer.model, on_policy)
    metrics = logged(trainer, "train")
    for key in ("dhpo/token_ratio/min", "dhpo/token_ratio/max", "dhpo/sequence_ratio/mean", "off_policy/abs_log_ratio"):
        assert metrics[key] == pytest.approx(1.0 if "ratio/" in key else 0.0, abs=1e-6), key
    assert loss.item() == pytest.approx(trainer.compute_loss(trainer.model, explicit).item(), rel=1e-5, abs=1e-7)


def test_image_inputs_reach_the_policy_forward(policy, tmp_path, monkeypatch):
    """A vision-language batch's extra tensors (pixel values, grids, ...) go to the forward with the token ids."""
    trainer = training_trainer(policy, tmp_path)
    forward = trainer._get_per_token_logps_and_entropies
    seen = []

    def recording(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        seen.append({key: value for key, value in kwargs.items() if key not in ("compute_entropy", "compute_aux_loss")})
        return forward(model, input_ids, attention_mask, logits_to_keep, compute_entropy=kwargs["compute_entropy"],
                       compute_aux_loss=kwargs["compute_aux_loss"])  # fmt: skip

    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", recording)
    pixels, grid = torch.ones(2, 3), torch.tensor([[1, 2, 2]])
    trainer.compute_loss(trainer.model, {**inputs_for(trainer.model), "pixel_values": pixels, "image_grid_thw": grid})
    (kwargs,) = seen
    assert kwargs["pixel_values"] is pixels and kwargs["image_grid_thw"] is grid
    assert {key for key, value in kwargs.items() if value is not None} == {"pixel_values", "image_grid_thw"}
    assert set(kwargs) >= {"num_images", "pixel_attention_mask", "token_type_ids", "image_sizes"}  # passed as None


def test_off_policy_mask_compares_with_the_sampler_log_probs(policy, tmp_path, monkeypatch):
    """TRL's off-policy sequence mask measures drift from the policy that sampled (vLLM's log-probs when present),
    and falls back to pi_old when the batch has none."""
    trainer = training_trainer(policy, tmp_path, off_policy_mask_threshold=0.5)
    seen = []

    def record(**kwargs):
        seen.append(kwargs)
        return torch.ones_like(kwargs["mask"], dtype=torch.float32)

    monkeypatch.setattr(trainer, "get_off_policy_mask", record)
    inputs = inputs_for(trainer.model)
    sampler = inputs["old_per_token_logps"] - 0.25
    trainer.compute_loss(trainer.model, {**inputs, "sampling_per_token_logps": sampler})
    trainer.compute_loss(trainer.model, inputs)
    assert seen[0]["sampling_per_token_logps"] is sampler
    assert seen[1]["sampling_per_token_logps"] is inputs["old_per_token_logps"]
    assert all(call["off_policy_threshold"] == 0.5 for call in seen)


def test_vllm_importance_sampling_correction_multiplies_the_loss(policy, tmp_path):
    """With vLLM, TRL's detached pi_old / pi_sampler weight multiplies each token's loss: a weight of 2 on every
    token doubles the loss (beta = 0, so no KL term dilutes it)."""
    trainer = training_trainer(policy, tmp_path)
    trainer.beta = 0.0
    inputs = inputs_for(trainer.model)
    plain = trainer.compute_loss(trainer.model, inputs).item()
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True  # what a vLLM run sets
    weights = torch.full((len(LOG_RATIOS), WIDTH), 2.0)
    weighted = trainer.compute_loss(trainer.model, {**inputs, "importance_sampling_ratio": weights}).item()
    assert abs(plain) > 1e-3 and weighted == pytest.approx(2 * plain, rel=1e-5)
