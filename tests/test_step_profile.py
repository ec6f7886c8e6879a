"""dhpo_trl/training/step_profile.py: per micro-step figures from profiler events, on synthetic event lists of
different forms (host only; host and device with overlapping streams, work outside the marked ranges and device
annotations; torch.profiler-like objects), and end to end through torch.profiler on a CPU.
"""

from types import SimpleNamespace

import pytest
import torch

from dhpo_trl.training import step_profile

MARK = "step"


def host(name, start, end):
    return {"name": name, "device": False, "start": start, "end": end, "annotation": False}


def device(name, start, end, annotation=False):
    return {"name": name, "device": True, "start": start, "end": end, "annotation": annotation}


def test_a_cpu_profile_counts_operators_and_scalar_reads_per_micro_step():
    """Two micro-steps of 100 and 300 us with a 600 us gap between them: wall is what the ranges hold (200 us a
    micro-step), not the span; an operator before the first range is not counted."""
    events = [
        host(MARK, 0, 100),
        host(MARK, 700, 1000),
        host("aten::mm", 10, 60),
        host("aten::add", 20, 30),  # nested in mm: counted, time once
        host("aten::_local_scalar_dense", 70, 80),
        host("aten::item", 69, 81),
        host("aten::mm", 710, 910),
        host("aten::_scaled_dot_product_flash_attention_for_cpu", 920, 980),
        host("aten::mm", -50, -10),
        host("aten::_local_scalar_dense", 400, 410),
    ]  # outside both ranges
    summary = step_profile.summarise(events, MARK, cuda=False)
    assert summary["micro_steps"] == 2 and summary["wall_seconds_per_micro_step"] == pytest.approx(200e-6)
    assert summary["aten_ops_per_micro_step"] == 6 / 2  # mm, add, scalar, item; mm, attention
    assert summary["synchronisations_per_micro_step"] == summary["local_scalar_reads_per_micro_step"] == 0.5
    assert summary["kernel_launches_per_micro_step"] == summary["device_kernels_per_micro_step"] == 0
    assert summary["device_busy_fraction"] is None and summary["host_waiting_fraction"] is None
    assert summary["host_in_operators_fraction"] == pytest.approx((50 + 12 + 200 + 60) / 400)
    assert summary["attention_host_fraction"] == pytest.approx(60 / 400)
    assert summary["attention_host_seconds_per_micro_step"] == pytest.approx(30e-6)
    assert step_profile.summarise(events[2:], MARK, cuda=False) is None  # nothing marked


def test_a_cuda_profile_counts_launches_synchronisations_and_device_busy_time():
    """Device work on two overlapping streams counts once; a kernel that ran on past the range's end counts only
    inside it; kernels outside every range and the ranges' own device annotations do not count."""
    events = [host(MARK, 0, 1000), host(MARK, 2000, 3000), device(MARK, 0, 1000, annotation=True),
              device("gpu_user_annotation", 2000, 3000, annotation=True),
              host("aten::mm", 10, 100), host("cudaLaunchKernel", 20, 30), host("cuLaunchKernel", 40, 45),
              host("aten::_local_scalar_dense", 110, 300), host("cudaMemcpyAsync", 120, 290),
              host("cudaStreamSynchronize", 130, 290), host("cudaDeviceSynchronize", 2950, 2999),
              host("cudaLaunchKernelExC", 2010, 2020),
              device("sm90_gemm", 100, 400), device("other_stream_kernel", 300, 500),  # union 100-500
              device("Memcpy DtoH (Device -> Pageable)", 500, 520),
              device("late_kernel", 2900, 3100),  # 100 us of it inside the second range
              device("between_steps", 1200, 1800)]  # fmt: skip
    summary = step_profile.summarise(events, MARK, cuda=True)
    assert summary["micro_steps"] == 2
    assert summary["kernel_launches_per_micro_step"] == 3 / 2
    assert summary["device_kernels_per_micro_step"] == 4 / 2  # gemm, other stream, memcpy, late kernel
    assert summary["synchronisations_per_micro_step"] == 2 / 2  # the runtime's: stream and device
    assert summary["local_scalar_reads_per_micro_step"] == 1 / 2
    assert summary["device_busy_fraction"] == pytest.approx((400 + 20 + 100) / 2000)
    assert summary["host_in_operators_fraction"] == pytest.approx((90 + 190) / 2000)
    assert summary["host_waiting_fraction"] == pytest.approx((160 + 49) / 2000)  # the two syncs, not the copy


