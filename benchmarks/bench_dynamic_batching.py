"""Dynamic batching against TRL's batching: update time, trained tokens/s, padding and peak memory, in one process.

Three trainers run the same locally built Qwen3, the same prompts, seed and completions, interleaved over repeats:

    trl      trl.GRPOTrainer (the GRPO row's clip settings), each step in DHPOTrainer's attention context (on CUDA
             with torch >= 2.11 without cuDNN attention, as the other arms: they differ in batching only)
    fixed    DHPOTrainer, the chosen row, dynamic_batching=False (TRL's batching)
    dynamic  DHPOTrainer, the chosen row, dynamic_batching=True, padding_free=False (and --max-tokens as its token
             budget)
    packed   DHPOTrainer, the chosen row, dynamic_batching=True, padding_free=True (--max-tokens then counts the
             real tokens of one packed row)
    shared   as packed, with share_prompts=True: a prompt shared by sequences of one packed row is forwarded once

An arm written `NAME@BxA` (`packed@16x2`) trains at B rows per micro-step and A accumulation steps instead of
--batch-size x --accumulation, B x A equal to the base shape's: steps_per_generation 2 x A keeps the generation batch,
so every optimizer step trains the same sequences and the update gap to TRL still says whether the update is the same.
Fewer, larger micro-steps test whether per-micro-step cost bounds the update; its timed runs are --wide-repeats.
With --compile every arm also runs as `NAME+compile` (`torch_compile=True`: the model the update trains is
`torch.compile`d by accelerate, inductor), interleaved with the others; its warm-up run compiles, and each run records
the graphs dynamo compiled during it (`graphs_compiled_per_run`: 0 in a timed run says no compilation was timed).

Completions come from a `rollout_func` with the long tail of RLVR responses: lognormal lengths with median
max/8 (--median-fraction), some cut at the maximum; prompts of 16 to --max-prompt (64) tokens. Sampling costs
nothing here, so the figures are the policy update's. Two optimizer steps per generation batch (the paper's
off-policy setting).

Figures per trainer (medians over repeats):
* update time per optimizer step: forward + backward of the policy update (all `training_step` time minus the
  generation batch's scoring, which holds the old-log-prob pass, timed on its own);
* trained tokens/s: completion tokens of the update / update time;
* old-log-prob pass time per generation batch (no-grad forwards over the whole generation batch);
* padding: share of the update forwards' prompt + completion tokens that are padding;
* peak memory of an optimizer step: the largest, over the micro-steps of one non-generating optimizer step, of
  the memory a micro-step adds (CPU: tensor allocations recorded by torch.profiler; CUDA: max_memory_allocated);
* the update: relative gap of each run's parameter change to TRL's (plain SGD, so it is the summed gradient);
* shared: prompt tokens its update rows forward / the same sequences' prompt tokens, as TRL's shuffle left them in
  each accumulation window (and the same for the old-log-prob pass's rows over the whole generation batch);
* the packed attention calls per kernel (`dhpo_trl.training.attention_kernels`: a varlen kernel or the
  per-sequence SDPA loop);
* each arm's shape (rows, accumulation, steps_per_generation, token budget) and its largest update pass in
  forwarded tokens (what bounds a micro-step's activation memory);
* a profiled arm (--profile): its top operators and, per micro-step of the profiled window
  (`dhpo_trl.training.step_profile`), wall seconds, aten operators, kernel launches, host-device synchronisations,
  the device-busy fraction (CUDA) and the attention operators' share of host time.
On CUDA also MFU: the update's model FLOPs (`update_flops`: matrix products, the LM head on completion tokens, causal
attention; forward + backward, padding not counted) / update time / the GPU's dense bf16 peak (`--peak-tflops`, or
`peak_tflops` of the device's name). `--shape qwen3-0.6b|qwen3-1.7b` trains a released Qwen3's shape with random
weights; `--json` writes the figures (after every run, so a run cut short leaves what it measured).

    python benchmarks/bench_dynamic_batching.py                       # CPU, 1 thread, the issue's workload
    python benchmarks/bench_dynamic_batching.py --device cuda --dtype bfloat16 --shape qwen3-1.7b \
        --max-completion 2048 --batch-size 4 --accumulation 8 --arms trl,dynamic,packed,shared --repeats 2
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import tempfile
import time
from contextlib import nullcontext

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from dhpo_trl import DHPOTrainer  # noqa: E402
from dhpo_trl.core.presets import PAPER_ALGORITHMS, config_for  # noqa: E402
from dhpo_trl.demo.tiny import QWEN3_SHAPES, build_char_tokenizer, build_qwen3_shape, build_tiny_qwen3  # noqa: E402
from dhpo_trl.training import attention_kernels, batching, cuda_attention, shared_prompts, step_profile  # noqa: E402

TRAINERS = ("trl", "fixed", "dynamic", "packed", "shared")
# A profiled run records this many micro-steps of its second optimizer step (no scoring inside): the update's
# operators, in few enough events that the profiler's bookkeeping stays small; a run profiled whole at the 1.7B shape
# outlasted the rest of its 240 s box on an H100.
PROFILE_MICRO_STEPS = 2
PROFILE_MARKER = "bench_micro_step"  # the record_function range around each profiled micro-step


COMPILED = "+compile"  # the suffix of an arm's compiled twin (--compile)


def arm_shape(label: str, batch_size: int, accumulation: int) -> dict:
    """An arm of `--arms`: `NAME` trains at the base shape (--batch-size x --accumulation), `NAME@BxA` at B rows per
    micro-step and A micro-steps per optimizer step, with the same generation batch (steps_per_generation 2 x A, so
    2 optimizer steps of the same sequences each); a `+compile` suffix (the twins --compile adds) trains it with
    `torch_compile=True`. Raises ValueError naming --arms."""
    compiled = label.endswith(COMPILED)
    label = label.removesuffix(COMPILED)
    name, at, shape = label.partition("@")
    if name not in TRAINERS:
        raise ValueError(f"--arms: {label!r} names no arm; each is one of {','.join(TRAINERS)}, optionally @BxA")
    rows, steps = batch_size, accumulation
    if at:
        pieces = shape.split("x")
        if len(pieces) != 2 or not all(p.isdigit() and int(p) > 0 for p in pieces):
            raise ValueError(f"--arms: {label!r}: write the shape as NAME@BxA with positive integers, e.g. {name}@16x2")
        rows, steps = map(int, pieces)
    # B x A sequences an optimizer step, as the base shape: then steps_per_generation 2 x A gives B x 2A, the base
    # shape's generation batch, and TRL's sampler and shuffle give each optimizer step the same sequences
    if rows * steps != batch_size * accumulation:
        raise ValueError(f"--arms: {label!r} trains {rows} x {steps} = {rows * steps} sequences an optimizer step; "
                         f"the base shape trains {batch_size} x {accumulation} = {batch_size * accumulation} "
                         f"(--batch-size x --accumulation): give B x A = {batch_size * accumulation}")  # fmt: skip
    if compiled and name in ("packed", "shared"):  # DHPOConfig refuses it under the benchmark's gradient checkpointing
        raise ValueError(f"--arms: {label}{COMPILED}: packed rows are not compiled with gradient checkpointing "
                         "(docs/update_paths.md#torchcompile); compile trl, fixed or dynamic arms")
    return {"name": name, "batch_size": rows, "accumulation": steps, "steps_per_generation": 2 * steps,
            "torch_compile": compiled}


class TRLTrainer(GRPOTrainer):
    """trl.GRPOTrainer, its steps in the SDPA context DHPOTrainer's steps run in (`cuda_attention.for_update`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._update_attention = cuda_attention.for_update(self.accelerator.device.type)[0]  # decided once, as ours

    def training_step(self, model, inputs, num_items_in_batch=None):
        with self._update_attention():
            return super().training_step(model, inputs, num_items_in_batch)


