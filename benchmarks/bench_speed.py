"""Step time and peak memory of DHPO-E against TRL's GRPO on the same model, data and seed, in one process.

Three arms: TRL's `GRPOTrainer` (GRPO); `DHPOTrainer` with DHPO-E on TRL's own micro-batches (`padding_free=False,
dynamic_batching=False`), whose ratio to GRPO is the cost of the loss alone; and DHPO-E on the update path the
automatic settings choose for the device (named in the output), which is what a user gets. Every arm runs the same
number of optimizer steps on a locally built Qwen3 (hidden 256, 4 layers by default, 64-token completions), one
after the other. Each block of three repetitions puts every arm at every place in the order once, and every other
block runs the reversed orders, so that drift in machine load cancels over a block and each arm follows each other
arm equally often over two (`--repeats` is a multiple of 3; 6 by default). Only training steps that do not generate
are timed (TRL samples at the first step of each generation batch; the other `steps_per_generation - 1` steps are
pure forward + backward on an old batch), so the figure is the cost of the loss, not of sampling. Timing wraps
`Trainer.training_step` (what TRL logs as `step_time`), synchronising CUDA around it; it reports wall time and the
process CPU time of the step. On a shared CPU machine the CPU time is the reliable figure: wall time also counts the
time other processes held the cores (the CPU default is one torch thread for the same reason).

Peak memory is measured over one non-generating training step per run, above the memory held before it:
CUDA: `torch.cuda.max_memory_allocated`; CPU: the running sum of tensor allocations and frees recorded by
`torch.profiler` (`profile_memory=True`), whose maximum is the step's peak tensor memory. That step is not timed.

    python benchmarks/bench_speed.py --device cpu
    python benchmarks/bench_speed.py --device cuda --repeats 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from dhpo_trl import DHPOTrainer  # noqa: E402
from dhpo_trl.core.presets import config_for  # noqa: E402
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3  # noqa: E402


def digit_share(completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


def cpu_step_peak_bytes(profiler) -> int:
    """Peak of the running tensor-memory balance over the profiled region, from the profiler's events."""
    events = sorted(profiler.events(), key=lambda event: event.time_range.start)
    balance = peak = 0
    for event in events:
        balance += event.self_cpu_memory_usage  # allocations (+) and frees (-) not attributed to a child op
        peak = max(peak, balance)
    return peak


class StepProbe:
    """Replaces `trainer.training_step`: times non-generating steps, measures peak memory of one of them."""

    def __init__(self, trainer, device: str, generation_every: int, profile_call: int):
        self.trainer, self.device = trainer, device
        self.inner = trainer.training_step
        self.generation_every, self.profile_call = generation_every, profile_call
        self.calls, self.times, self.cpu_times, self.peak_bytes = 0, [], [], None
        trainer.training_step = self

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def __call__(self, model, inputs, num_items_in_batch=None):
        call, self.calls = self.calls, self.calls + 1
        generates = call % self.generation_every == 0
        if call == self.profile_call and not generates:
            return self._measure_memory(model, inputs, num_items_in_batch)
        self._sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        output = self.inner(model, inputs, num_items_in_batch)
        self._sync()
        if not generates:
            self.times.append(time.perf_counter() - start)
            self.cpu_times.append(time.process_time() - cpu_start)
        return output

    def _measure_memory(self, model, inputs, num_items_in_batch):
        if self.device == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            output = self.inner(model, inputs, num_items_in_batch)
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - before
        else:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
                output = self.inner(model, inputs, num_items_in_batch)
            self.peak_bytes = cpu_step_peak_bytes(profiler)
        return output


ARMS = {"GRPO": None, "DHPO-E trl-batching": dict(padding_free=False, dynamic_batching=False), "DHPO-E auto": {}}


