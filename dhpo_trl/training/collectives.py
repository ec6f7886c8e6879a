"""The cross-process reductions of the update: one all-reduce, and the agreements built on it.

Every process must reach each call with the same arguments' shapes (the callers build them from settings that are
the same on every process); with one process, or no process group, each is the identity.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

AllReduce = Callable[[torch.Tensor, str], torch.Tensor]
OPS = ("sum", "max")


def all_reduce(tensor: torch.Tensor, op: str, device, num_processes: int) -> torch.Tensor:
    """The element-wise "sum" or "max" of `tensor` over processes, on `device` (one collective). Another `op` is
    refused on one process too, so a caller's typo fails in the first test rather than on a cluster."""
    if op not in OPS:
        raise ValueError(f"collectives.all_reduce: op must be one of {OPS}, got {op!r}")
    if num_processes == 1 or not (dist.is_available() and dist.is_initialized()):
        return tensor
    tensor = tensor.to(device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def max_over_processes(values: list[int], reduce: AllReduce) -> list[int]:
    """The element-wise maximum of a list of ints over processes: how every process agrees on a number of forward
    passes (ZeRO-3 gathers parameters inside every forward, DDP syncs buffers)."""
    if not values:
        return []
    return [int(value) for value in reduce(torch.tensor([float(v) for v in values]), "max").tolist()]


def any_process(flag: bool, reduce: AllReduce) -> bool:
    """True on every process if `flag` is True on any."""
    return bool(reduce(torch.tensor([1.0 if flag else 0.0]), "max").item() > 0)