def long_tailed_rollout(tokenizer, max_completion: int, median_fraction: float, sigma: float):
    """Deterministic completions: lognormal lengths (median max x fraction), cut at the maximum without EOS."""
    mu = math.log(max_completion * median_fraction)
    vocab = range(3, len(tokenizer))

    def rollout(prompts, trainer):
        prompt_ids, completion_ids = [], []
        for index, prompt in enumerate(prompts):
            rng = random.Random(f"{prompt}|{index % trainer.num_generations}")
            length = max(1, int(rng.lognormvariate(mu, sigma)))
            body = [rng.choice(vocab) for _ in range(min(length, max_completion))]
            completion_ids.append(body if length >= max_completion else [*body[:-1], tokenizer.eos_token_id])
            prompt_ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout


def content_reward(completions, **kwargs):
    return [float(sum(map(ord, text)) % 5) for text in completions]


def update_flops(config, prompts: list[int], completions: list[int]) -> float:
    """Model FLOPs of a forward + backward (3x the forward) over these sequences, padding not counted: 2 FLOPs per
    multiply-add of the layers' matrices for every token, of the LM head for every completion token (the tokens
    scored), and of causal attention (QK^T and AV over the L(L+1)/2 visible pairs of each sequence)."""
    hidden, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = config.num_key_value_heads
    matrices = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim + 3 * hidden * config.intermediate_size
    forward = 0.0
    for prompt, completion in zip(prompts, completions, strict=True):
        length = prompt + completion
        forward += 2 * layers * matrices * length + 2 * hidden * config.vocab_size * completion
        forward += layers * 2 * 2 * heads * head_dim * length * (length + 1) / 2
    return 3 * forward


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a known GPU (NVIDIA's data sheets, SXM unless the name says PCIe), or None."""
    name = device_name.upper()
    if "H100" in name and "PCIE" in name:
        return 756.0
    if "H100" in name or "H200" in name:
        return 989.0
    if "A100" in name:
        return 312.0
    return None


class Probe:
    """Times `training_step` and the generation batch's scoring; measures padding and per-micro-step memory."""

    def __init__(self, trainer, device: str, memory_steps: set[int], clock: str = "wall", profile_steps=range(0)):
        self.trainer, self.device, self.memory_steps, self.profile_steps = trainer, device, memory_steps, profile_steps
        self.clock = time.process_time if clock == "cpu" else time.perf_counter
        self.step_inner, self.score_inner = trainer.training_step, trainer._generate_and_score_completions
        trainer.training_step, trainer._generate_and_score_completions = self.step, self.score
        self.calls = 0
        self.step_seconds = self.score_seconds = 0.0
        self.trained_tokens = self.real = self.forwarded = 0
        self.prompts_forwarded = self.prompts_total = 0  # prompt tokens of the update rows: forwarded, in the sequences
        self.old_prompts_forwarded = self.old_prompts_total = 0  # the same, old-log-prob rows (whole generation batch)
        self.peaks: list[int] = []
        self.prompt_lengths: list[int] = []  # of every sequence the update trained on
        self.completion_lengths: list[int] = []
        self.scored = False
        self.health: dict = {}
        self.profile: list[dict] | None = None  # top operators over `profile_steps`
        self.profile_summary: dict | None = None  # per micro-step figures of `profile_steps` (`step_profile`)
        self.largest_pass = 0  # forwarded tokens (rows x widths, or a packed row's) of the largest update pass
        self.profiler = None
        self.seconds = 0.0  # the whole run's wall time: model build, trainer, training
        self.graphs_compiled = 0  # graphs torch.compile (dynamo) compiled during the run

    def release(self):
        """Give the trainer its own methods back and drop every reference to it (the probe is kept after the run)."""
        if self.profiler is not None:  # the run ended inside its window
            self.profiler.stop()
            self.profiler = None
        self.trainer.training_step, self.trainer._generate_and_score_completions = self.step_inner, self.score_inner
        self.trainer = self.step_inner = self.score_inner = None
        self.scored = False

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def score(self, *args, **kwargs):
        self._sync()
        start = self.clock()
        output = self.score_inner(*args, **kwargs)
        self._sync()
        self.score_seconds += self.clock() - start
        self.trained_tokens += int(batching.loss_mask(output).sum())
        self.scored = output
        return output

    def _count_old_prompts(self, output):
        """The old-log-prob pass's shared rows (TRL's row count, or what the budget needs), counted after timing."""
        count = math.ceil(output["prompt_ids"].size(0) / self.trainer.args.per_device_train_batch_size)
        seqs = shared_prompts.window_sequences(output)
        budget = self.trainer.args.max_tokens_per_micro_batch
        count = max(count, shared_prompts.rows_needed(seqs, budget)) if budget else count
        rows = shared_prompts.plan_rows(seqs, count, budget if count > 1 else None)
        self.old_prompts_forwarded += sum(shared_prompts.row_tokens(seqs, row) - sum(seqs.completions[i] for i in row)
                                          for row in rows)  # fmt: skip
        self.old_prompts_total += sum(seqs.prompts)

    def step(self, model, inputs, num_items_in_batch=None):
        call, self.calls = self.calls, self.calls + 1
        if self.profile_steps and call == self.profile_steps[0]:
            self._sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
            self.profiler = profile(activities=activities)
            self.profiler.start()
        # a profiled micro-step is one marked range of the summary: from an idle device (synchronised before the
        # range, so earlier work is not its own) to its closing synchronisation (inside, so its kernels are; one
        # cudaDeviceSynchronize a micro-step of the summary's count is the benchmark's)
        self._sync()
        marked = torch.profiler.record_function(PROFILE_MARKER) if self.profiler is not None else nullcontext()
        with marked:
            if call in self.memory_steps:
                output = self._measured(model, inputs, num_items_in_batch)
            else:
                start = self.clock()
                output = self.step_inner(model, inputs, num_items_in_batch)
                self._sync()
                self.step_seconds += self.clock() - start
        if self.profiler is not None and call == self.profile_steps[-1]:
            self._sync()
            self.profiler.stop()
            self.profile = top_operators(self.profiler, self.device)
            self.profile_summary = step_profile.summarise(step_profile.records(self.profiler.events()),
                                                          PROFILE_MARKER, self.device == "cuda")  # fmt: skip
            self.profiler = None
        if self.scored is not False:  # the buffer was just filled: the micro-batches this generation batch trains on
            parts = [p for m in self.trainer._buffered_inputs for p in (m if isinstance(m, list) else [m])]
            update = getattr(self.trainer, "_update", None)  # TRL's trainer: its padded micro-batches
            path = update.path if update is not None else batching.PADDED
            sums = path.sums(parts)  # the path's own count
            real, forwarded = int(sums["padding_real"]), int(sums["padding_forwarded"])
            self.largest_pass = max(self.largest_pass, *(int(path.sums([p])["padding_forwarded"]) for p in parts))
            for part in parts:
                self.prompt_lengths += part["prompt_mask"].sum(1).tolist()
                self.completion_lengths += part["completion_mask"].sum(1).tolist()
            self.real, self.forwarded = self.real + real, self.forwarded + forwarded
            if getattr(self.trainer.args, "share_prompts", False):
                self._count_old_prompts(self.scored)
                counts = [shared_prompts.prompt_tokens(shared_prompts.window_sequences(part),
                                                       [list(range(part["prompt_ids"].size(0)))])
                          for part in parts]  # each pass is one shared row  # fmt: skip
                prompts, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
                self.prompts_forwarded, self.prompts_total = self.prompts_forwarded + prompts, self.prompts_total + total
            self.scored = False
        return output

    def _measured(self, model, inputs, num_items_in_batch):
        if self.device == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            output = self.step_inner(model, inputs, num_items_in_batch)
            torch.cuda.synchronize()
            self.peaks.append(torch.cuda.max_memory_allocated() - before)
        else:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
                output = self.step_inner(model, inputs, num_items_in_batch)
            balance = peak = 0
            for event in sorted(profiler.events(), key=lambda event: event.time_range.start):
                balance += event.self_cpu_memory_usage
                peak = max(peak, balance)
            self.peaks.append(peak)
        return output


def run_once(name: str, options, tokenizer, dataset, output_dir: str, measure_memory: bool, profiled=False):
    """One run of one arm: a warm-up (`measure_memory`: peak step memory, the parameter change), a timed run, or a
    profiled one (`profiled`: the operators of PROFILE_MICRO_STEPS micro-steps of its second optimizer step)."""
    began = time.perf_counter()
    shape = arm_shape(name, options.batch_size, options.accumulation)
    label, name, steps = name, shape["name"], shape["accumulation"]
    common = dict(
        output_dir=output_dir, per_device_train_batch_size=shape["batch_size"], num_generations=options.generations,
        gradient_accumulation_steps=steps, steps_per_generation=shape["steps_per_generation"],
        max_completion_length=options.max_completion,
        max_steps=options.steps, optim="sgd", learning_rate=1e-3, logging_steps=1, save_strategy="no",
        report_to="none", seed=0, bf16=options.dtype == "bfloat16", use_cpu=options.device == "cpu",
        disable_tqdm=True, torch_compile=shape["torch_compile"],
    )  # fmt: skip
    row = PAPER_ALGORITHMS["GRPO"]
    shape["max_tokens_per_micro_batch"] = None  # TRL's arm and the fixed one: no budget
    if name == "trl":
        args = GRPOConfig(loss_type="grpo", **{k: v for k, v in row.items() if k != "algorithm"}, **common)
        trainer_cls = TRLTrainer
    else:
        dynamic = name in ("dynamic", "packed", "shared")
        budget = {"max_tokens_per_micro_batch": options.max_tokens} if dynamic and options.max_tokens else {}
        shape["max_tokens_per_micro_batch"] = budget.get("max_tokens_per_micro_batch")
        args = config_for(options.algorithm, dynamic_batching=dynamic, padding_free=name in ("packed", "shared"),
                          share_prompts=name == "shared", **budget, **common)  # fmt: skip
        trainer_cls = DHPOTrainer
    if options.shape:
        model = build_qwen3_shape(tokenizer, options.shape, device=options.device,
                                  max_position_embeddings=4 * options.max_completion)  # fmt: skip
    else:
        model = build_tiny_qwen3(tokenizer, hidden_size=options.hidden_size, num_layers=options.layers,
                                 num_heads=options.heads, seed=0, max_position_embeddings=4 * options.max_completion)  # fmt: skip
        model = model.to(options.device)
    config = model.config
    # the parameter change, for the update gap: warm-up runs only (a copy of the model, kept on its device)
    start = [p.detach().clone() for p in model.parameters()] if measure_memory else None
    calls = attention_kernels.CALLS.copy()
    graphs = compiled_graphs()
    rollout = long_tailed_rollout(tokenizer, options.max_completion, options.median_fraction, options.sigma)
    trainer = trainer_cls(model=model, reward_funcs=content_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, rollout_func=rollout)  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    # memory: the micro-steps of the second optimizer step of the first generation batch (no scoring inside)
    window = range(steps, steps + min(steps, PROFILE_MICRO_STEPS)) if profiled else range(0)
    probe = Probe(trainer, options.device, set(range(steps, 2 * steps)) if measure_memory else set(), options.clock,
                  window)  # fmt: skip
    trainer.train()
    stop = getattr(trainer, "graceful_stop", None)  # DHPOTrainer ends a run early on SIGTERM / SIGUSR1
    if stop is not None:  # a cut-short run has no figures, and the next one would outlive the caller's time box
        raise SystemExit(f"bench_dynamic_batching: stopped by {stop['signal']} at optimizer step {stop['step']} of the "
                         f"{label} run; --json holds the runs before it")
    change = None if start is None else [p.detach().float() - s.float() for p, s in zip(model.parameters(), start,
                                                                                      strict=True)]  # fmt: skip
    probe.kernels = dict(attention_kernels.CALLS - calls)
    probe.graphs_compiled = compiled_graphs() - graphs
    probe.config, probe.shape = config, shape
    probe.health = health(trainer.state.log_history, change)
    probe.release()
    parameters = sum(p.numel() for p in model.parameters())
    # the probe outlives the run: it must hold nothing of the trainer, or every run's model, gradients and batches
    # stay on the GPU (at the 1.7B shape, an H100's 80 GB hold four such runs)
    del trainer, model, start
    gc.collect()
    if options.device == "cuda":
        torch.cuda.empty_cache()
    probe.seconds = time.perf_counter() - began
    return probe, change, parameters


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (its `unique_graphs` counter)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def health(log_history: list[dict], change: list[torch.Tensor] | None) -> dict:
    """The run's logged losses and gradient norms, and how many values of its parameter change are not finite: what
    tells a NaN update gap (a run that diverged) from a large one."""
    logged = [entry for entry in log_history if "loss" in entry]
    figures = {"losses": [entry["loss"] for entry in logged], "grad_norms": [entry.get("grad_norm") for entry in logged]}
    if change is not None:
        figures["nonfinite_update_values"] = sum(int((~torch.isfinite(c)).sum()) for c in change)
    return figures


def top_operators(profiler, device: str, count: int = 25) -> list[dict]:
    """The operators that took the most self time (device time on CUDA, CPU time on CPU), in milliseconds."""
    cuda = device == "cuda"
    rows = []
    for event in profiler.key_averages():
        device_ms = getattr(event, "self_device_time_total", 0) / 1e3 if cuda else 0.0
        rows.append({"name": event.key, "calls": event.count, "self_device_ms": round(device_ms, 3),
                     "self_cpu_ms": round(event.self_cpu_time_total / 1e3, 3),
                     "cpu_ms": round(event.cpu_time_total / 1e3, 3)})  # fmt: skip
    rows.sort(key=lambda row: row["self_device_ms" if cuda else "self_cpu_ms"], reverse=True)
    return rows[:count]


def relative_gap(change: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """|change - reference| / |reference| over all parameters, one tensor at a time (no flat copy of the model)."""
    difference = sum(float((c - r).double().pow(2).sum()) for c, r in zip(change, reference, strict=True))
    return math.sqrt(difference / sum(float(r.double().pow(2).sum()) for r in reference))


def checked_arms(options) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The arms of --arms (with their compiled twins under --compile) and of --profile, checked against each other
    and the base shape; raises ValueError naming the flag (the docs' printed commands are checked with it)."""
    arms = tuple(options.arms.split(","))
    arms += tuple(arm + COMPILED for arm in arms) if options.compile else ()  # a packed arm's twin: refused below
    arm_shapes = [arm_shape(arm, options.batch_size, options.accumulation) for arm in arms]
    keys = {(s["name"], s["batch_size"], s["accumulation"], s["torch_compile"]) for s in arm_shapes}
    if len(keys) != len(arms):
        raise ValueError(f"--arms {options.arms!r}: each arm once (NAME is NAME@{options.batch_size}x"
                         f"{options.accumulation})")  # fmt: skip
    for flag, value in (("--repeats", options.repeats), ("--wide-repeats", options.wide_repeats)):
        if value is not None and value < 0:
            raise ValueError(f"{flag} {value}: timed runs per arm, 0 or more")
    if options.wide_repeats is not None and not any("@" in arm for arm in arms):
        raise ValueError(f"--wide-repeats {options.wide_repeats}: no arm of --arms {options.arms!r} is written "
                         "NAME@BxA")  # fmt: skip
    profile_arms = tuple(filter(None, options.profile.split(",")))
    if set(profile_arms) - set(arms):
        raise ValueError(f"--profile {options.profile!r}: a comma-separated subset of --arms ({options.arms})")
    return arms, profile_arms


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--algorithm", default="GRPO", choices=list(PAPER_ALGORITHMS),
                        help="row trained by DHPOTrainer; the update gap to TRL is meaningful for GRPO")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per trainer, interleaved")
    parser.add_argument("--wide-repeats", type=int, default=None,
                        help="timed runs of each arm written NAME@BxA (default: --repeats)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (2 per generation batch)")
    parser.add_argument("--batch-size", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--accumulation", type=int, default=8, help="gradient_accumulation_steps")
    parser.add_argument("--max-completion", type=int, default=512)
    parser.add_argument("--max-prompt", type=int, default=64, help="longest prompt, in tokens (shortest: 16)")
    parser.add_argument("--median-fraction", type=float, default=1 / 8, help="median completion length / max")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of completion lengths")
    parser.add_argument("--max-tokens", type=int, default=None, help="max_tokens_per_micro_batch of every dynamic, "
                        "packed and shared arm, at its own shape")  # fmt: skip
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="CUDA: the GPU's dense bf16 peak for MFU (default: peak_tflops of the device's name)")
    parser.add_argument("--shape", choices=sorted(QWEN3_SHAPES), default=None,
                        help="a released Qwen3's shape, random weights (instead of --hidden-size/--layers/--heads)")
    parser.add_argument("--arms", default=",".join(TRAINERS), help=f"comma-separated subset of {','.join(TRAINERS)}; "
                        "NAME@BxA trains that arm at B rows x A accumulation steps, the same sequences an optimizer "
                        "step and the same generation batch as --batch-size x --accumulation (B x A equal); "
                        "NAME+compile (or NAME@BxA+compile) with torch_compile=True")  # fmt: skip
    parser.add_argument("--compile", action="store_true", help="also run every arm of --arms with torch_compile=True "
                        "(as NAME+compile, interleaved with the others)")
    parser.add_argument("--json", default=None, help="write the figures to this file (rewritten after every run)")
    parser.add_argument("--profile", default="", help="comma-separated arms run once more, after the first timed "
                        "round and untimed, with torch.profiler over the first micro-steps of the second optimizer "
                        "step: their top operators by self device (CUDA) or CPU time and per micro-step figures go "
                        "in --json")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 on cpu)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU time (one thread: less sensitive to other jobs on a shared "
                             "machine than wall time); --device cpu only")  # fmt: skip
    options = parser.parse_args(argv)
    try:
        arms, profile_arms = checked_arms(options)
    except ValueError as error:
        parser.error(str(error))
    if options.device == "cpu":
        torch.set_num_threads(options.threads or 1)
        if options.clock == "cpu" and torch.get_num_threads() != 1:
            parser.error("--clock cpu sums the CPU time of every thread: use it with --threads 1")
    elif options.clock == "cpu":
        parser.error("--clock cpu: CPU time does not count GPU work; use --clock wall with --device cuda")
    elif not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch; run on a GPU, or use --device cpu")
    if options.steps < 2 or options.steps % 2:
        parser.error("--steps must be a positive even number (two optimizer steps per generation batch)")
    device_name = torch.cuda.get_device_name() if options.device == "cuda" else "cpu"
    peak = options.peak_tflops or (peak_tflops(device_name) if options.device == "cuda" else None)

    if any(arm.endswith(COMPILED) for arm in arms):
        # Compiled arms share the model's code objects, and dynamo's compilations of a code object accumulate over
        # the process's runs (one per arm and shape); past the default limit of 8 a later arm would run eagerly.
        torch._dynamo.config.recompile_limit = 64
    tokenizer = build_char_tokenizer()
    rng = random.Random(0)
    # 16 to 64 tokens: about what a MATH prompt is next to the paper's 4096-token completions, scaled to the maximum
    prompts = [f"{'Q' * rng.randint(6, options.max_prompt - 10)} {a}+{3 * a + 7}=" for a in range(512)]
    dataset = Dataset.from_dict({"prompt": prompts})
    runs = {name: [] for name in arms}  # probes; the first of each is the warm-up and memory run
    gaps, parameters, reference, profiles = {}, None, None, {}

    def report():
        return build_report(options, arms, runs, gaps, parameters, device_name, peak, profiles)

    with tempfile.TemporaryDirectory() as output_dir:
        for name in arms:  # warm-up and memory: allocator, kernels, caches (TRL first: the update gap's reference)
            probe, change, parameters = run_once(name, options, tokenizer, dataset, output_dir, measure_memory=True)
            runs[name].append(probe)
            reference = change if name == "trl" else reference
            gaps[name] = None if reference is None else relative_gap(change, reference)
            del change
            write_json(options.json, report())
        rounds = max(repeats_of(name, options) for name in arms)
        for repeat in range(max(rounds, 1)):
            order = arms[repeat % len(arms) :] + arms[: repeat % len(arms)]
            for name in (name for name in order if repeat < repeats_of(name, options)):
                runs[name].append(run_once(name, options, tokenizer, dataset, output_dir, measure_memory=False)[0])
                write_json(options.json, report())
            # the profiled runs (untimed) after the first timed round and before the others: a benchmark cut short
            # keeps every arm's speed first, then the profiles, whose run time is the least certain
            for name in profile_arms if repeat == 0 else ():
                profiles[name] = run_once(name, options, tokenizer, dataset, output_dir, False, profiled=True)[0]
                write_json(options.json, report())
    print_report(report())


def repeats_of(name: str, options) -> int:
    """Timed runs of an arm: --wide-repeats for one written NAME@BxA (when given), --repeats otherwise."""
    wide = "@" in name and options.wide_repeats is not None
    return options.wide_repeats if wide else options.repeats


def write_json(path: str | None, report: dict) -> None:
    if path:
        with open(path + ".tmp", "w") as handle:
            json.dump(report, handle, indent=1)
        os.replace(path + ".tmp", path)


def arm_figures(probes: list, gap: float | None, steps: int, peak: float | None) -> dict:
    """One arm's figures: memory and padding from its warm-up run, times from the median of its timed runs (the
    warm-up's memory-measured steps are not timed); each run's wall seconds, set-up included, warm-up first."""
    first = probes[0]
    figures = {"padding_fraction": 1 - first.real / first.forwarded, "peak_step_memory_bytes": max(first.peaks),
               "update_gap_to_trl": gap, "attention_kernels": first.kernels, "timed_runs": len(probes) - 1,
               "warm_up_run": first.health, "run_seconds": [p.seconds for p in probes], "shape": first.shape,
               "largest_pass_tokens": first.largest_pass,
               "graphs_compiled_per_run": [p.graphs_compiled for p in probes]}  # fmt: skip
    if first.prompts_total:  # shared prompts: prompt tokens not forwarded again
        figures["prompt_tokens_saved"] = 1 - first.prompts_forwarded / first.prompts_total
        figures["old_logp_prompt_tokens_saved"] = 1 - first.old_prompts_forwarded / first.old_prompts_total
    timed = probes[1:]
    if not timed:
        return figures
    update = statistics.median(p.step_seconds - p.score_seconds for p in timed)
    flops = update_flops(first.config, first.prompt_lengths, first.completion_lengths)
    figures.update(
        update_seconds_per_step=update / steps,
        old_logp_seconds_per_generation_batch=statistics.median(p.score_seconds for p in timed) / (steps // 2),
        trained_tokens_per_second=first.trained_tokens / update,
        real_tokens_per_second=first.real / update,
        trained_tokens_per_second_per_repeat=[p.trained_tokens / (p.step_seconds - p.score_seconds) for p in timed],
        update_flops=flops,
        mfu=None if peak is None else flops / update / (peak * 1e12),
    )
    return figures


def throughput_ratios(figures: dict, arms: list[str]) -> dict:
    """`top/bottom` -> trained tokens/s of top over bottom, for each pair of arms that ran: the paths against each
    other at each shape (`packed@16x2/trl@16x2` as `packed/trl`), an arm at its own shape against its base shape, a
    compiled arm against its eager twin."""
    shapes = dict.fromkeys(name.partition("@")[1] + name.partition("@")[2] for name in arms if COMPILED not in name)
    pairs = [(top + at, bottom + at) for at in shapes for top, bottom in
             (("packed", "dynamic"), ("packed", "trl"), ("dynamic", "trl"), ("shared", "packed"))]  # fmt: skip
    pairs += [(name, name.partition("@")[0]) for name in arms if "@" in name and COMPILED not in name]
    pairs += [(name, name.removesuffix(COMPILED)) for name in arms if name.endswith(COMPILED)]
    ratios = {}
    for top, bottom in pairs:
        rates = [figures.get(name, {}).get("trained_tokens_per_second") for name in (top, bottom)]
        if None not in rates:
            ratios[f"{top}/{bottom}"] = rates[0] / rates[1]
    return ratios


def build_report(options, arms, runs, gaps, parameters, device_name, peak, profiles=None) -> dict:
    figures = {name: arm_figures(runs[name], gaps[name], options.steps, peak) for name in arms if runs[name]}
    for name in figures:
        figures[name]["timed_runs_asked"] = repeats_of(name, options)
    for name, probe in (profiles or {}).items():
        figures[name].update(profile_top_operators=probe.profile, profile_run_seconds=probe.seconds,
                             profile_window={"micro_steps": list(probe.profile_steps)},
                             profile_summary=probe.profile_summary)  # fmt: skip
    ratios = throughput_ratios(figures, arms)
    first = next(iter(runs[name][0] for name in arms if runs[name]), None)
    return {
        "device": options.device, "device_name": device_name, "dtype": options.dtype, "shape": options.shape,
        "parameters": parameters, "peak_tflops": peak, "torch": torch.__version__,
        "update_attention": cuda_attention.for_update(options.device)[1],  # every arm's steps: what SDPA leaves out
        "options": {k: v for k, v in vars(options).items() if k != "json"},
        "trained_tokens_per_run": None if first is None else first.trained_tokens,
        "arms": figures, "throughput_ratios": ratios,
    }  # fmt: skip


def print_report(report: dict) -> None:
    options = report["options"]
    print(f"device={report['device_name']} dtype={report['dtype']} shape={report['shape']} "
          f"params={report['parameters'] / 1e6:.2f}M row={options['algorithm']} batch={options['batch_size']} "
          f"accumulation={options['accumulation']} max_prompt={options['max_prompt']} "
          f"max_completion={options['max_completion']} median={options['median_fraction']:.3f}*max "
          f"sigma={options['sigma']} max_tokens={options['max_tokens']} steps={options['steps']} "
          f"repeats={options['repeats']} trained tokens/run={report['trained_tokens_per_run']}")  # fmt: skip
    for name, arm in report["arms"].items():
        line = f"{name:8s} padding {100 * arm['padding_fraction']:5.1f}%   peak step memory "
        line += f"{arm['peak_step_memory_bytes'] / 2**20:9.2f} MiB   kernels {arm['attention_kernels']}"
        if arm["update_gap_to_trl"] is not None:
            line += f"   update gap to trl {arm['update_gap_to_trl']:.1e}"
        if "update_seconds_per_step" in arm:
            line += (f"   update {1e3 * arm['update_seconds_per_step']:9.1f} ms/optimizer step   "
                     f"{arm['trained_tokens_per_second']:10.0f} trained tok/s   old-logp pass "
                     f"{1e3 * arm['old_logp_seconds_per_generation_batch']:8.1f} ms/generation batch")  # fmt: skip
            if arm["mfu"] is not None:
                line += f"   MFU {100 * arm['mfu']:.1f}%"
            line += "   per repeat: " + " ".join(f"{r:.0f}" for r in arm["trained_tokens_per_second_per_repeat"])
        print(line)
    for ratio, value in report["throughput_ratios"].items():
        print(f"update throughput {ratio}: {value:.2f}x")
    for name, arm in report["arms"].items():
        summary = arm.get("profile_summary")
        if summary:
            busy, launches = summary["device_busy_fraction"], summary["kernel_launches_per_micro_step"]
            waiting, launched = summary["host_waiting_fraction"], "?" if launches is None else f"{launches:.0f}"
            print(f"profile {name}: per micro-step {summary['wall_seconds_per_micro_step'] * 1e3:.1f} ms, "
                  f"{summary['aten_ops_per_micro_step']:.0f} aten ops, {launched} "
                  f"launches, {summary['synchronisations_per_micro_step']:.1f} synchronisations; device busy "
                  f"{'-' if busy is None else f'{100 * busy:.0f}%'}, host waiting "
                  f"{'-' if waiting is None else f'{100 * waiting:.0f}%'}, host in operators "
                  f"{100 * summary['host_in_operators_fraction']:.0f}%, attention "
                  f"{100 * summary['attention_host_fraction']:.0f}% of host time")  # fmt: skip


if __name__ == "__main__":
    main()
