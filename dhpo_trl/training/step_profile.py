"""Where a profiled training micro-step's time goes, from torch.profiler's events, as pure functions.

`records(profiler.events())` turns torch.profiler's events into plain records (name, host or device side, start and
end in microseconds on the profiler's one clock); `summarise(records, marker)` reads the micro-steps a
`torch.profiler.record_function(marker)` range wraps and returns per micro-step figures:

* wall seconds (the marked ranges' own time: what runs between micro-steps is not counted);
* aten operator events (nested calls counted each: what the dispatcher runs), kernel launches (the CUDA runtime's
  and driver's launch calls; None on CUDA where the device ran kernels and no launch call was recognised, rather
  than a count of 0) and device activities (kernels, copies, sets);
* host-device synchronisations: on CUDA the runtime's synchronising calls, on a CPU `aten::_local_scalar_dense`
  (every `.item()` and tensor-to-Python read, where a GPU would wait); that count is reported on both;
* the device-busy fraction on CUDA: the union of device activity (kernels, copies, sets) inside the marked ranges
  over their wall time, and the host-waiting fraction: the union of the synchronising calls over the wall time (the
  host blocked on the device, inside `.item()`'s operator or not). A low busy fraction with the host in operators
  most of the wall time and seldom waiting says the step waits on the host (launch overhead); the attention
  operators' host share says how much of that is attention, where a per-shape cost (cuDNN's execution plans) shows.

A host event belongs to the micro-step in whose range it starts; device activity counts where it overlaps a range.
"""

from __future__ import annotations

import bisect
import re

# What the CUDA runtime and driver call to start a kernel (a CUDA graph launches many at once: counted once).
LAUNCHES = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                      "cudaLaunchCooperativeKernel", "cudaGraphLaunch"})  # fmt: skip
# Runtime calls that block the host until the device catches up (`cudaMemcpy` without Async is synchronous).
SYNCHRONISATIONS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"})
LOCAL_SCALAR = "aten::_local_scalar_dense"
# CUPTI's callback names carry the API version (`cudaLaunchKernel_v7000`, which kineto strips and Nsight keeps) and,
# in a build for per-thread default streams, `_ptsz`/`_ptds`: matched without them, so no build counts 0 calls.
API_SUFFIX = re.compile(r"(?:_ptsz|_ptds)?(?:_v\d+)?$")
# Kineto's activity types of device-side records that are no device work: a range's span on the device (user
# annotations), the host's waits drawn on the device's timeline (`enable_cuda_sync_events`), profiler ranges.
NOT_DEVICE_WORK = frozenset({"gpu_user_annotation", "cuda_sync", "cuda_profiler_range"})


def api_name(name: str) -> str:
    """A CUDA runtime or driver call's name without its version and per-thread-stream suffixes."""
    return API_SUFFIX.sub("", name, count=1)


def records(events) -> list[dict]:
    """torch.profiler's `FunctionEvent`s (`profile.events()`) as plain records: name, host or device side, start and
    end, and whether a device-side record is no device work (a `record_function` range's span on the device, a
    synchronisation event), by the user-annotation flag and kineto's activity type where the event has them."""
    out = []
    for event in events:
        device = str(getattr(event.device_type, "name", event.device_type)).upper() != "CPU"
        activity = str(getattr(event, "activity_type", None) or "").lower()  # older kineto: "gpu_user_Annotation"
        annotation = bool(getattr(event, "is_user_annotation", False)) or activity in NOT_DEVICE_WORK
        out.append({"name": event.name, "device": device, "start": float(event.time_range.start),
                    "end": float(event.time_range.end), "annotation": annotation})  # fmt: skip
    return out


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: overlapping activity (two streams, nested calls) once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def clip(intervals, windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of `intervals` inside the sorted, disjoint `windows`."""
    out = []
    for start, end in intervals:
        for low, high in windows[max(0, bisect.bisect_right(windows, (start, float("inf"))) - 1) :]:
            if low >= end:
                break
            if high > start:
                out.append((max(start, low), min(end, high)))
    return out


def is_attention(name: str) -> bool:
    """An attention operator, forward or backward: SDPA and each of its kernels' ops, the flash/varlen ops."""
    return name.startswith("aten::") and "attention" in name


def summarise(events: list[dict], marker: str, cuda: bool) -> dict | None:
    """Per micro-step figures of the micro-steps marked `marker` (None when no range is marked)."""
    windows = sorted((e["start"], e["end"]) for e in events if e["name"] == marker and not e["device"])
    if not windows:
        return None
    starts = [start for start, _ in windows]

    def inside(event) -> bool:
        index = bisect.bisect_right(starts, event["start"]) - 1
        return index >= 0 and event["start"] < windows[index][1]

    host = [e for e in events if not e["device"] and e["name"] != marker and inside(e)]
    device = [(e["start"], e["end"]) for e in events if e["device"] and not e["annotation"] and e["name"] != marker]
    device = [interval for interval in device if clip([interval], windows)]  # overlapping a micro-step
    wall = sum(end - start for start, end in windows)  # microseconds
    steps = len(windows)
    aten = clip([(e["start"], e["end"]) for e in host if e["name"].startswith("aten::")], windows)
    attention = clip([(e["start"], e["end"]) for e in host if is_attention(e["name"])], windows)
    local_scalar = sum(e["name"] == LOCAL_SCALAR for e in host)
    calls = [api_name(e["name"]) for e in host]
    waits = clip([(e["start"], e["end"]) for e, name in zip(host, calls) if name in SYNCHRONISATIONS], windows)
    synchronisations = sum(name in SYNCHRONISATIONS for name in calls) if cuda else local_scalar
    launches = sum(name in LAUNCHES for name in calls)
    busy = union_length(clip(device, windows)) / wall if cuda and wall > 0 else None
    return {
        "micro_steps": steps,
        "wall_seconds_per_micro_step": wall / steps / 1e6,
        "aten_ops_per_micro_step": sum(e["name"].startswith("aten::") for e in host) / steps,
        # kernels ran and no launch call was recognised: the runtime's names are not these, not 0 launches
        "kernel_launches_per_micro_step": None if cuda and device and not launches else launches / steps,
        "device_kernels_per_micro_step": len(device) / steps,
        "synchronisations_per_micro_step": synchronisations / steps,
        "local_scalar_reads_per_micro_step": local_scalar / steps,
        "device_busy_fraction": busy,
        "host_in_operators_fraction": union_length(aten) / wall if wall > 0 else None,
        "host_waiting_fraction": union_length(waits) / wall if cuda and wall > 0 else None,
        "attention_host_fraction": union_length(attention) / wall if wall > 0 else None,
        "attention_host_seconds_per_micro_step": union_length(attention) / steps / 1e6,
    }