def arm_order(repeat: int) -> list[str]:
    """The arms in the order of repetition `repeat`: rotated by one a repetition (over `len(ARMS)` repetitions each
    arm runs once at each place), reversed in every other block of `len(ARMS)` (each arm then follows every other
    equally often, so what one run leaves behind weighs on every arm alike)."""
    arms = list(ARMS)
    shift = repeat % len(arms)
    order = arms[shift:] + arms[:shift]
    return order[::-1] if (repeat // len(arms)) % 2 else order


def options_error(options) -> str | None:
    """What is wrong with the parsed options, naming the flag, or None."""
    if options.repeats < 1 or options.repeats % len(ARMS):
        return f"--repeats {options.repeats}: a positive multiple of {len(ARMS)} (one per arm and place in the order)"
    if options.steps_per_generation < 2:
        return "--steps-per-generation: at least 2 (only the steps that do not generate are timed)"
    if options.steps % options.steps_per_generation == 1 or options.steps < 2:
        return "--steps: the last step must not be a generation step (it is the memory-profiled one)"
    return None


def run_once(arm: str, options, tokenizer, dataset, output_dir: str) -> StepProbe:
    common = dict(
        output_dir=output_dir,
        per_device_train_batch_size=options.batch_size,
        num_generations=options.batch_size,
        gradient_accumulation_steps=1,
        steps_per_generation=options.steps_per_generation,
        max_completion_length=options.completion_length,
        max_steps=options.steps,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        bf16=False,
        use_cpu=options.device == "cpu",
        disable_tqdm=True,
    )
    if ARMS[arm] is None:
        args = GRPOConfig(loss_type="grpo", epsilon=0.2, epsilon_high=0.28, **common)
        trainer_cls = GRPOTrainer
    else:
        args = config_for("DHPO-E", **ARMS[arm], **common)
        trainer_cls = DHPOTrainer
    model = build_tiny_qwen3(
        tokenizer, hidden_size=options.hidden_size, num_layers=options.layers, num_heads=options.heads, seed=0
    )
    trainer = trainer_cls(model=model, reward_funcs=digit_share, args=args, train_dataset=dataset,
                          processing_class=tokenizer)  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # keep stdout for the results
    probe = StepProbe(trainer, options.device, options.steps_per_generation, profile_call=options.steps - 1)
    probe.path = trainer._update.path.name if trainer_cls is DHPOTrainer else "TRL's"
    probe.args = args
    trainer.train()
    del trainer, model
    if options.device == "cuda":
        torch.cuda.empty_cache()
    return probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=6,
                        help="runs per arm, a multiple of 3: every arm at every place in the order once a block of 3")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per run")
    parser.add_argument("--steps-per-generation", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="completions per micro-batch (one group)")
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 on --device cpu, where a shared machine makes "
                             "multi-threaded kernels noisy; torch's default on cuda)")  # fmt: skip
    options = parser.parse_args()
    if options.threads or options.device == "cpu":
        torch.set_num_threads(options.threads or 1)
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    if options_error(options):
        parser.error(options_error(options))

    tokenizer = build_char_tokenizer()
    dataset = Dataset.from_dict({"prompt": [f"Compute {a}+{3 * a + 7}. Answer:" for a in range(256)]})
    results = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as output_dir:
        for arm in ARMS:  # warm-up: kernels, allocator, caches
            run_once(arm, options, tokenizer, dataset, output_dir)
        for repeat in range(options.repeats):
            for arm in arm_order(repeat):
                results[arm].append(run_once(arm, options, tokenizer, dataset, output_dir))

    print(f"device={options.device} threads={torch.get_num_threads()} hidden={options.hidden_size} "
          f"layers={options.layers} batch={options.batch_size} completion_length={options.completion_length} "
          f"repeats={options.repeats} timed non-generating steps per arm: "
          f"{sum(len(p.times) for p in results['GRPO'])}")  # fmt: skip
    summary = {}
    for arm, probes in results.items():
        wall = [t for probe in probes for t in probe.times]
        cpu = [t for probe in probes for t in probe.cpu_times]
        peaks = [probe.peak_bytes for probe in probes]
        summary[arm] = (statistics.median(wall), statistics.median(cpu), max(peaks))
        wall_q, cpu_q = statistics.quantiles(wall, n=4), statistics.quantiles(cpu, n=4)
        print(f"{arm:20s} ({probes[0].path} update path) step time median wall "
              f"{1e3 * statistics.median(wall):8.2f} ms "
              f"(IQR {1e3 * wall_q[0]:.2f}-{1e3 * wall_q[2]:.2f}), "
              f"process CPU {1e3 * statistics.median(cpu):8.2f} ms (IQR {1e3 * cpu_q[0]:.2f}-{1e3 * cpu_q[2]:.2f}), "
              f"n={len(wall)};  peak step memory {max(peaks) / 2**20:9.3f} MiB "
              f"(runs: {', '.join(f'{p / 2**20:.3f}' for p in peaks)})")  # fmt: skip
    for arm in list(ARMS)[1:]:
        ratio = {name: summary[arm][i] / summary["GRPO"][i] for i, name in enumerate(("wall", "cpu", "memory"))}
        # CPU time is what the step costs; wall time also carries other processes' load on a shared machine.
        print(f"{arm} / GRPO: step-time ratio wall {ratio['wall']:.3f}, process CPU {ratio['cpu']:.3f}; "
              f"peak-memory ratio {ratio['memory']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