def test_records_read_torch_profiler_events():
    """`records` takes what `profile.events()` gives: names, a device type, a time range and the annotation flag
    (absent on older events)."""
    cpu, cuda = SimpleNamespace(name="CPU"), SimpleNamespace(name="CUDA")
    events = [SimpleNamespace(name=MARK, device_type=cpu, time_range=SimpleNamespace(start=5, end=25)),
              SimpleNamespace(name="k", device_type=cuda, time_range=SimpleNamespace(start=6, end=16),
                              is_user_annotation=False),
              SimpleNamespace(name=MARK, device_type=cuda, time_range=SimpleNamespace(start=5, end=25),
                              is_user_annotation=True)]  # fmt: skip
    found = step_profile.records(events)
    assert [(r["device"], r["annotation"]) for r in found] == [(False, False), (True, False), (True, True)]
    assert step_profile.summarise(found, MARK, cuda=True)["device_busy_fraction"] == pytest.approx(0.5)
    for event in events:  # a device type given as its name, not an enum with `.name`
        event.device_type = event.device_type.name.lower() if event.name == "k" else event.device_type.name
    assert step_profile.records(events) == found


def test_a_real_cpu_profile_counts_what_each_micro_step_ran():
    """torch.profiler end to end: micro-step k runs k + 1 cosines and reads k + 1 scalars, each inside its marked
    range; the work between ranges is not counted."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        x = torch.ones(4)
        for k in range(3):
            with torch.profiler.record_function(MARK):
                for _ in range(k + 1):
                    x.cos().sum().item()
            x.sin()  # between micro-steps
    events = step_profile.records(profiler.events())
    summary = step_profile.summarise(events, MARK, cuda=False)
    cosines = [e for e in events if e["name"] == "aten::cos"]
    assert summary["micro_steps"] == 3 and len(cosines) == 6
    assert summary["local_scalar_reads_per_micro_step"] == summary["synchronisations_per_micro_step"] == 6 / 3
    assert summary["aten_ops_per_micro_step"] >= 3 * 6 / 3  # cos, sum, item at least; no sin
    assert 0 < summary["host_in_operators_fraction"] <= 1 and summary["wall_seconds_per_micro_step"] > 0


def test_runtime_calls_count_under_every_name_cupti_gives_them():
    """CUPTI's callback names with their API version (`cudaLaunchKernel_v7000`, as Nsight keeps them) and a
    per-thread-stream build's `_ptsz` count as the plain calls; a launch of a host function is no kernel launch."""
    events = [host(MARK, 0, 100), device("kernel_a", 10, 20), device("kernel_b", 30, 40),
              host("cudaLaunchKernel_v7000", 1, 2), host("cudaLaunchKernel_ptsz_v7000", 3, 4),
              host("cuLaunchKernelEx", 5, 6), host("cudaLaunchHostFunc_v10000", 7, 8),
              host("cudaStreamSynchronize_v3020", 50, 60), host("cudaEventSynchronize_ptsz", 61, 62),
              host("cudaMemcpyAsync_v3020", 63, 64)]  # fmt: skip
    summary = step_profile.summarise(events, MARK, cuda=True)
    assert summary["kernel_launches_per_micro_step"] == 3 and summary["synchronisations_per_micro_step"] == 2


def test_kernels_without_a_recognised_launch_give_no_launch_count():
    """On CUDA, kernels on the device and no launch call recognised means the runtime's names were not these: the
    count is unknown (None), not 0 launches. With no kernels either, 0 is a count."""
    events = [host(MARK, 0, 100), device("kernel", 10, 20), host("cudaLaunchSomethingNew", 1, 2)]
    assert step_profile.summarise(events, MARK, cuda=True)["kernel_launches_per_micro_step"] is None
    assert step_profile.summarise(events[:1] + events[2:], MARK, cuda=True)["kernel_launches_per_micro_step"] == 0


