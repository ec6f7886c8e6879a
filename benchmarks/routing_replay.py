"""MoE routing replay on the tiny Qwen3-MoE (CPU): how far routing drifts off-policy, what replay does to the token
log-ratio, and what recording and replaying cost.

    python benchmarks/routing_replay.py --ks 4 8 --seeds 0 1 2 --learning-rate 3e-3 [--expert-scale 20]
    python benchmarks/routing_replay.py --train --ks 4 8 --seeds 0 1 2 --expert-scale 20 --json out.json

Each cell (k, seed): the tiny Qwen3-MoE (`build_tiny_qwen3(moe=True)`: 2 layers, 4 experts, top-2) samples a
generation batch (32 prompts of digits, 24 sampled tokens each); the pi_old pass records its routing; the batch is
cut into k micro-batches and k Adam steps take a GRPO clipped-surrogate step on one each (TRL's
`steps_per_generation = k`), so micro-batch j is scored by a policy j - 1 steps from pi_old. Two arms start from the
same weights and data: live routing ("none") and replayed pi_old routing ("old", R2). Each arm measures, on the
micro-batch it updates on, before the step:

* flip fraction (live run): the token-layer decisions whose top-k set differs from pi_old's;
* |log r| = |log pi_theta - log pi_old| over completion tokens, mean and 99th percentile: in the live run, in the
  live run's weights with pi_old's routing forced (a measurement forward: what replay removes at equal weights),
  and in the R2 run.

`--expert-scale` multiplies the experts' initial weights: at init the experts' output is small beside the residual
stream, so which expert runs barely moves a log-prob; scaled up, the experts differ as trained ones do.

`--train`: a short training comparison instead. Per (k, seed), four runs from the same weights: GRPO and DHPO-E (the
package's objectives, `dhpo_trl.core.objectives`, with the paper's settings), each with live routing and with R2;
`--train-batches` generation batches of 16 prompts x 8 samples, k Adam steps each. Reported per arm, mean and std over
seeds: the reward (share of even digits in the sampled completions: the task the advantages push towards) of the
first, the middle and the last two generation batches, mean and p99 |log r| and the flip fraction over all steps
(`--summarise out.json` prints the table again from the file).

Overhead: one policy update (forward + backward) and one no-grad pi_old pass, with and without the hooks, on the same
batch, interleaved and alternating order, CPU time of this process on one thread; reported as % of the plain one.
On a GPU (`scripts/gpu_check.sh` runs it), Qwen3-30B-A3B's MoE layers cut to 4, bf16, wall time between
synchronisations:

    python benchmarks/routing_replay.py --overhead-only --device cuda --dtype bfloat16 \
        --overhead-shape qwen3-30b-a3b-4-layers --overhead-rows 4 --overhead-length 1024 --repeats 8 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import statistics
import time

import torch

from dhpo_trl.core.objectives import get_objective
from dhpo_trl.core.presets import config_for
from dhpo_trl.demo.tiny import build_char_tokenizer, build_qwen3_from_fields, build_tiny_qwen3
from dhpo_trl.training import routing_replay as rr


def sample_batch(model, tokenizer, prompts: int, completion: int, seed: int, prompts_unique: int | None = None):
    """Prompts of random digits (`prompts_unique` distinct ones, each repeated as a group); completions sampled from
    the model. Returns ids, attention mask, prompt width."""
    gen = torch.Generator().manual_seed(seed)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    unique = prompts if prompts_unique is None else prompts_unique
    prompt = torch.tensor(digits)[torch.randint(0, 10, (unique, 8), generator=gen)]
    prompt = prompt.repeat_interleave(prompts // unique, 0)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                             max_new_tokens=completion, min_new_tokens=completion)  # fmt: skip
    return out, torch.ones_like(out), prompt.size(1)


def token_logps(model, ids, mask, prompt_width, entropies: bool = False):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, prompt_width - 1 : -1].float()
    logps = torch.log_softmax(logits, -1)
    chosen = logps.gather(-1, ids[:, prompt_width:, None]).squeeze(-1)
    if not entropies:
        return chosen
    return chosen, -(logps.exp() * logps).sum(-1).detach()


def rewards(ids, prompt_width, tokenizer) -> torch.Tensor:
    """The share of completion tokens that are even digits, per row."""
    even = torch.tensor([tokenizer.convert_tokens_to_ids(str(d)) for d in (0, 2, 4, 6, 8)])
    return torch.isin(ids[:, prompt_width:], even).float().mean(1)


def advantages(ids, prompt_width, tokenizer, group: int):
    """Group-normalised reward: the share of completion tokens that are even digits."""
    grouped = rewards(ids, prompt_width, tokenizer).view(-1, group)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)


def run_arm(model, hooks, routing, ids, mask, prompt_width, old_logps, adv, k, learning_rate, replay: bool):
    """k Adam steps, one per micro-batch; per step: flip fraction and the |log r| of the micro-batch's tokens."""
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    flips, ratios, forced = [], [], []
    for rows in torch.arange(ids.size(0)).chunk(k):
        sub_ids, sub_mask = ids[rows], mask[rows]
        if replay:
            with hooks.replay(routing) as stats:
                logps = token_logps(model, sub_ids, sub_mask, prompt_width)
            flips.append(stats.flipped / stats.decisions)
        else:
            with hooks.record() as out:
                logps = token_logps(model, sub_ids, sub_mask, prompt_width)
            live = out[0]
            differ = rr.decisions_differ(live.experts.long(), routing.lookup(live.keys, live.checks))
            flips.append(differ.float().mean().item())
            with torch.no_grad(), hooks.replay(routing):  # the same weights, pi_old's routing: measured only
                forced.append((token_logps(model, sub_ids, sub_mask, prompt_width) - old_logps[rows]).abs().flatten())
        log_ratio = logps - old_logps[rows]
        ratios.append(log_ratio.detach().abs().flatten())
        ratio = log_ratio.exp()
        a = adv[rows, None]
        loss = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return flips, torch.cat(ratios), torch.cat(forced) if forced else None


