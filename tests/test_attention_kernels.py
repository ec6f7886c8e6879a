"""Packed rows on CUDA's varlen kernels, on CPU: the kernel choice, the argument building for each `varlen_attn`
signature torch has shipped, and the wiring through `packing` into a real model, with a stand-in kernel written from
torch's documented semantics. The kernels themselves run in tests/test_gpu.py on a GPU.

References are independent: attention written out per sequence as a softmax loop, and the unpacked padded model.
"""

import inspect
import math

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.training import attention_kernels, packing, update_path


def reference_attention(query, key, value, bounds, scale):
    """(1, Hq, L, D) query, (1, Hkv, L, D) key/value -> (1, L, Hq, D): causal softmax within each sequence, query
    head h reading key head h // (Hq / Hkv), written out as a loop over sequences and heads."""
    groups = query.size(1) // key.size(1)
    out = torch.zeros(query.size(2), query.size(1), query.size(3), dtype=torch.float64)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        for head in range(query.size(1)):
            q = query[0, head, start:end].double()
            k, v = key[0, head // groups, start:end].double(), value[0, head // groups, start:end].double()
            scores = q @ k.T * scale
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -math.inf)
            out[start:end, head] = scores.softmax(-1) @ v
    return out.unsqueeze(0)


def varlen_semantics(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale, gqa):
    """What torch documents `varlen_attn` to compute, on (T, H, D) tensors (a stand-in: the kernel needs CUDA)."""
    assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
    assert query.is_contiguous() and key.is_contiguous() and value.is_contiguous()
    lengths = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
    assert max_q == max_k == max(lengths)
    if key.size(1) != query.size(1):
        assert gqa, "varlen_attn refuses fewer key/value heads without enable_gqa"
        key, value = key.repeat_interleave(query.size(1) // key.size(1), 1), value.repeat_interleave(
            query.size(1) // key.size(1), 1
        )
    scale = query.size(-1) ** -0.5 if scale is None else scale
    out = torch.empty_like(query)
    for start, end in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist(), strict=True):
        scores = torch.einsum("qhd,khd->hqk", query[start:end], key[start:end]) * scale
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -math.inf)
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), value[start:end])
    return out


def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return varlen_semantics(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None, False)


def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1)):  # fmt: skip
    return varlen_semantics(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), scale, False)


def torch_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):  # fmt: skip
    return varlen_semantics(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), scale,
                            enable_gqa)  # fmt: skip


SIGNATURES = [torch_2_10, torch_2_11, torch_2_12]


def test_the_installed_varlen_attn_has_the_newest_signature():
    from torch.nn.attention.varlen import varlen_attn

    assert set(inspect.signature(varlen_attn).parameters) == set(inspect.signature(torch_2_12).parameters)


@pytest.mark.parametrize(
    "device, dtype, head_dim, dropout, kernels, expected",
    [
        ("cuda", torch.bfloat16, 128, 0.0, ("torch_varlen",), "torch_varlen"),
        ("cuda", torch.float16, 64, 0.0, ("flash_attn", "torch_varlen"), "flash_attn"),
        ("cuda", torch.bfloat16, 128, 0.0, (), "sdpa"),  # no kernel installed
        ("cuda", torch.float32, 128, 0.0, ("torch_varlen",), "sdpa"),  # the flash kernels run half precision
        ("cuda", torch.bfloat16, 128, 0.1, ("torch_varlen",), "sdpa"),  # nor dropout
        ("cuda", torch.bfloat16, 100, 0.0, ("torch_varlen",), "sdpa"),  # head size not a multiple of 8
        ("cuda", torch.bfloat16, 512, 0.0, ("torch_varlen",), "sdpa"),  # above 256
        ("cpu", torch.bfloat16, 128, 0.0, ("torch_varlen",), "sdpa"),
    ],
)
def test_kernel_choice(device, dtype, head_dim, dropout, kernels, expected):
    assert attention_kernels.choose(device, dtype, head_dim, dropout, kernels) == expected