def test_records_leave_out_device_records_that_are_no_device_work():
    """Kineto's activity types (torch's `FunctionEvent.activity_type`): a range's span on the device (the marked
    range's and a range inside it, under the spelling older kineto gives it) without the annotation flag, and the
    CUDA sync events
    (`enable_cuda_sync_events`: `Context Sync` spans the host's wait) are no device work; kernels and copies are."""
    cpu, cuda = SimpleNamespace(name="CPU"), SimpleNamespace(name="CUDA")

    def event(name, device_type, start, end, activity):
        return SimpleNamespace(name=name, device_type=device_type, activity_type=activity,
                               time_range=SimpleNamespace(start=start, end=end))  # fmt: skip

    events = [event(MARK, cpu, 0, 100, "user_annotation"), event(MARK, cuda, 0, 100, "gpu_user_annotation"),
              event("inner range", cpu, 5, 95, "user_annotation"),
              event("inner range", cuda, 5, 95, "gpu_user_Annotation"),
              event("Context Sync", cuda, 10, 90, "cuda_sync"), event("gemm", cuda, 20, 30, "kernel"),
              event("Memcpy DtoH (Device -> Pageable)", cuda, 40, 45, "gpu_memcpy"),
              event("Memset (Device)", cuda, 50, 55, "gpu_memset")]  # fmt: skip
    summary = step_profile.summarise(step_profile.records(events), MARK, cuda=True)
    assert summary["device_kernels_per_micro_step"] == 3
    assert summary["device_busy_fraction"] == pytest.approx((10 + 5 + 5) / 100)


def test_events_that_touch_a_range_at_its_ends_are_outside_it():
    """A range is [start, end): an operator that starts as the range ends belongs to none, and a kernel that ends as
    a range starts, or starts as it ends, ran in no micro-step; the ones that overlap it by any time are counted."""
    events = [host(MARK, 100, 200), host("aten::mm", 200, 250), host("aten::add", 199, 210),
              device("before", 50, 100), device("after", 200, 260), device("inside_from_before", 99, 101),
              device("inside_to_after", 199, 201)]  # fmt: skip
    summary = step_profile.summarise(events, MARK, cuda=True)
    assert summary["aten_ops_per_micro_step"] == 1  # add, not mm
    assert summary["device_kernels_per_micro_step"] == 2
    assert summary["device_busy_fraction"] == pytest.approx(2 / 100)
    assert step_profile.clip([(50, 100), (200, 260)], [(100, 200), (300, 400)]) == []


@pytest.mark.parametrize("wall", [0.0, 0.25])
def test_a_zero_or_sub_microsecond_range_gives_its_figures(wall):
    """Ranges of no measured length (the clock's resolution) give no fraction instead of a division by zero; a
    sub-microsecond one (the profiler's times are float microseconds) gives every fraction; seconds are the
    microseconds over 10**6 exactly."""
    events = [host(MARK, 10, 10 + wall), host(MARK, 20, 20 + wall), device("kernel", 10, 10 + wall),
              host("aten::_scaled_dot_product_attention", 10, 10 + wall), host("cudaStreamSynchronize", 20, 20 + wall / 2)]  # fmt: skip
    summary = step_profile.summarise(events, MARK, cuda=True)
    fractions = ["device_busy_fraction", "host_in_operators_fraction", "host_waiting_fraction",
                 "attention_host_fraction"]  # fmt: skip
    if wall == 0:
        assert [summary[name] for name in fractions] == [None] * 4, summary
    else:
        assert [summary[name] for name in fractions] == pytest.approx([0.5, 0.5, 0.25, 0.5], rel=1e-12), summary
    assert summary["wall_seconds_per_micro_step"] == pytest.approx(wall / 10**6, rel=1e-12, abs=0)
    assert summary["attention_host_seconds_per_micro_step"] == pytest.approx(wall / 2 / 10**6, rel=1e-12, abs=0)
