"""The policy update's SDPA on CUDA without cuDNN's attention kernel (docs/cuda_attention.md).

Since torch 2.11, SDPA prefers cuDNN's attention on Hopper GPUs. Its backward returns NaN in the query gradient
when three things hold: an explicit attention mask, a sequence length of 64 modulo 128, and a query row whose
log-sum-exp is below ln(FLT_MAX) - which every fully masked row (a left-padded prompt's padding) has
(pytorch/pytorch#196678, huggingface/trl#7181). One such micro-batch turns every parameter into NaN. TRL's padded
micro-batches hit it only when the generation batch's width happens to be 64 mod 128; dynamic batching trims each
micro-batch to its own width, so over a run some micro-batch almost surely is (the H100 benchmark of 2026-11-26 hit
it in its first micro-batch, of 192 columns).

The forward picks the kernel whose backward runs, so the policy forwards that take gradients run inside
`sdpa_kernel` with cuDNN left out: flash attention where there is no mask, memory-efficient attention with one.
No-gradient passes (old and reference log-probs, generation) keep cuDNN: its forward is correct.
"""

from __future__ import annotations

import contextlib

import torch
from packaging.version import Version
from torch.nn.attention import SDPBackend, sdpa_kernel

FIRST_AFFECTED = Version("2.11")  # cuDNN attention became SDPA's first choice on Hopper (no fixed release known yet)
WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def update_backends(device_type: str, torch_version: str, cudnn_enabled: bool) -> list[SDPBackend] | None:
    """The SDPA backends the policy update may use, or None where nothing needs leaving out: not CUDA, a torch
    before the regression, or cuDNN attention already turned off (`torch.backends.cuda.enable_cudnn_sdp(False)`)."""
    if device_type != "cuda" or not cudnn_enabled or Version(Version(torch_version).base_version) < FIRST_AFFECTED:
        return None
    return list(WITHOUT_CUDNN)


def for_update(device_type: str):
    """`(context, note)`: a factory of the context the policy's gradient forwards run in, and the line saying what it
    leaves out (None when it leaves out nothing)."""
    backends = update_backends(device_type, torch.__version__, torch.backends.cuda.cudnn_sdp_enabled())
    if backends is None:
        return contextlib.nullcontext, None
    note = (f"dhpo_trl: the policy update runs SDPA without cuDNN attention (torch {torch.__version__} on CUDA: NaN "
            "query gradients for masked rows of length 64 mod 128, pytorch/pytorch#196678; docs/cuda_attention.md)")
    return (lambda: sdpa_kernel(backends)), note
