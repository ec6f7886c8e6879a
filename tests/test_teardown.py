"""dhpo_trl.training.teardown: after `release_process_groups` no gloo thread is left to interpreter finalisation.

Each case runs in a fresh interpreter (a group of its own, world size 1, file store): the pytest process may hold
groups and imports of its own. The child prints the gloo threads before and after, as JSON. The children without
DeepSpeed load `dhpo_trl/training/teardown.py` from its file (it imports the standard library and torch only): the
package's `__init__` would import TRL and transformers, seconds of start-up that the release never touches.
"""

import json
import os
import sys
from pathlib import Path

import processes
import pytest

REPO = Path(__file__).parent.parent
TEARDOWN = REPO / "dhpo_trl" / "training" / "teardown.py"
ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

# A DDP-wrapped model held in a reference cycle, and a function whose default argument reads the default group when it is defined, after
# init_process_group, as `deepspeed.comm.torch.TorchBackend.barrier` does when DeepSpeed is imported lazily.
CHILD = """
import importlib.util, json, sys, tempfile
import torch, torch.distributed as dist
spec = importlib.util.spec_from_file_location("teardown", sys.argv[1])
teardown = importlib.util.module_from_spec(spec)
spec.loader.exec_module(teardown)

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
    result = processes.run([sys.executable, "-c", CHILD, str(TEARDOWN), *flags], timeout=120)
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


# A ZeRO-3 engine after one step (world size 1): its hooks on the module and the parameters' gradient accumulators.
DEEPSPEED_CHILD = """
import gc, json, os, tempfile
import torch, torch.distributed as dist
from dhpo_trl.demo.tiny import use_deepspeed_on_cpu
from dhpo_trl.training import teardown

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
use_deepspeed_on_cpu()
os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
import deepspeed

def hooks(module):  # ZeRO-3's (gathering and releasing parameters); the engine's own two stay with the module
    found = [h for m in module.modules() for h in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]]
    return sum(not getattr(h, "__qualname__", "").startswith("DeepSpeedEngine.") for h in found)

layer = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "zero_allow_untested_optimizer": True}  # a torch optimizer, as the trainer's optim="sgd"
engine = deepspeed.initialize(model=layer, optimizer=torch.optim.SGD(layer.parameters(), lr=0.1), config=config)[0]
engine.backward(engine(torch.ones(1, 2)).sum())
engine.step()
before = hooks(layer)
del engine
gc.collect()
teardown.release_process_groups()
print(json.dumps({"before": before, "after": hooks(layer), "initialized": dist.is_initialized()}))
"""


@pytest.mark.parametrize("heap", ["new-interpreter", "forked-rank"])
def test_release_destroys_every_deepspeed_engine(heap, tmp_path):
    """An engine still alive at the release (a trainer in a reference cycle) is destroyed: ZeRO-3's hooks on the
    module go, and with them the cycle through autograd that keeps the engine, its optimizer and their groups; also
    in a forked rank (`processes.forked_ranks`, one rank), whose preloaded imports are frozen (the engine is built
    afterwards, as in a rank)."""
    pytest.importorskip("deepspeed")
    if heap == "forked-rank":
        child = tmp_path / "child.py"
        child.write_text(DEEPSPEED_CHILD)
        result = processes.forked_ranks(child, timeout=180, accelerate_cpu=False, nproc=1)
    else:
        result = processes.run([sys.executable, "-c", DEEPSPEED_CHILD], timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["before"] > 0  # ZeRO-3 hooked the module, so the check below can fail
    assert seen["after"] == 0 and seen["initialized"] is False


def test_two_processes_release_no_rank_before_every_rank_has_entered(tmp_path):
    """The barrier: a rank that finished first waits in the release for the slower one (rank 1 enters 2 s late), so
    no rank destroys its groups while a peer may still be in a collective with it."""
    script = Path(__file__).parent / "dist_scripts" / "teardown_barrier.py"
    result = processes.torchrun(script, tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["sum"] == ranks[1]["sum"] == 3.0  # the group worked before the release
    assert ranks[1]["entered"] - ranks[0]["entered"] > 1.0  # rank 1 did enter late, so the check below can fail
    for seen in ranks:
        assert len(seen["destroyed"]) == 1 and seen["destroyed"][0] >= max(r["entered"] for r in ranks)
        assert seen["threads"] == [] and seen["initialized"] is False


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


def test_release_in_a_process_that_holds_no_group_scans_nothing(monkeypatch):
    """An exit that never created a group (an input error) skips the heap scans, seconds in a large process: with the
    collector's scans made to fail, the release still returns no thread."""
    import gc

    import torch.distributed as dist

    from dhpo_trl.training import teardown

    if dist.is_initialized() or teardown.gloo_threads():
        pytest.skip("this pytest process holds a group of its own")
    monkeypatch.delitem(sys.modules, "deepspeed.runtime.engine", raising=False)

    def scan(*args, **kwargs):
        raise AssertionError("the release scanned the heap with no group to release")

    monkeypatch.setattr(gc, "get_objects", scan)
    monkeypatch.setattr(gc, "collect", scan)
    assert teardown.release_process_groups() == []
