"""Varlen attention kernels for packed rows on CUDA: one kernel call per layer over the whole row, sequences kept
apart by their offsets (`cu_seqlens`), instead of one SDPA call per sequence.

`packing.packed_sdpa_attention` asks `select` which kernel runs a packed row:

* `flash_attn`: the flash-attn package's `flash_attn_varlen_func`, where it is installed (transformers'
  `is_flash_attn_2_available`);
* `torch_varlen`: PyTorch's own `torch.nn.attention.varlen.varlen_attn` (torch 2.10+, over the flash kernels torch
  ships), so a padding-free update needs nothing beyond torch on a GPU;
* `sdpa`: the per-sequence SDPA loop, on CPU and wherever neither kernel applies: float32 or a dropout (the flash
  kernels run half precision without dropout), a head size the kernels do not take.

`varlen_attn`'s signature changed between torch releases (2.10: `is_causal`, no `scale` and no GQA; later:
`window_size=(-1, 0)` for causal, `scale`; 2.12+: `enable_gqa`); `torch_varlen_arguments` builds the call for
whichever parameters the installed one has. Everything here but `varlen_attention` is a pure function of shapes,
dtypes and parameter names, tested on CPU; the kernels themselves run only on CUDA.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from functools import lru_cache

import torch

KERNELS = ("flash_attn", "torch_varlen", "sdpa")
HALF = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # the flash kernels' largest head size (a multiple of 8)

# Packed attention calls per kernel in this process: which path ran (read by scripts/gpu_check_parts.py and tests).
CALLS: Counter = Counter()


@lru_cache(maxsize=1)
def torch_varlen() -> Callable | None:
    """torch's `varlen_attn` where this torch build has it and its flash kernels (None on a CPU-only build)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if torch.backends.cuda.is_flash_attention_available() else None


@lru_cache(maxsize=1)
def flash_attn_varlen() -> Callable | None:
    """flash-attn's `flash_attn_varlen_func` where the package is installed and usable."""
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        return None
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def available() -> tuple[str, ...]:
    """The varlen kernels this install has, preferred first."""
    found = {"flash_attn": flash_attn_varlen(), "torch_varlen": torch_varlen()}
    return tuple(name for name, function in found.items() if function is not None)


def choose(device_type: str, dtype: torch.dtype, head_dim: int, dropout: float, kernels: tuple[str, ...]) -> str:
    """The kernel for one packed attention call: the first of `kernels` that takes it, else the per-sequence `sdpa`."""
    if device_type != "cuda" or dtype not in HALF or dropout or head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return "sdpa"
    return next((name for name in ("flash_attn", "torch_varlen") if name in kernels), "sdpa")


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's where it is on (the model's SDPA would run in it; Qwen3's norms hand
    float32 queries to attention under autocast), else the query's."""
    device = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype


def select(query: torch.Tensor, dropout: float) -> str:
    """`choose` for this call's query (1, heads, L, dim), counted in `CALLS`."""
    kernel = choose(query.device.type, compute_dtype(query), query.size(-1), dropout, available())
    CALLS[kernel] += 1
    return kernel


def cuda_packing_reason() -> str | None:
    """Why packed rows on CUDA would run the per-sequence SDPA loop (one kernel per sequence and layer), or None."""
    if available():
        return None
    return ("this install has no varlen attention kernel (torch.nn.attention.varlen with torch's flash kernels, "
            "torch>=2.10 built with CUDA, or the flash-attn package); set padding_free=True to pack with the "
            "per-sequence SDPA loop anyway")  # fmt: skip


@lru_cache(maxsize=4)
def parameter_names(function: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def row_major(tensors, dtype: torch.dtype):
    """transformers' (1, heads, L, dim) -> the kernels' contiguous (L, heads, dim), in `dtype`."""
    return (tensor[0].transpose(0, 1).to(dtype).contiguous() for tensor in tensors)


def torch_varlen_arguments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_length: int, scaling: float | None, parameters: frozenset[str],
                           dtype: torch.dtype):  # fmt: skip
    """`(args, kwargs)` of a causal `varlen_attn` call for transformers' (1, heads, L, dim) query/key/value, given the
    installed `varlen_attn`'s parameter names. Its tensors are (L, heads, dim) in `dtype`; key/value heads are
    repeated (query head h reads key head h // groups, as transformers' `repeat_kv`) where it has no `enable_gqa`,
    and the query is scaled where it has no `scale`."""
    q, k, v = row_major((query, key, value), dtype)
    kwargs = {}
    groups = q.size(1) // k.size(1)
    if groups > 1:
        if "enable_gqa" in parameters:
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if "is_causal" in parameters:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)  # no limit to the left, nothing to the right: causal
    default = q.size(-1) ** -0.5
    if scaling is not None and scaling != default:
        if "scale" in parameters:
            kwargs["scale"] = scaling
        else:  # the kernel multiplies by its default scale: fold the ratio into the query
            q = q * (scaling / default)
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return (q, k, v, cu_seqlens, cu_seqlens, int(max_length), int(max_length)), kwargs


def flash_attn_arguments(query, key, value, cu_seqlens, max_length, scaling, dtype):
    """`(args, kwargs)` of a causal `flash_attn_varlen_func` call (it takes GQA and the scale itself)."""
    q, k, v = row_major((query, key, value), dtype)
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return (q, k, v, cu_seqlens, cu_seqlens, int(max_length), int(max_length)), dict(
        dropout_p=0.0, softmax_scale=scaling, causal=True
    )


def varlen_attention(kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cu_seqlens: torch.Tensor, max_length: int | None, scaling: float | None) -> torch.Tensor:  # fmt: skip
    """Run `kernel` over the packed row, in `compute_dtype`; returns (1, L, heads, dim), the layout transformers'
    attention functions return."""
    if max_length is None:
        max_length = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    dtype = compute_dtype(query)
    if kernel == "torch_varlen":
        function = torch_varlen()
        args, kwargs = torch_varlen_arguments(query, key, value, cu_seqlens, max_length, scaling,
                                              parameter_names(function), dtype)  # fmt: skip
    elif kernel == "flash_attn":
        function = flash_attn_varlen()
        args, kwargs = flash_attn_arguments(query, key, value, cu_seqlens, max_length, scaling, dtype)
    else:
        raise ValueError(f"varlen_attention: kernel must be one of {KERNELS[:2]}, not {kernel!r}")
    return function(*args, **kwargs).unsqueeze(0)
