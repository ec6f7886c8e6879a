"""dhpo_trl.training.teardown: after `release_process_groups` no gloo thread is left to interpreter finalisation.

Each case runs in a fresh interpreter (a group of its own, world size 1, file store): the pytest process may hold
groups and imports of its own. The child prints the gloo threads before and after, as JSON.
"""

import json
import sys

import processes
import pytest

# A DDP-wrapped model held in a reference cycle, and a function whose default argument reads the default group when it is defined, after
# init_process_group, as `deepspeed.comm.torch.TorchBackend.barrier` does when DeepSpeed is imported lazily.
CHILD = """
import json, sys, tempfile
import torch, torch.distributed as dist
from dhpo_trl.training import teardown

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
if "zero3" in sys.argv:  # a ZeRO-3 engine after a step, as the trainer leaves it (a torch optimizer: optim="sgd")
    from dhpo_trl.demo.tiny import use_deepspeed_on_cpu
    use_deepspeed_on_cpu()
    import os
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    import deepspeed
    layer = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model = deepspeed.initialize(model=layer, optimizer=torch.optim.SGD(layer.parameters(), lr=0.1), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True})[0]
    del layer
    model.backward(model(torch.ones(1, 2)).sum())
    model.step()
    if "keep-deepspeed-references" in sys.argv:  # what the release does without dropping DeepSpeed's references
        teardown.drop_deepspeed_group_references = lambda: 0
else:
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


@pytest.mark.parametrize("flags", [(), ("capture",), ("zero3",)], ids=["ddp", "ddp-and-a-captured-default", "zero3"])
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


def test_a_zero3_engine_keeps_its_groups_without_dropping_deepspeeds_references():
    """What dropping DeepSpeed's references adds under ZeRO-3: destroyed engine and all, its optimizer and partitioned
    parameters still hold the groups, whose threads then run into interpreter finalisation."""
    pytest.importorskip("deepspeed")
    seen = _child("zero3", "keep-deepspeed-references")
    assert "pt_gloo_runloop" in seen["after"] and seen["initialized"] is False
