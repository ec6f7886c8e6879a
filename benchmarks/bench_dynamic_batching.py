"""Dynamic batching against TRL's batching: update time, trained tokens/s, padding and peak memory, in one process.

Three trainers run the same locally built Qwen3, the same prompts, seed and completions, interleaved over repeats:

    trl      trl.GRPOTrainer (the GRPO row's clip settings)
    fixed    DHPOTrainer, the chosen row, dynamic_batching=False (TRL's batching)
    dynamic  DHPOTrainer, the chosen row, dynamic_batching=True, padding_free=False (and --max-tokens as its token
             budget)
    packed   DHPOTrainer, the chosen row, dynamic_batching=True, padding_free=True (--max-tokens then counts the
             real tokens of one packed row)
    shared   as packed, with share_prompts=True: a prompt shared by sequences of one packed row is forwarded once

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
  each accumulation window (and the same for the old-log-prob pass's rows over the whole generation batch).
On CUDA also MFU: 6 x parameters x trained tokens / update time / --peak-tflops.

    python benchmarks/bench_dynamic_batching.py                       # CPU, 1 thread, the issue's workload
    python benchmarks/bench_dynamic_batching.py --device cuda --dtype bfloat16 --hidden-size 1024 --layers 16 \\
        --max-completion 4096 --batch-size 16 --accumulation 8 --repeats 3
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import tempfile
import time

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
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3  # noqa: E402
from dhpo_trl.training import batching, shared_prompts  # noqa: E402

TRAINERS = ("trl", "fixed", "dynamic", "packed", "shared")


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


class Probe:
    """Times `training_step` and the generation batch's scoring; measures padding and per-micro-step memory."""

    def __init__(self, trainer, device: str, memory_steps: set[int], clock: str = "wall"):
        self.trainer, self.device, self.memory_steps = trainer, device, memory_steps
        self.clock = time.process_time if clock == "cpu" else time.perf_counter
        self.step_inner, self.score_inner = trainer.training_step, trainer._generate_and_score_completions
        trainer.training_step, trainer._generate_and_score_completions = self.step, self.score
        self.calls = 0
        self.step_seconds = self.score_seconds = 0.0
        self.trained_tokens = self.real = self.forwarded = 0
        self.prompts_forwarded = self.prompts_total = 0  # prompt tokens of the update rows: forwarded, in the sequences
        self.old_prompts_forwarded = self.old_prompts_total = 0  # the same, old-log-prob rows (whole generation batch)
        self.peaks: list[int] = []
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
        if call in self.memory_steps:
            output = self._measured(model, inputs, num_items_in_batch)
        else:
            self._sync()
            start = self.clock()
            output = self.step_inner(model, inputs, num_items_in_batch)
            self._sync()
            self.step_seconds += self.clock() - start
        if self.scored is not False:  # the buffer was just filled: the micro-batches this generation batch trains on
            parts = [p for m in self.trainer._buffered_inputs for p in (m if isinstance(m, list) else [m])]
            update = getattr(self.trainer, "_update", None)  # TRL's trainer: its padded micro-batches
            sums = (update.path if update is not None else batching.PADDED).sums(parts)  # the path's own count
            real, forwarded = int(sums["padding_real"]), int(sums["padding_forwarded"])
            self.real, self.forwarded = self.real + real, self.forwarded + forwarded
            if getattr(self.trainer.args, "share_prompts", False):
                self._count_old_prompts(self.scored)
                prompts, total = shared_prompts.prompt_tokens(parts)
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


