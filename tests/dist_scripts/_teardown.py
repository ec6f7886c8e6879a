"""Shared exit step of the torchrun scripts in this folder."""

import torch


def destroy_process_group() -> None:
    """Destroy the default process group before the interpreter exits.

    Left to interpreter finalisation, gloo's worker threads can abort the process ("terminate called without an active
    exception", SIGABRT) after all the work is done and written (pytorch/pytorch#179291); CI saw it once on rank 1.
    """
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
