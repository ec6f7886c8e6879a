"""The two-process launches' process group, with a short limit on each collective.

transformers hands `ddp_timeout` to the process group only off the CPU: with `use_cpu` (every launch of the suite)
it builds accelerate's state without it, and gloo then waits torch's default 30 minutes in a collective that the
other rank never joins. A launch calls `start(seconds)` before its trainer's config: accelerate keeps a process group
that already exists, so a rank blocked by an unagreed collective raises after `seconds` and the launch fails, instead
of hanging until the test's deadline.
"""

from datetime import timedelta

import torch.distributed as dist


def start(seconds: float) -> None:
    """The default process group (gloo, from torchrun's environment), each collective limited to `seconds`."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=seconds))
