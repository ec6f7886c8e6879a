"""dhpo_trl.training.teardown's steps, each in this process: which references to a process group each one drops, on
objects built here (DeepSpeed's modules stand in by their names), and the order `release_process_groups` runs them
in. `tests/test_teardown.py` checks the outcome on real gloo groups and a real ZeRO-3 engine, in child processes.
"""

import datetime
import gc
import io
import os
import sys
import time
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

from dhpo_trl.training import teardown


def group() -> dist.ProcessGroup:
    """A process group object of world size 1 that runs nothing (no backend, no threads)."""
    return dist.ProcessGroup(dist.HashStore(), 0, 1)


def deepspeed_class(module: str):
    """A class that reads as one of DeepSpeed's (its `__module__`), as `drop_deepspeed_group_references` selects."""
    return type("Runtime", (), {"__module__": module})


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """DeepSpeed's modules as the release looks them up in sys.modules: an engine class whose `destroy` is recorded,
    the ZeRO-3 forward module stack, and `deepspeed.comm` (uninitialised unless a test says otherwise)."""
    destroyed = []

    class DeepSpeedEngine:
        def destroy(self):
            destroyed.append(self)

    modules = {name: ModuleType(name) for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.engine",
                                                    "deepspeed.runtime.zero", "deepspeed.runtime.zero.parameter_offload",
                                                    "deepspeed.comm")}  # fmt: skip
    modules["deepspeed.runtime.engine"].DeepSpeedEngine = DeepSpeedEngine
    modules["deepspeed.runtime.zero.parameter_offload"].FWD_MODULE_STACK = [torch.nn.Linear(1, 1)]
    modules["deepspeed.comm"].is_initialized = lambda: False
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    modules["destroyed"] = destroyed
    return modules


def thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as handle:
                names.append(handle.read().strip())
        except OSError:
            continue
    return sorted(names)


def test_gloo_threads_lists_this_processs_threads_named_gloo():
    """Read independently from /proc: the names of this process's threads that contain "gloo", sorted, while a gloo
    group of this process runs its threads (its threads name themselves once started: compared between two equal
    readings)."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no /proc/self/task on this system")
    running = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    for _ in range(100):
        before, listed, after = thread_names(), teardown.gloo_threads(), thread_names()
        if before == after and any("gloo" in name for name in before):
            break
        time.sleep(0.05)
    assert any("gloo" in name for name in before)  # the group's threads run, so the comparison below can fail
    assert listed == [name for name in before if "gloo" in name]
    del running


def test_gloo_threads_reads_on_past_a_thread_that_ended_while_listed(monkeypatch):
    """A thread listed under /proc/self/task may end before its name is read: the others are still read."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no /proc/self/task on this system")
    tasks = ["1", "2", "3"]
    names = {"/proc/self/task/2/comm": "gone", "/proc/self/task/1/comm": "gloo_a", "/proc/self/task/3/comm": "gloo_b"}
    monkeypatch.setattr(teardown.os, "listdir", lambda path: ["2", *tasks[:1], *tasks[2:]])

    def fake_open(path, *args, **kwargs):
        if names[path] == "gone":
            raise FileNotFoundError(path)
        return io.StringIO(names[path] + "\n")

    monkeypatch.setattr(teardown, "open", fake_open, raising=False)
    assert teardown.gloo_threads() == ["gloo_a", "gloo_b"]


def test_forget_group_defaults_resets_positional_and_keyword_defaults_only_where_they_hold_a_group():
    world = group()

    def positional(a, group=world, other=5):
        return group

    def keyword(*, group=world, other=3):
        return group

    def both(a=world, b=world, *, c=world):
        return a

    def plain(a=1, *, b="two"):
        return a

    gc.collect()
    assert teardown.forget_group_defaults() == 5  # 1 + 1 + 3: each default that held the group
    assert positional.__defaults__ == (None, 5) and positional(0) is None
    assert keyword.__kwdefaults__ == {"group": None, "other": 3} and keyword() is None
    assert both.__defaults__ == (None, None) and both.__kwdefaults__ == {"c": None}
    assert plain.__defaults__ == (1,) and plain.__kwdefaults__ == {"b": "two"}
    assert teardown.forget_group_defaults() == 0  # nothing left to reset


def test_destroy_deepspeed_engines_destroys_every_engine_alive(fake_deepspeed):
    engine_class = fake_deepspeed["deepspeed.runtime.engine"].DeepSpeedEngine
    engines = [engine_class(), engine_class()]
    bystander = object()
    assert teardown.destroy_deepspeed_engines() == 2
    assert sorted(map(id, fake_deepspeed["destroyed"])) == sorted(map(id, engines))
    del bystander


def test_destroy_deepspeed_engines_does_nothing_without_deepspeed_loaded(monkeypatch):
    monkeypatch.delitem(sys.modules, "deepspeed.runtime.engine", raising=False)
    assert teardown.destroy_deepspeed_engines() == 0


