"""The policy update's SDPA on CUDA without cuDNN's attention kernel (docs/cuda_attention.md).

Since torch 2.11, SDPA prefers cuDNN's attention on Hopper GPUs. Its backward returns NaN in the query gradient
when three things hold: an explicit attention mask, a sequence length of 64 modulo 128, and a query row whose
log-sum-exp is below -ln(FLT_MAX), about -88.7 - which every fully masked row (a left-padded prompt's padding) has
(pytorch/pytorch#196678, huggingface/trl#7181). One such micro-batch turns every parameter into NaN. TRL's padded
micro-batches hit it only when the generation batch's width happens to be 64 mod 128; dynamic batching trims each
micro-batch to its own width, so over a run some micro-batch almost surely is (the H100 benchmark of 2026-11-26 hit
it in its first micro-batch, of 192 columns).

The forward picks the kernel whose backward runs, so the training step's forwards run with cuDNN attention off:
flash attention where there is no mask, memory-efficient attention with one. The step holds the generation batch's
no-gradient passes too (generation and the old and reference log-probs, when the step fills TRL's buffer), so they
also run without cuDNN; passes outside a step (evaluation) keep SDPA's default. Only cuDNN's flag changes: a backend
the user turned off stays off.
"""

from __future__ import annotations

import contextlib

import torch
from packaging.version import Version
from torch.nn.attention import SDPBackend

FIRST_AFFECTED = Version("2.11")  # cuDNN attention became SDPA's first choice on Hopper (no fixed release known yet)
FLAGS = {SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
         SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
         SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
         SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled}  # fmt: skip


def enabled_backends() -> list[SDPBackend]:
    """The SDPA backends turned on now (`torch.backends.cuda.enable_*_sdp`)."""
    return [backend for backend, enabled in FLAGS.items() if enabled()]


def update_backends(device_type: str, torch_version: str, enabled: list[SDPBackend]) -> list[SDPBackend] | None:
    """The SDPA backends the policy update may use: `enabled` without cuDNN attention; None where nothing needs
    leaving out: not CUDA, a torch before the regression, or cuDNN attention already off. Refuses a setting with
    cuDNN attention the only backend on (the update would have none)."""
    if device_type != "cuda" or SDPBackend.CUDNN_ATTENTION not in enabled:
        return None
    if Version(Version(torch_version).base_version) < FIRST_AFFECTED:
        return None
    left = [backend for backend in enabled if backend != SDPBackend.CUDNN_ATTENTION]
    if not left:
        raise ValueError("torch.backends.cuda: cuDNN attention is the only SDPA backend on, and the policy update "
                         f"(torch {torch_version} on CUDA) must run without it (docs/cuda_attention.md): turn another "
                         "on, e.g. torch.backends.cuda.enable_mem_efficient_sdp(True)")  # fmt: skip
    return left


@contextlib.contextmanager
def without_cudnn():
    """cuDNN attention off inside, every other SDPA flag as it is; the previous flag back on exit, on error too."""
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)


def for_update(device_type: str):
    """`(context, note)`: a factory of the context each training step runs in, and the line saying what it leaves out
    (None when it leaves out nothing)."""
    backends = update_backends(device_type, torch.__version__, enabled_backends())
    if backends is None:
        return contextlib.nullcontext, None
    note = (f"dhpo_trl: each training step runs SDPA without cuDNN attention (torch {torch.__version__} on CUDA: NaN "
            "query gradients for masked rows of length 64 mod 128, pytorch/pytorch#196678; docs/cuda_attention.md)")
    return without_cudnn, note