def run_once(name: str, options, tokenizer, dataset, output_dir: str, measure_memory: bool):
    steps = options.accumulation
    common = dict(
        output_dir=output_dir, per_device_train_batch_size=options.batch_size, num_generations=options.generations,
        gradient_accumulation_steps=steps, steps_per_generation=2 * steps, max_completion_length=options.max_completion,
        max_steps=options.steps, optim="sgd", learning_rate=1e-3, logging_steps=1, save_strategy="no",
        report_to="none", seed=0, bf16=options.dtype == "bfloat16", use_cpu=options.device == "cpu",
        disable_tqdm=True,
    )  # fmt: skip
    row = PAPER_ALGORITHMS["GRPO"]
    if name == "trl":
        args = GRPOConfig(loss_type="grpo", **{k: v for k, v in row.items() if k != "algorithm"}, **common)
        trainer_cls = GRPOTrainer
    else:
        dynamic = name in ("dynamic", "packed", "shared")
        budget = {"max_tokens_per_micro_batch": options.max_tokens} if dynamic and options.max_tokens else {}
        args = config_for(options.algorithm, dynamic_batching=dynamic, padding_free=name in ("packed", "shared"),
                          share_prompts=name == "shared", **budget, **common)  # fmt: skip
        trainer_cls = DHPOTrainer
    model = build_tiny_qwen3(tokenizer, hidden_size=options.hidden_size, num_layers=options.layers,
                             num_heads=options.heads, seed=0, max_position_embeddings=4 * options.max_completion)  # fmt: skip
    if options.device == "cuda":
        model = model.to("cuda")
    start = torch.cat([p.detach().flatten().float().cpu() for p in model.parameters()])
    rollout = long_tailed_rollout(tokenizer, options.max_completion, options.median_fraction, options.sigma)
    trainer = trainer_cls(model=model, reward_funcs=content_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, rollout_func=rollout)  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    # memory: the micro-steps of the second optimizer step of the first generation batch (no scoring inside)
    probe = Probe(trainer, options.device, set(range(steps, 2 * steps)) if measure_memory else set(), options.clock)
    trainer.train()
    change = torch.cat([p.detach().flatten().float().cpu() for p in model.parameters()]) - start
    parameters = sum(p.numel() for p in model.parameters())
    del trainer, model
    if options.device == "cuda":
        torch.cuda.empty_cache()
    return probe, change, parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--algorithm", default="GRPO", choices=list(PAPER_ALGORITHMS),
                        help="row trained by DHPOTrainer; the update gap to TRL is meaningful for GRPO")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per trainer, interleaved")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (2 per generation batch)")
    parser.add_argument("--batch-size", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--accumulation", type=int, default=8, help="gradient_accumulation_steps")
    parser.add_argument("--max-completion", type=int, default=512)
    parser.add_argument("--max-prompt", type=int, default=64, help="longest prompt, in tokens (shortest: 16)")
    parser.add_argument("--median-fraction", type=float, default=1 / 8, help="median completion length / max")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of completion lengths")
    parser.add_argument("--max-tokens", type=int, default=None, help="dynamic run's max_tokens_per_micro_batch")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="CUDA: dense bf16 peak (H100/H200 SXM)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 on cpu)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU time (one thread: less sensitive to other jobs on a shared "
                             "machine than wall time); --device cpu only")  # fmt: skip
    options = parser.parse_args()
    if options.device == "cpu":
        torch.set_num_threads(options.threads or 1)
        if options.clock == "cpu" and torch.get_num_threads() != 1:
            parser.error("--clock cpu sums the CPU time of every thread: use it with --threads 1")
    elif options.clock == "cpu":
        parser.error("--clock cpu: CPU time does not count GPU work; use --clock wall with --device cuda")
    elif not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    if options.steps < 2 or options.steps % 2:
        parser.error("--steps must be a positive even number (two optimizer steps per generation batch)")

    tokenizer = build_char_tokenizer()
    rng = random.Random(0)
    # 16 to 64 tokens: about what a MATH prompt is next to the paper's 4096-token completions, scaled to the maximum
    prompts = [f"{'Q' * rng.randint(6, options.max_prompt - 10)} {a}+{3 * a + 7}=" for a in range(512)]
    dataset = Dataset.from_dict({"prompt": prompts})
    results = {name: [] for name in TRAINERS}
    with tempfile.TemporaryDirectory() as output_dir:
        for name in TRAINERS:  # warm-up and memory: allocator, kernels, caches
            results[name].append(run_once(name, options, tokenizer, dataset, output_dir, measure_memory=True))
        for repeat in range(options.repeats):
            order = TRAINERS[repeat % len(TRAINERS) :] + TRAINERS[: repeat % len(TRAINERS)]
            for name in order:
                results[name].append(run_once(name, options, tokenizer, dataset, output_dir, measure_memory=False))

    first = results["trl"][0][0]
    print(f"device={options.device} dtype={options.dtype} threads={torch.get_num_threads()} clock={options.clock} "
          f"row={options.algorithm} "
          f"hidden={options.hidden_size} layers={options.layers} params={results['trl'][0][2] / 1e6:.2f}M "
          f"batch={options.batch_size} accumulation={options.accumulation} max_prompt={options.max_prompt} "
          f"max_completion={options.max_completion} "
          f"median={options.median_fraction:.3f}*max sigma={options.sigma} max_tokens={options.max_tokens} "
          f"steps={options.steps} repeats={options.repeats} trained tokens/run={first.trained_tokens}")  # fmt: skip
    reference = float(results["trl"][0][1].norm())
    summary = {}
    for name in TRAINERS:
        timed = results[name][1:]
        update = statistics.median(p.step_seconds - p.score_seconds for p, _, _ in timed)
        score = statistics.median(p.score_seconds for p, _, _ in timed)
        probe = timed[0][0]
        tokens_per_second = probe.trained_tokens / update
        padding = 1 - probe.real / probe.forwarded
        peak = max(results[name][0][0].peaks)
        gap = float((results[name][0][1] - results["trl"][0][1]).norm()) / reference
        summary[name] = (update, tokens_per_second, peak)
        line = (f"{name:8s} update {1e3 * update / options.steps:9.1f} ms/optimizer step   "
                f"{tokens_per_second:10.0f} trained tok/s   old-logp pass {1e3 * score / (options.steps // 2):8.1f} "
                f"ms/generation batch   padding {100 * padding:5.1f}%   peak step memory {peak / 2**20:8.2f} MiB   "
                f"update gap to trl {gap:.1e}")  # fmt: skip
        if options.device == "cuda":
            parameters = results[name][0][2]
            line += f"   MFU {100 * 6 * parameters * tokens_per_second / (options.peak_tflops * 1e12):.2f}%"
        print(line)
    throughput = summary["dynamic"][1] / summary["trl"][1]
    memory = summary["dynamic"][2] / summary["trl"][2]
    print(f"dynamic / trl: update throughput {throughput:.2f}x (target >= 2.5x), peak step memory {memory:.2f}x "
          f"(target <= 0.6x); fixed / trl throughput {summary['fixed'][1] / summary['trl'][1]:.2f}x")  # fmt: skip
    print(f"packed / dynamic: update throughput {summary['packed'][1] / summary['dynamic'][1]:.2f}x (target >= 1.4x), "
          f"peak step memory {summary['packed'][2] / summary['dynamic'][2]:.2f}x (target <= 1x); packed / trl: "
          f"update throughput {summary['packed'][1] / summary['trl'][1]:.2f}x (target >= 3x)")  # fmt: skip
    shared = results["shared"][0][0]
    print(f"shared / packed: update throughput {summary['shared'][1] / summary['packed'][1]:.2f}x (pays if >= 1.1x), "
          f"peak step memory {summary['shared'][2] / summary['packed'][2]:.2f}x; prompt tokens saved: update rows "
          f"{1 - shared.prompts_forwarded / shared.prompts_total:.1%} of {shared.prompts_total} (prompts are "
          f"{shared.prompts_total / shared.real:.1%} of the update's tokens), old-log-prob rows "
          f"{1 - shared.old_prompts_forwarded / shared.old_prompts_total:.1%}")  # fmt: skip
    for name in TRAINERS:  # the per-repeat spread, for a noisy shared machine
        rates = [p.trained_tokens / (p.step_seconds - p.score_seconds) for p, _, _ in results[name][1:]]
        print(f"{name:8s} trained tok/s per repeat: " + " ".join(f"{rate:.0f}" for rate in rates))


if __name__ == "__main__":
    main()