def test_drop_deepspeed_group_references_drops_groups_from_deepspeeds_objects_and_partitioned_parameters(
        fake_deepspeed):  # fmt: skip
    runtime = deepspeed_class("deepspeed.runtime.zero.stage3")()
    shared = [group(), group()]
    runtime.dp_process_group, runtime.sub_groups, runtime.pair = group(), shared, (group(),)
    runtime.numbers, runtime.name = [1, 2], "stage3"
    elsewhere = deepspeed_class("deepspeed.utils.groups")()  # not a runtime object: left alone
    elsewhere.group = group()
    holder_class = deepspeed_class("deepspeed.runtime.engine")
    holder_class.group = group()  # a class attribute: the class is not an owner
    partitioned, plain = torch.zeros(2), torch.zeros(2)
    partitioned.ds_id, partitioned.ds_process_group = 7, group()
    plain.ds_process_group = group()  # no ds_id: not a partitioned parameter
    stack = fake_deepspeed["deepspeed.runtime.zero.parameter_offload"].FWD_MODULE_STACK

    assert teardown.drop_deepspeed_group_references() == 4  # three of the runtime object's, one of the parameter's
    assert vars(runtime) == {"numbers": [1, 2], "name": "stage3"}
    assert shared == []  # emptied in place: a closure holding the list sees no group either
    assert isinstance(elsewhere.group, dist.ProcessGroup) and isinstance(holder_class.group, dist.ProcessGroup)
    assert vars(partitioned) == {"ds_id": 7} and isinstance(plain.ds_process_group, dist.ProcessGroup)
    assert stack == []


def test_drop_deepspeed_group_references_passes_over_a_runtime_object_without_a_dict(fake_deepspeed):
    slotted_class = type("Slotted", (), {"__module__": "deepspeed.runtime.comm", "__slots__": ("group",)})
    slotted = slotted_class()
    slotted.group = group()
    runtime = deepspeed_class("deepspeed.runtime.zero.stage3")()
    runtime.group = group()
    assert teardown.drop_deepspeed_group_references() == 1  # the runtime object's; the slot is out of reach
    assert isinstance(slotted.group, dist.ProcessGroup) and vars(runtime) == {}


def test_drop_deepspeed_group_references_does_nothing_without_deepspeed_loaded(monkeypatch):
    monkeypatch.delitem(sys.modules, "deepspeed.runtime.engine", raising=False)
    runtime = deepspeed_class("deepspeed.runtime.zero.stage3")()
    runtime.group = group()
    assert teardown.drop_deepspeed_group_references() == 0
    assert isinstance(runtime.group, dist.ProcessGroup)


class Calls(list):
    def recorder(self, name, result=None):
        def record(*args, **kwargs):
            self.append(name)
            return result

        return record


@pytest.mark.parametrize(("world_size", "barrier", "waits"), [(2, True, True), (2, None, True), (2, False, False),
                                                               (1, True, False)])  # fmt: skip
@pytest.mark.parametrize("deepspeed_comm", [False, True])
def test_release_order_barrier_and_whose_destroy(fake_deepspeed, monkeypatch, world_size, barrier, waits,
                                                 deepspeed_comm):  # fmt: skip
    """Engines first, then the barrier (only when asked and with a peer), then the groups' destroy (DeepSpeed's where
    `deepspeed.comm` is initialised, so its references go too), then the references and defaults, then a collection."""
    calls = Calls()
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: world_size)
    monkeypatch.setattr(dist, "barrier", calls.recorder("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", calls.recorder("torch destroy"))
    comm = fake_deepspeed["deepspeed.comm"]
    comm.is_initialized = lambda: deepspeed_comm
    comm.destroy_process_group = calls.recorder("deepspeed destroy")
    for step in ("destroy_deepspeed_engines", "drop_deepspeed_group_references", "forget_group_defaults"):
        monkeypatch.setattr(teardown, step, calls.recorder(step, 0))
    monkeypatch.setattr(teardown.gc, "collect", calls.recorder("collect", 0))
    monkeypatch.setattr(teardown, "gloo_threads", lambda: ["left"])
    asked = {} if barrier is None else {"barrier": barrier}  # None: the default, which waits
    assert teardown.release_process_groups(**asked) == ["left"]
    destroy = "deepspeed destroy" if deepspeed_comm else "torch destroy"
    assert calls == ["destroy_deepspeed_engines", *(["barrier"] if waits else []), destroy,
                     "drop_deepspeed_group_references", "forget_group_defaults", "collect"]  # fmt: skip


def test_release_without_a_group_still_drops_references_and_defaults(fake_deepspeed, monkeypatch):
    calls = Calls()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "destroy_process_group", calls.recorder("torch destroy"))
    for step in ("destroy_deepspeed_engines", "drop_deepspeed_group_references", "forget_group_defaults"):
        monkeypatch.setattr(teardown, step, calls.recorder(step, 0))
    assert teardown.release_process_groups() == teardown.gloo_threads()
    assert calls == ["destroy_deepspeed_engines", "drop_deepspeed_group_references", "forget_group_defaults"]


def test_release_with_only_gloo_threads_left_still_releases(monkeypatch):
    """A group destroyed through torch alone but still referenced keeps its gloo threads, with no default group and no
    DeepSpeed loaded: the release still drops the references and defaults, and collects them."""
    calls = Calls()
    monkeypatch.delitem(sys.modules, "deepspeed.runtime.engine", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for step in ("destroy_deepspeed_engines", "drop_deepspeed_group_references", "forget_group_defaults"):
        monkeypatch.setattr(teardown, step, calls.recorder(step, 0))
    monkeypatch.setattr(teardown.gc, "collect", calls.recorder("collect", 0))
    threads = iter([["pt_gloo_runloop"], []])  # before the release; after its collection
    monkeypatch.setattr(teardown, "gloo_threads", lambda: next(threads))
    assert teardown.release_process_groups() == []
    assert calls == ["destroy_deepspeed_engines", "drop_deepspeed_group_references", "forget_group_defaults",
                     "collect"]  # fmt: skip
