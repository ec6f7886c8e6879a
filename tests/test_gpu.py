"""GPU tests (marker `gpu`), run by scripts/gpu_check.sh on a lent GPU: packed rows against padded rows with torch's
varlen kernel, the per-sequence SDPA loop and eager attention, and the tiny MoE training with routing and its aux loss.

They run where CUDA is visible, or on CPU in the dry run (`DHPO_GPU_CHECK_DEVICE=cpu`, which
`bash scripts/gpu_check.sh --cpu OUTPUT_DIR` sets), where the varlen-kernel cases skip; the suite otherwise skips them.

Tolerances: float32, packed equals padded to 1e-4 (logits, log-probs, gradients). bf16: both are compared with the
float32 padded result of the same weights, and packed rows' error may be at most twice padded rows' own plus 0.02
(logits, log-probs: largest absolute error; gradients: relative norm, plus 0.01): the kernels differ, their rounding
does not have to. Every case also checks that a row whose sequences attend to each other falls outside its tolerance,
so the comparison can fail. Measured errors go into the JUnit properties (scripts/gpu_check.py copies them to JSON).
"""

import contextlib
import math
import os

import pytest
import torch
from datasets import Dataset
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from trl.trainer.utils import add_fused_lm_head

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.demo.tiny import build_char_tokenizer
from dhpo_trl.training import attention_kernels, packing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu" if os.environ.get("DHPO_GPU_CHECK_DEVICE") == "cpu" else None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (bash scripts/gpu_check.sh OUTPUT_DIR runs these), "
                       "or DHPO_GPU_CHECK_DEVICE=cpu for the dry run"),  # fmt: skip
]
PROMPTS = [3, 40, 1, 25, 9, 60, 2]
COMPLETIONS = [150, 4, 1, 90, 0, 33, 120]  # one sequence without a completion token
ROWS = [[6, 0, 3], [1, 2, 4, 5]]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def build(tok, implementation: str, moe: bool):
    """Hidden 256, 4 query heads of 64 (a head size the flash kernels take), 2 key/value heads (GQA); weights drawn
    wider than a fresh model's so that outputs are far from uniform and a wrong attention shows."""
    common = dict(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=0.1,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    if moe:
        config = Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                                decoder_sparse_step=1, output_router_logits=False, router_aux_loss_coef=0.01)  # fmt: skip
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    model.config._attn_implementation = implementation
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model.to(DEVICE)


def padded_batch(tok):
    gen = torch.Generator().manual_seed(1)
    width, keep = max(PROMPTS), max(COMPLETIONS)
    ids = torch.full((len(PROMPTS), width + keep), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        ids[row, width - p : width + c] = torch.randint(3, len(tok), (p + c,), generator=gen)
        mask[row, width - p : width + c] = 1
    return ids.to(DEVICE), mask.to(DEVICE), keep


def gradient(model, logps, weights):
    model.zero_grad()
    (logps.float() * weights).sum().backward()
    return torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])


