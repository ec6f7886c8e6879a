"""dhpo_trl.training.teardown: after `release_process_groups` no gloo thread is left to interpreter finalisation.

Each case runs in a fresh interpreter (a group of its own, world size 1, file store): the pytest process may hold
groups and imports of its own. The child prints the gloo threads before and after, as JSON.
"""

import json
import os
import sys
from pathlib import Path

import processes
import pytest

REPO = Path(__file__).parent.parent
ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

# A DDP-wrapped model held in a reference cycle, and a function whose default argument reads the default group when it is defined, after
# init_process_group, as `deepspeed.comm.torch.TorchBackend.barrier` does when DeepSpeed is imported lazily.
CHILD = """
import json, sys, tempfile
import torch, torch.distributed as dist
from dhpo_trl.training import teardown

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
model(torch.ones(1, 2)).sum().backward()
if "capture" in sys.argv:
    def barrier(group=dist.group.WORLD):
        return group
before = teardown.gloo_threads()
trainer = {"model": model}
trainer["self"] = trainer  # held in a cycle, as a trainer holds its model: only a collection frees it
del model, trainer
if "torch-only" in sys.argv:
    dist.destroy_process_group()
    import gc
    gc.collect()
    after = teardown.gloo_threads()
else:
    after = teardown.release_process_groups()
print(json.dumps({"before": before, "after": after, "initialized": dist.is_initialized(),
                  "default": barrier.__defaults__[0] is None if "capture" in sys.argv else None}))
"""


def _child(*flags):
    result = processes.run([sys.executable, "-c", CHILD, *flags], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("flags", [(), ("capture",)], ids=["ddp", "ddp-and-a-captured-default"])
def test_release_leaves_no_gloo_thread(flags):
    seen = _child(*flags)
    assert "pt_gloo_runloop" in seen["before"]  # the group ran threads, so the check below can fail
    assert seen["after"] == [] and seen["initialized"] is False
    if "capture" in flags:
        assert seen["default"] is True  # the captured default reads as the default group again


def test_destroy_alone_leaves_the_captured_group_running():
    """What the release adds: torch's destroy drops torch's references only; the default argument keeps the group,
    and its threads, alive for interpreter finalisation."""
    seen = _child("capture", "torch-only")
    assert "pt_gloo_runloop" in seen["after"]


@pytest.mark.parametrize("keep", [False, True], ids=["release", "without-dropping-deepspeeds-references"])
def test_a_zero3_run_leaves_no_gloo_thread(keep, tmp_path):
    """A DHPO run under ZeRO-3 (one process, DeepSpeed's CPU accelerator): after the release no gloo thread is left.
    Without dropping DeepSpeed's references, the destroyed engine's optimizer, its partitioned parameters and the
    forward module stack keep the groups, and their threads, for interpreter finalisation: the check can fail."""
    pytest.importorskip("deepspeed")
    script = Path(__file__).parent / "dist_scripts" / "teardown_zero3.py"
    flags = ["--keep-deepspeed-references"] if keep else []
    result = processes.torchrun(script, tmp_path, *flags, timeout=300, accelerate_cpu=False, nproc=1, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    threads = json.loads((tmp_path / "rank0.json").read_text())["threads"]
    assert ("pt_gloo_runloop" in threads) is keep, threads
