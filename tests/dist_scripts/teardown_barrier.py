"""Run under `torchrun --nproc_per_node 2` (gloo, CPU): when each rank enters and leaves `release_process_groups`.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/teardown_barrier.py OUT_DIR

After one all-reduce, rank 1 waits DELAY_S seconds before it releases (a slower rank still finishing its last
step). Each rank writes OUT_DIR/rank{r}.json: the wall-clock times it entered the release, destroyed its process
group (recorded around `torch.distributed.destroy_process_group`) and left the release, and the gloo threads left
afterwards.
"""

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# From its file: the package's __init__ imports TRL and transformers, which the release does not need.
_spec = importlib.util.spec_from_file_location("teardown", Path(__file__).parents[2] / "dhpo_trl/training/teardown.py")
_teardown = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_teardown)
release_process_groups = _teardown.release_process_groups

DELAY_S = 2.0

destroyed = []
_destroy = dist.destroy_process_group


def recording_destroy(*args, **kwargs):
    destroyed.append(time.time())
    return _destroy(*args, **kwargs)


if __name__ == "__main__":
    dist.destroy_process_group = recording_destroy
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    if rank == 1:
        time.sleep(DELAY_S)
    entered = time.time()
    left_threads = release_process_groups()
    record = {"entered": entered, "destroyed": destroyed, "left": time.time(), "sum": float(total), "threads": left_threads,
              "initialized": dist.is_initialized()}  # fmt: skip
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(record))