def padded_outputs(model, ids, mask, keep, weights):
    """Logits at the real positions, completion log-probs and the gradient of the padded forward TRL runs."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[mask.bool()].float()
    logps = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -keep:]
    return logits.detach(), logps.detach().float(), gradient(model, logps, weights)


def packed_logits(model, ids, mask, keep, leak: bool):
    """Logits of the packed rows, put back in the padded batch's real-token order. `leak`: each row's sequences
    attend to each other (one sequence boundary per row), the wrong attention a packed row must not get."""
    found = {}
    for sequences, row in zip(ROWS, packing.pack(ids, mask, keep, ROWS), strict=True):  # a row keeps its order
        bounds = row.cu_seqlens[[0, -1]] if leak else row.cu_seqlens
        with packing.packed_attention(model):
            logits = model(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False,
                           cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=row.input_ids.size(1),
                           max_length_k=row.input_ids.size(1)).logits[0].float()  # fmt: skip
        lengths = (row.cu_seqlens[1:] - row.cu_seqlens[:-1]).tolist()
        for sequence, piece in zip(sequences, logits.split(lengths), strict=True):
            found[sequence] = piece
    return torch.cat([found[i] for i in range(len(PROMPTS))]).detach()


def packed_outputs(model, ids, mask, keep, weights):
    logps, _, _ = packing.forward_packed(model, packing.pack(ids, mask, keep, ROWS), (len(PROMPTS), keep), True,
                                         False, torch.enable_grad)  # fmt: skip
    return packed_logits(model, ids, mask, keep, False), logps.detach().float(), gradient(model, logps, weights)


def errors(outputs, reference):
    logits, logps, grads = outputs
    return (float((logits - reference[0]).abs().max()), float((logps - reference[1]).abs().max()),
            float((grads - reference[2]).norm() / reference[2].norm()))  # fmt: skip


CASES = [  # (attention implementation, dtype, kernel for packed rows, MoE)
    ("sdpa", torch.float32, "sdpa", False),
    ("eager", torch.float32, "sdpa", False),
    ("sdpa", torch.float32, "sdpa", True),
    ("sdpa", torch.bfloat16, "torch_varlen", False),
    ("eager", torch.bfloat16, "torch_varlen", False),
    ("sdpa", torch.bfloat16, "torch_varlen", True),
    ("sdpa", torch.bfloat16, "sdpa", False),
]


@pytest.mark.parametrize("implementation, dtype, kernel, moe", CASES,
                         ids=[f"{i}-{str(d)[6:]}-{k}{'-moe' if m else ''}" for i, d, k, m in CASES])  # fmt: skip
def test_packed_rows_equal_padded_rows(tok, monkeypatch, record_property, implementation, dtype, kernel, moe):
    if kernel == "torch_varlen":
        if DEVICE != "cuda":
            pytest.skip("torch's varlen kernel runs on CUDA only")
        if attention_kernels.torch_varlen() is None:
            pytest.skip(f"torch {torch.__version__} has no varlen_attn with flash kernels: use torch>=2.10 with CUDA")
    monkeypatch.setattr(attention_kernels, "available", lambda: () if kernel == "sdpa" else (kernel,))
    model = build(tok, implementation, moe).to(dtype).float()  # the float32 reference runs the same weights
    ids, mask, keep = padded_batch(tok)
    weights = torch.randn(len(PROMPTS), keep, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    reference = padded_outputs(model, ids, mask, keep, weights)  # float32, the model's own padded attention
    model.to(dtype)
    padded = padded_outputs(model, ids, mask, keep, weights) if dtype != torch.float32 else reference
    before = attention_kernels.CALLS[kernel]
    packed = packed_outputs(model, ids, mask, keep, weights)
    assert attention_kernels.CALLS[kernel] > before, f"packed rows did not run the {kernel} kernel"
    leak = float((packed_logits(model, ids, mask, keep, True) - reference[0]).abs().max())
    packed_errors, padded_errors = errors(packed, reference), errors(padded, reference)
    for name, value in zip(("logits", "logps", "gradient"), packed_errors, strict=True):
        record_property(f"packed_{name}_error", f"{value:.3g}")
    for name, value in zip(("logits", "logps", "gradient"), padded_errors, strict=True):
        record_property(f"padded_{name}_error", f"{value:.3g}")
    record_property("leaking_rows_logits_error", f"{leak:.3g}")
    if dtype == torch.float32:
        tolerances = (1e-4, 1e-4, 1e-4)
        torch.testing.assert_close(packed[0], reference[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(packed[1], reference[1], atol=1e-4, rtol=1e-4)
    else:
        tolerances = tuple(2 * e + floor for e, floor in zip(padded_errors, (0.02, 0.02, 0.01), strict=True))
    assert all(e <= t for e, t in zip(packed_errors, tolerances, strict=True)), (packed_errors, tolerances)
    assert leak > 10 * tolerances[0], f"rows that attend across sequences ({leak:.3g}) pass the tolerance"


def test_tiny_moe_trains_with_routing_and_aux_loss(tok, tmp_path):
    """DHPO off-policy steps on the device (bf16 on CUDA), padding_free left automatic: on CUDA with a varlen kernel
    the update packs; the router's aux loss is logged finite and the router learns."""
    model = build(tok, "sdpa", True)
    router = [p.detach().clone() for n, p in model.named_parameters() if "gate.weight" in n and "mlp.gate." in n]
    assert router, "no router weights found"
    cuda = DEVICE == "cuda"
    args = DHPOConfig(output_dir=str(tmp_path), use_cpu=not cuda, bf16=cuda, report_to="none", save_strategy="no",
                      per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=1,
                      steps_per_generation=2, max_completion_length=16, max_steps=2, logging_steps=1,
                      learning_rate=1e-2, seed=0)  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(8)]})
    trainer = DHPOTrainer(model, lambda completions, **kw: [float(len(c) % 3) for c in completions], args=args,
                          train_dataset=dataset, processing_class=tok)  # fmt: skip
    before = attention_kernels.CALLS.copy()
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "aux_loss" in entry]
    assert len(logs) == 2
    assert all(math.isfinite(e["loss"]) and math.isfinite(e["aux_loss"]) and e["aux_loss"] > 0.5 for e in logs)
    after = [p.detach() for n, p in trainer.model.named_parameters() if "gate.weight" in n and "mlp.gate." in n]
    assert any(float((a.float() - b.float()).abs().max()) > 0 for a, b in zip(after, router, strict=True))
    if cuda and attention_kernels.available():  # fp32 weights under bf16 autocast still get the varlen kernel
        assert trainer._update.padding_free and (attention_kernels.CALLS - before)[attention_kernels.available()[0]] > 0


def masked_gradients(model, ids, mask, context) -> int:
    """Non-finite parameter-gradient values of one forward and backward, the forward inside `context`."""
    model.zero_grad(set_to_none=True)
    with context():
        logits = model(input_ids=ids, attention_mask=mask).logits
    (logits.float() * mask[..., None]).mean().backward()
    return sum(int((~torch.isfinite(p.grad)).sum()) for p in model.parameters() if p.grad is not None)


def test_the_update_attention_keeps_masked_gradients_finite(tok, record_property):
    """The micro-batch that made the H100 benchmark's dynamic arm NaN, in small: bf16 SDPA, 192 columns (64 mod 128),
    one left-padded row (fully masked query rows). Under the update's attention context
    (`dhpo_trl.training.cuda_attention`) every gradient is finite; what SDPA's default choice gives is recorded
    (`default_nonfinite_gradients`: more than 0 where cuDNN's backward has pytorch/pytorch#196678)."""
    from dhpo_trl.training import cuda_attention

    model = build(tok, "sdpa", False).to(torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    torch.manual_seed(1)
    ids = torch.randint(3, len(tok), (2, 192), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :10] = 0  # a left-padded prompt
    guarded, note = cuda_attention.for_update(DEVICE)
    record_property("update_attention", "default" if note is None else "without cuDNN")
    record_property("default_nonfinite_gradients", str(masked_gradients(model, ids, mask, contextlib.nullcontext)))
    assert masked_gradients(model, ids, mask, guarded) == 0