def random_row(kv_heads, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bounds = [0, 5, 6, 19, 40]
    query = torch.randn(1, 4, 40, 8, generator=gen)
    key, value = torch.randn(1, kv_heads, 40, 8, generator=gen), torch.randn(1, kv_heads, 40, 8, generator=gen)
    return query, key, value, bounds


@pytest.mark.parametrize("signature", SIGNATURES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_varlen_arguments_give_per_sequence_causal_attention_for_every_signature(signature, kv_heads, scale):
    query, key, value, bounds = random_row(kv_heads)
    parameters = frozenset(inspect.signature(signature).parameters)
    args, kwargs = attention_kernels.torch_varlen_arguments(query, key, value, torch.tensor(bounds), 21, scale,
                                                            parameters, torch.float32)  # fmt: skip
    out = signature(*args, **kwargs).unsqueeze(0)
    expected = reference_attention(query, key, value, bounds, 8**-0.5 if scale is None else scale)
    assert out.shape == (1, 40, 4, 8)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    if "enable_gqa" in parameters:  # the kernel repeats the heads itself: no copies of key/value
        assert args[1].size(1) == kv_heads


def test_under_autocast_the_kernel_gets_autocasts_dtype():
    """Qwen3's norms hand float32 queries to attention under autocast; SDPA would run them in bf16, so must the
    kernel (the flash kernels take no float32)."""
    query, key, value, bounds = random_row(2)
    assert attention_kernels.compute_dtype(query) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention_kernels.compute_dtype(query) == torch.bfloat16
    assert attention_kernels.compute_dtype(query.bfloat16()) == torch.bfloat16
    args, _ = attention_kernels.torch_varlen_arguments(query, key, value, torch.tensor(bounds), 21, None,
                                                       frozenset(), torch.bfloat16)  # fmt: skip
    assert [a.dtype for a in args[:3]] == [torch.bfloat16] * 3 and args[3].dtype == torch.int32


def test_flash_attn_arguments(monkeypatch):
    query, key, value, bounds = random_row(2)

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
        assert dropout_p == 0.0
        return varlen_semantics(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, True)

    monkeypatch.setattr(attention_kernels, "flash_attn_varlen", lambda: flash_attn_varlen_func)
    out = attention_kernels.varlen_attention("flash_attn", query, key, value, torch.tensor(bounds), None, 0.3)
    torch.testing.assert_close(out.double(), reference_attention(query, key, value, bounds, 0.3), atol=1e-5,
                               rtol=1e-5)  # fmt: skip


@pytest.fixture
def stand_in_kernel(monkeypatch):
    """torch's newest `varlen_attn` semantics as the kernel `packing` picks, whatever the device; returns the list of
    its calls' token counts."""
    calls = []

    def kernel(query, *args, **kwargs):
        calls.append(query.size(0))
        return torch_2_12(query, *args, **kwargs)

    kernel.__signature__ = inspect.signature(torch_2_12)
    monkeypatch.setattr(attention_kernels, "torch_varlen", lambda: kernel)
    monkeypatch.setattr(attention_kernels, "available", lambda: ("torch_varlen",))
    monkeypatch.setattr(attention_kernels, "choose", lambda device, dtype, head_dim, dropout, kernels: kernels[0])
    return calls


def test_packed_attention_runs_the_varlen_kernel(stand_in_kernel):
    query, key, value, bounds = random_row(2)
    before = attention_kernels.CALLS["torch_varlen"]
    out, weights = packing.packed_sdpa_attention(None, query, key, value, None, scaling=0.3,
                                                 cu_seq_lens_q=torch.tensor(bounds, dtype=torch.int32))  # fmt: skip
    assert weights is None and attention_kernels.CALLS["torch_varlen"] == before + 1
    assert stand_in_kernel == [40]  # one kernel call over the whole row
    torch.testing.assert_close(out.double(), reference_attention(query, key, value, bounds, 0.3), atol=1e-5,
                               rtol=1e-5)  # fmt: skip


def test_packed_model_through_the_varlen_kernel_equals_the_padded_model(stand_in_kernel):
    """Log-probs and gradients of packed rows run by the kernel's call equal the padded model's (GQA: 4 query heads,
    2 key/value heads)."""
    tok = build_char_tokenizer()
    model = build_tiny_qwen3(tok, seed=5, hidden_size=32)
    add_fused_lm_head(model, outputs=("log_probs",))
    gen = torch.Generator().manual_seed(2)
    prompts, completions, width = [4, 9, 2], [11, 3, 7], 9
    ids = torch.full((3, width + 11), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[row, width - p : width + c] = torch.randint(3, len(tok), (p + c,), generator=gen)
        mask[row, width - p : width + c] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :width] = -100
    expected = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -11:]
    expected.sum().backward()
    expected_gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    before = attention_kernels.CALLS["torch_varlen"]
    logps, _, _ = packing.forward_packed(model, packing.pack(ids, mask, 11, [[2, 0, 1]]), (3, 11), False, False,
                                         torch.enable_grad)  # fmt: skip
    logps.sum().backward()
    assert attention_kernels.CALLS["torch_varlen"] == before + model.config.num_hidden_layers
    assert stand_in_kernel == [int(mask.sum())] * model.config.num_hidden_layers  # each layer: one call, the row
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([p.grad.flatten() for p in model.parameters()]), expected_gradient,
                               atol=1e-5, rtol=1e-4)  # fmt: skip


def test_automatic_choice_on_cuda_packs_where_a_varlen_kernel_is_installed(monkeypatch):
    tok = build_char_tokenizer()
    model = build_tiny_qwen3(tok)
    monkeypatch.setattr(attention_kernels, "available", lambda: ("torch_varlen",))
    assert packing.automatic_reason([model], "cuda") is None
    path = update_path.choose(None, False, True, {"model": model, "ref_model": None}, "cuda")
    assert path.padding_free and path.note is None
    monkeypatch.setattr(attention_kernels, "available", lambda: ())
    reason = packing.automatic_reason([model], "cuda")
    assert "varlen" in reason and "padding_free=True" in reason
    path = update_path.choose(None, False, True, {"model": model, "ref_model": None}, "cuda")
    assert not path.padding_free and "padding_free=None" in path.note
    assert "padding_free=True" in packing.automatic_reason([model], "mps")  # other devices: unmeasured


def test_this_cpu_build_has_no_varlen_kernel():
    """A CPU-only torch has `varlen_attn` but not the flash kernels under it: nothing to pick."""
    if torch.backends.cuda.is_flash_attention_available():
        pytest.skip("this torch has its flash kernels")
    assert attention_kernels.torch_varlen() is None and "torch_varlen" not in attention_kernels.available()