def build(tokenizer, seed: int, expert_scale: float):
    """The tiny Qwen3-MoE; `expert_scale` multiplies the experts' weights (at init their output is small beside the
    residual stream, so which expert runs barely changes a log-prob)."""
    model = build_tiny_qwen3(tokenizer, moe=True, seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp.experts." in name:
                param.mul_(expert_scale)
    return model


def cell(k: int, seed: int, learning_rate: float, tokenizer, batches: int, expert_scale: float):
    model = build(tokenizer, seed, expert_scale)
    arms = {"none": model, "old": copy.deepcopy(model)}
    hooks = {name: rr.RoutingReplay(m) for name, m in arms.items()}
    result = {name: {"flips": [], "ratios": [], "forced": []} for name in arms}
    for batch in range(batches):
        for name, m in arms.items():  # each arm samples its own batch from its own weights, same seed
            ids, mask, width = sample_batch(m, tokenizer, 32, 24, seed * 1000 + batch)
            with torch.no_grad(), hooks[name].record() as out:
                old_logps = token_logps(m, ids, mask, width)
            adv = advantages(ids, width, tokenizer, group=8)
            flips, ratios, forced = run_arm(m, hooks[name], out[0], ids, mask, width, old_logps, adv, k, learning_rate,
                                    replay=name == "old")  # fmt: skip
            result[name]["flips"] += flips
            result[name]["ratios"].append(ratios)
            if forced is not None:
                result[name]["forced"].append(forced)
    out = {name: {"flip": statistics.mean(r["flips"]), "ratios": torch.cat(r["ratios"])} for name, r in result.items()}
    out["forced"] = {"ratios": torch.cat(result["none"]["forced"])}
    return out


def train_run(model, tokenizer, objective: str, replay: bool, k: int, seed: int, batches: int, learning_rate: float):
    """One arm of `--train`: `batches` generation batches, k Adam steps on the objective's loss each."""
    config = config_for(objective, output_dir="/tmp/routing_replay_bench", report_to="none", use_cpu=True, bf16=False)
    compute = get_objective(config.algorithm).compute
    hooks = rr.RoutingReplay(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    curve, ratios, flips = [], [], []
    for batch in range(batches):
        ids, mask, width = sample_batch(model, tokenizer, 128, 16, seed * 1000 + batch, prompts_unique=16)
        curve.append(rewards(ids, width, tokenizer).mean().item())
        with torch.no_grad(), hooks.record() as out:
            old_logps = token_logps(model, ids, mask, width)
        routing, adv = out[0], advantages(ids, width, tokenizer, group=8)
        for rows in torch.randperm(ids.size(0), generator=torch.Generator().manual_seed(batch)).chunk(k):
            context = hooks.replay(routing) if replay else hooks.record()
            with context as held:
                logps, entropies = token_logps(model, ids[rows], mask[rows], width, entropies=True)
            if replay:
                flips.append(held.flipped / held.decisions)
            else:
                live = held[0]
                flips.append(rr.decisions_differ(live.experts.long(), routing.lookup(live.keys, live.checks))
                             .float().mean().item())  # fmt: skip
            completion = torch.ones_like(logps)
            ratios.append((logps - old_logps[rows]).detach().abs().flatten())
            loss, _, _ = compute(logps, old_logps[rows], adv[rows, None], completion, entropies, config, None)
            loss = (loss * completion).sum() / completion.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    hooks.remove()
    ratios = torch.cat(ratios)
    return {"reward_first": curve[0], "reward_last2": statistics.mean(curve[-2:]), "curve": curve,
            "abs_log_r_mean": ratios.mean().item(), "abs_log_r_p99": torch.quantile(ratios, 0.99).item(),
            "flip_fraction": statistics.mean(flips)}  # fmt: skip


def train_comparison(options, tokenizer) -> list[dict]:
    runs = []
    for k in options.ks:
        for seed in options.seeds:
            initial = build(tokenizer, seed, options.expert_scale)
            for objective in ("GRPO", "DHPO-E"):
                for replay in (False, True):
                    start = time.process_time()
                    result = train_run(copy.deepcopy(initial), tokenizer, objective, replay, k, seed,
                                       options.train_batches, options.learning_rate)  # fmt: skip
                    result.update(k=k, seed=seed, objective=objective, routing_replay="old" if replay else "none",
                                  cpu_s=time.process_time() - start)  # fmt: skip
                    runs.append(result)
                    print(json.dumps({key: v for key, v in result.items() if key != "curve"}), flush=True)
    return runs


def summary_rows(runs: list[dict]) -> list[str]:
    """Mean ± std over seeds per (k, objective, routing_replay), as a markdown table."""
    keys = ("reward_first", "reward_mid", "reward_last2", "abs_log_r_mean", "abs_log_r_p99", "flip_fraction")
    lines = ["| k | objective | routing_replay | seeds | reward, first batch | reward, middle batch | reward, last 2 "
             "batches | mean abs log r | p99 abs log r | flip fraction |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    groups: dict = {}
    for run in runs:  # the middle batch: before the reward saturates
        run = {**run, "reward_mid": run["curve"][len(run["curve"]) // 2 - 1]}
        groups.setdefault((run["k"], run["objective"], run["routing_replay"]), []).append(run)
    for (k, objective, mode), group in groups.items():
        cells = []
        for key in keys:
            values = [run[key] for run in group]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):.3f} ± {spread:.3f}")
        lines.append(f"| {k} | {objective} | {mode} | {len(group)} | " + " | ".join(cells) + " |")
    return lines


# Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts, top-8, expert width 768, 32 query / 4 key-value heads of 128)
# and vocabulary, cut to 4 layers: the hooks' work per token and layer is the full model's, on one GPU in seconds.
QWEN3_30B_A3B_LAYERS = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=4, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=768, norm_topk_prob=True, vocab_size=151936,
                            tie_word_embeddings=False)  # fmt: skip
# the same construction at CPU size: the CPU dry run of `scripts/gpu_check.sh` times it
MINI_MOE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                norm_topk_prob=True, vocab_size=1024, tie_word_embeddings=False)  # fmt: skip
OVERHEAD_SHAPES = {"tiny": None, "mini": MINI_MOE, "qwen3-30b-a3b-4-layers": QWEN3_30B_A3B_LAYERS}


def build_shape(tokenizer, shape: str, hidden: int, device: str, dtype: torch.dtype):
    """The tiny Qwen3-MoE at width `hidden`, or a released MoE layer's shape built on `device` (weights drawn where
    they live: a GPU draws billions in a second)."""
    if OVERHEAD_SHAPES[shape] is None:
        return build_tiny_qwen3(tokenizer, moe=True, seed=0, hidden_size=hidden).to(device=device, dtype=dtype)
    model = build_qwen3_from_fields(tokenizer, OVERHEAD_SHAPES[shape], device=device, max_position_embeddings=4096)
    return model.to(dtype)


def timer(device: str):
    """Seconds of one call: CPU time of this process on a CPU; on CUDA, wall time between two synchronisations (the
    hooks' host work and their kernels both count)."""
    if device == "cpu":
        return time.process_time
    return lambda: (torch.cuda.synchronize(), time.perf_counter())[1]


def replay_check(model, hooks, routing, ids, mask, width) -> dict:
    """Once the routers have moved (noise on their weights, as optimizer steps move them), the replayed forward's
    expert blocks (read by a spy, not by the hooks) run the recorded experts on every token and layer; the decisions
    the live routers would have flipped are counted. Run last: it changes the routers."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(0.5 * param.abs().mean() * torch.randn_like(param))
    used = []
    spies = [block.register_forward_pre_hook(lambda m, args: used.append(args[1].detach()))
             for name, block in model.named_modules() if name.endswith("mlp.experts")]  # fmt: skip
    try:
        with torch.no_grad(), hooks.replay(routing) as stats:
            token_logps(model, ids, mask, width)
    finally:
        for spy in spies:
            spy.remove()
    attended = mask.flatten().bool()
    ran = torch.stack([calls.view(-1, calls.size(-1))[attended] for calls in used]).long().cpu()
    differing = rr.decisions_differ(ran, routing.experts.long().cpu())  # both (layers, tokens, top_k), row-major
    return {"decisions": differing.numel(), "differing": int(differing.sum()),
            "flipped_fraction": stats.flipped / stats.decisions, "replayed_fraction": stats.replayed / stats.decisions}


def overhead(tokenizer, repeats: int, hidden: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
             shape: str = "tiny", rows: int = 32, length: int = 32) -> dict:  # fmt: skip
    """The update (forward + backward with replay) and the pi_old pass (no-grad forward with recording), plain and
    hooked, interleaved in alternating order after two warm-up rounds: medians in seconds."""
    model = build_shape(tokenizer, shape, hidden, device, dtype)
    hooks = rr.RoutingReplay(model)
    if shape == "tiny":  # sampled completions, as the drift cells
        ids, mask, width = sample_batch(model.cpu(), tokenizer, rows, length - 8, 0)
        model.to(device)
    else:  # routing work does not depend on what the tokens say
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size, (rows, length), generator=generator)
        mask, width = torch.ones_like(ids), length // 4
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad(), hooks.record() as out:
        token_logps(model, ids, mask, width)
    routing = out[0]

    def update(context):
        with context:
            loss = token_logps(model, ids, mask, width).mean()
        loss.backward()
        model.zero_grad(set_to_none=False)

    def old_pass(context):
        with torch.no_grad(), context:
            token_logps(model, ids, mask, width)

    arms = {"update": (lambda: update(contextlib.nullcontext()), lambda: update(hooks.replay(routing))),
            "pi_old pass": (lambda: old_pass(contextlib.nullcontext()), lambda: old_pass(hooks.record()))}  # fmt: skip
    clock, times = timer(device), {name: ([], []) for name in arms}
    for repeat in range(repeats + 2):
        for name, (plain, hooked) in arms.items():
            order = [(0, plain), (1, hooked)] if repeat % 2 == 0 else [(1, hooked), (0, plain)]
            for index, run in order:
                start = clock()
                run()
                if repeat >= 2:  # two warm-up rounds
                    times[name][index].append(clock() - start)
    exactness = replay_check(model, hooks, routing, ids, mask, width)
    hooks.remove()
    result = {"shape": shape, "device": device, "dtype": str(dtype).removeprefix("torch."), "rows": rows,
              "length": length, "parameters": sum(p.numel() for p in model.parameters()), "repeats": repeats,
              "layers": routing.experts.size(0), "top_k": routing.experts.size(2), "replay_check": exactness,
              "arms": {}}  # fmt: skip
    for name, (plain, hooked) in times.items():
        plain_s, hooked_s = statistics.median(plain), statistics.median(hooked)
        result["arms"][name] = {"plain_s": plain_s, "hooked_s": hooked_s, "timed": len(plain),
                                "overhead_percent": 100 * (hooked_s - plain_s) / plain_s}  # fmt: skip
    if device == "cuda":
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    return result


def row(k, seed, flip, ratios) -> str:
    means = " / ".join(f"{r.mean():.4f}" for r in ratios)
    tails = " / ".join(f"{torch.quantile(r, 0.99):.4f}" for r in ratios)
    return f"| {k} | {seed} | {flip:.4f} | {means} | {tails} |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--generation-batches", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30, help="timed repeats of each overhead arm")
    parser.add_argument("--overhead-hidden", type=int, nargs="+", default=None,
                        help="model widths timed with --overhead-shape tiny (default: 64 256)")
    parser.add_argument("--expert-scale", type=float, default=1.0, help="multiply the experts' initial weights")
    parser.add_argument("--train", action="store_true", help="the training comparison (GRPO / DHPO-E x none / old)")
    parser.add_argument("--train-batches", type=int, default=6, help="generation batches per training run")
    parser.add_argument("--json", help="write the results here (--train: every run's; else the overhead's)")
    parser.add_argument("--summarise", metavar="JSON", help="print the --train table of a --json file, and stop")
    parser.add_argument("--overhead-only", action="store_true", help="the overhead alone (no drift cells)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the overhead is timed")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the timed model's")
    parser.add_argument("--overhead-shape", choices=sorted(OVERHEAD_SHAPES), default="tiny",
                        help="tiny (at each --overhead-hidden) or Qwen3-30B-A3B's layers, 4 of them (a GPU's)")
    parser.add_argument("--overhead-rows", type=int, default=32, help="sequences in the timed batch")
    parser.add_argument("--overhead-length", type=int, default=32, help="tokens per timed sequence")
    options = parser.parse_args(argv)
    if reason := unused_options(options):
        parser.error(reason)
    options.overhead_hidden = options.overhead_hidden or [64, 256]
    if options.summarise:
        with open(options.summarise) as handle:
            print("\n".join(summary_rows(json.load(handle)["runs"])))
        return
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch; run on a GPU machine, or --device cpu")
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    if options.overhead_only:
        overhead_figures(options, tokenizer)
        return
    if options.train:
        print(f"tiny Qwen3-MoE, experts x{options.expert_scale}, Adam lr {options.learning_rate}, "
              f"{options.train_batches} generation batches of 16 prompts x 8 samples x (8 + 16) tokens, 1 thread")
        runs = train_comparison(options, tokenizer)
        if options.json:
            with open(options.json, "w") as handle:
                json.dump({"options": vars(options), "runs": runs}, handle, indent=1)
        print("\n".join(summary_rows(runs)))
        return
    print(f"tiny Qwen3-MoE (2 layers, 4 experts, top-2), CPU {platform.processor() or platform.machine()}, 1 thread, "
          f"experts x{options.expert_scale}, Adam lr {options.learning_rate}, {options.generation_batches} "
          "generation batches of 32 x (8 + 24) tokens")  # fmt: skip
    print("abs log r over the completion tokens of each micro-batch before its step; 'live': the live-routing run; "
          "'replayed': the same weights with pi_old's routing forced (measured only); 'R2 run': trained with replay")
    print("| k | seed | flip fraction, live run | mean abs log r: live / replayed / R2 run | "
          "p99 abs log r: live / replayed / R2 run |")
    print("|---|---|---|---|---|")
    arms = ("none", "forced", "old")
    for k in options.ks:
        pooled = {name: [] for name in arms}
        for seed in options.seeds:
            r = cell(k, seed, options.learning_rate, tokenizer, options.generation_batches, options.expert_scale)
            for name in arms:
                pooled[name].append(r[name]["ratios"])
            pooled.setdefault("flip", []).append(r["none"]["flip"])
            print(row(k, seed, r["none"]["flip"], [r[name]["ratios"] for name in arms]))
        print(row(k, "all", statistics.mean(pooled["flip"]), [torch.cat(pooled[name]) for name in arms]))
    overhead_figures(options, tokenizer)


def unused_options(options) -> str | None:
    """Why a combination of options would leave one of them without effect (None: every option given acts)."""
    modes = [name for name, on in (("--summarise", options.summarise), ("--train", options.train),
                                   ("--overhead-only", options.overhead_only)) if on]  # fmt: skip
    if len(modes) > 1:
        return f"{' and '.join(modes)} are separate runs: give one of them"
    if options.summarise and options.json:
        return "--json writes a run's results; --summarise only reads a file: drop --json"
    if options.repeats < 0 or (options.overhead_only and options.repeats < 1):
        return "--repeats must be >= 1 with --overhead-only (>= 0 otherwise: 0 skips the overhead)"
    timing = {"--device": options.device != "cpu", "--dtype": options.dtype != "float32",
              "--overhead-shape": options.overhead_shape != "tiny", "--overhead-hidden": options.overhead_hidden,
              "--overhead-rows": options.overhead_rows != 32, "--overhead-length": options.overhead_length != 32}
    timed = not (options.train or options.summarise) and options.repeats > 0
    if not timed and (given := [name for name, on in timing.items() if on]):
        return (f"{', '.join(given)} set the overhead timing, which {modes[0] if modes else '--repeats 0'} does not "
                "run: drop them")  # fmt: skip
    if options.overhead_rows < 1 or options.overhead_length < 9:
        return "--overhead-rows must be >= 1 and --overhead-length >= 9 (a prompt of 8 tokens and a completion)"
    if options.overhead_hidden and options.overhead_shape != "tiny":
        return f"--overhead-hidden sets the tiny model's width: --overhead-shape {options.overhead_shape} has its own"
    return None


def overhead_figures(options, tokenizer) -> None:
    """The overhead lines, one per width (tiny) or the one shape; `--json`: written there too."""
    results = []
    dtype = getattr(torch, options.dtype)
    for hidden in (options.overhead_hidden if options.overhead_shape == "tiny" else [None]) if options.repeats else []:
        result = overhead(tokenizer, options.repeats, hidden, options.device, dtype, options.overhead_shape,
                          options.overhead_rows, options.overhead_length)  # fmt: skip
        results.append(result)
        for name, arm in result["arms"].items():
            print(f"overhead, {options.overhead_shape}{f' hidden {hidden}' if hidden else ''} ({options.device}, "
                  f"{result['dtype']}), {name}: {1e3 * arm['plain_s']:.2f} ms plain, {1e3 * arm['hooked_s']:.2f} ms "
                  f"with {'replay' if name == 'update' else 'record'}: {arm['overhead_percent']:+.1f}% (median "
                  f"{'CPU' if options.device == 'cpu' else 'synchronised wall'} time)")  # fmt: skip
    if options.json:
        with open(options.json, "w") as handle:
            json.dump({"options": vars(options), "overhead": results}, handle, indent=1)
    for result in results:  # the figures are kept above; a replay that ran other experts fails the run
        check = result["replay_check"]
        if check["differing"]:
            raise SystemExit(f"routing replay, {result['shape']} ({result['device']}, {result['dtype']}): the replayed "
                             f"pass ran other experts than recorded on {check['differing']} of {check['decisions']} "
                             "token-layer decisions")  # fmt: skip

if __name__ == "__main__":
    main()
