"""Release every torch.distributed process group while the interpreter is still whole.

gloo runs each process group on threads of its own (a transport loop and `pt_gloo_runloop` workers) that stop only
when the group's C++ object is destroyed. `torch.distributed.destroy_process_group()` drops torch's own references
and nothing more; a group still referenced elsewhere lives on, and is destroyed during interpreter finalisation,
when its threads can no longer take the GIL: a finished two-process run then hangs (the main thread, holding the GIL,
joins a worker that waits for it) or aborts with "terminate called without an active exception" (SIGABRT,
pytorch/pytorch#179291). What outlives `destroy_process_group` after a DHPO run:
  - DeepSpeed's registry of groups (`deepspeed.utils.groups`, its clone of the world group under ZeRO): released by
    `deepspeed.comm.destroy_process_group`, which destroys through torch and then drops DeepSpeed's references;
  - default arguments `group=GroupMember.WORLD`, read when their module is imported: a module imported after the
    group was created keeps it in its functions' defaults (`deepspeed.comm.torch.TorchBackend.barrier`, imported
    lazily in every run where DeepSpeed is installed; `torch.distributed.nn.functional`): once every group is
    destroyed such a default is reset to None, the value `GroupMember.WORLD` holds again and that the function
    reads as the default group;
  - a DeepSpeed engine, whose ZeRO-3 optimizer hooks every parameter through autograd's C++ nodes (a cycle that a
    collection cannot break): `destroy()`ed first;
  - under ZeRO-3, the engine, its optimizer and the partitioned parameters even so: the model stays on DeepSpeed's
    module-level forward stack (`parameter_offload.FWD_MODULE_STACK`) and each partitioned parameter's attributes are
    invisible to the collector while autograd still holds the tensor, so the engine, the optimizer (its data-parallel
    and sub-group lists) and every parameter's `ds_process_group` outlive the release: once the groups are destroyed,
    their references in DeepSpeed's objects are dropped (`drop_deepspeed_group_references`) and the stack emptied;
  - the trainer, its DDP or DeepSpeed engine and their optimizer, in reference cycles: freed by a collection.
"""

from __future__ import annotations

import gc
import os
import sys
import types


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (Linux: /proc/self/task), empty where that is not readable."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as handle:
                name = handle.read().strip()
        except OSError:
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)


def release_process_groups(*, barrier: bool = True) -> list[str]:
    """Destroy the DeepSpeed engines still alive, wait for every process at a barrier (no peer is still inside a
    collective with this one), destroy every
    process group (DeepSpeed's through DeepSpeed, so that its references go too), then collect garbage so that the
    last references, held in cycles, go and gloo joins its threads now. Call it once the trainer is out of reach
    (after the function that held it has returned), on every process, after the last collective.

    `barrier=False` for a path where a peer may be gone (a failure). Returns the gloo threads still running (empty
    when everything was released); a non-empty list names a group that something else still holds."""
    import torch.distributed as dist

    if not holds_any_group(dist):
        return []  # nothing to release: the heap scans below cost seconds in a large process (an input error's exit)
    destroy_deepspeed_engines()
    if dist.is_available() and dist.is_initialized():
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
        deepspeed_comm = sys.modules.get("deepspeed.comm")
        if deepspeed_comm is not None and deepspeed_comm.is_initialized():
            deepspeed_comm.destroy_process_group()
        else:
            dist.destroy_process_group()
    drop_deepspeed_group_references()  # every group is destroyed by now: nothing may use them again
    forget_group_defaults()
    gc.collect()
    return gloo_threads()


def holds_any_group(dist) -> bool:
    """Whether this process may hold a process group or a DeepSpeed engine, from cheap checks only: the default group
    is initialized, DeepSpeed's engine module was imported (an engine may be alive, and with it its groups), or gloo
    threads run (a group destroyed through torch alone but still referenced keeps its threads). False means no group
    is alive to be released, so the release has nothing to do."""
    if dist.is_available() and dist.is_initialized():
        return True
    return "deepspeed.runtime.engine" in sys.modules or bool(gloo_threads())


def destroy_deepspeed_engines() -> int:
    """`destroy()` every DeepSpeed engine still alive; return how many. ZeRO-3 hooks its optimizer into every
    parameter's gradient accumulator, a cycle through autograd's C++ nodes that a collection does not free: the
    engine, its optimizer and the parameters (each holding its `ds_process_group`) would live on, and with them the
    groups. `destroy()` removes those hooks (accelerate's `free_memory` calls it too, for the engine it knows)."""
    if "deepspeed.runtime.engine" not in sys.modules:
        return 0
    from deepspeed.runtime.engine import DeepSpeedEngine

    engines = [engine for engine in gc.get_objects() if isinstance(engine, DeepSpeedEngine)]
    for engine in engines:
        engine.destroy()
    return len(engines)


def drop_deepspeed_group_references() -> int:
    """Drop every process group (and list of groups) that a DeepSpeed runtime object or a ZeRO-partitioned parameter
    holds as an attribute, and empty DeepSpeed's forward module stack; return how many references were dropped. Only
    after the groups are destroyed: DeepSpeed's objects cannot run a collective afterwards."""
    if "deepspeed.runtime.engine" not in sys.modules:
        return 0
    import torch
    from torch.distributed import ProcessGroup

    def holds_groups(value) -> bool:
        if isinstance(value, ProcessGroup):
            return True
        return isinstance(value, (list, tuple)) and any(isinstance(item, ProcessGroup) for item in value)

    dropped = 0
    for owner in gc.get_objects():
        if isinstance(owner, torch.Tensor):
            if "ds_id" not in getattr(owner, "__dict__", {}):
                continue
        elif isinstance(owner, type) or not str(type(owner).__module__).startswith("deepspeed.runtime."):
            continue
        attributes = getattr(owner, "__dict__", None)
        for name, value in list(attributes.items()) if isinstance(attributes, dict) else ():
            if holds_groups(value):
                if isinstance(value, list):  # a closure may share the list: emptied in place
                    value.clear()
                del attributes[name]
                dropped += 1
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None:  # the model of every ZeRO-3 engine, and submodules a forward left on it
        offload.FWD_MODULE_STACK.clear()
    return dropped


def forget_group_defaults() -> int:
    """Reset to None every function default that holds a process group (call it once every group is destroyed:
    a default then names a dead group); return how many defaults were reset."""
    from torch.distributed import ProcessGroup

    reset = 0
    for function in gc.get_objects():
        if not isinstance(function, types.FunctionType):
            continue
        defaults, keywords = function.__defaults__, function.__kwdefaults__
        if defaults and any(isinstance(value, ProcessGroup) for value in defaults):
            reset += sum(isinstance(value, ProcessGroup) for value in defaults)
            function.__defaults__ = tuple(None if isinstance(value, ProcessGroup) else value for value in defaults)
        if keywords and any(isinstance(value, ProcessGroup) for value in keywords.values()):
            reset += sum(isinstance(value, ProcessGroup) for value in keywords.values())
            function.__kwdefaults__ = {key: None if isinstance(value, ProcessGroup) else value
                                       for key, value in keywords.items()}  # fmt: skip
    return reset
