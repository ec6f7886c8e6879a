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
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch

from dhpo_trl.core.objectives import get_objective
from dhpo_trl.core.presets import config_for
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
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


def overhead(tokenizer, repeats: int, hidden: int):
    """CPU time of the update and of the pi_old pass, plain and with the hooks, interleaved."""
    model = build_tiny_qwen3(tokenizer, moe=True, seed=0, hidden_size=hidden)
    hooks = rr.RoutingReplay(model)
    ids, mask, width = sample_batch(model, tokenizer, 32, 24, 0)
    with torch.no_grad(), hooks.record() as out:
        token_logps(model, ids, mask, width)
    routing = out[0]

    def update(context):
        with context:
            loss = token_logps(model, ids, mask, width).mean()
        loss.backward()
        model.zero_grad()

    def old_pass(context):
        with torch.no_grad(), context:
            token_logps(model, ids, mask, width)

    import contextlib

    arms = {"update": (lambda: update(contextlib.nullcontext()), lambda: update(hooks.replay(routing))),
            "pi_old pass": (lambda: old_pass(contextlib.nullcontext()), lambda: old_pass(hooks.record()))}  # fmt: skip
    times = {name: ([], []) for name in arms}
    for repeat in range(repeats + 2):
        for name, (plain, hooked) in arms.items():
            order = [(0, plain), (1, hooked)] if repeat % 2 == 0 else [(1, hooked), (0, plain)]
            for index, run in order:
                start = time.process_time()
                run()
                if repeat >= 2:  # two warm-up rounds
                    times[name][index].append(time.process_time() - start)
    return {name: (statistics.median(p), statistics.median(h)) for name, (p, h) in times.items()}


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
    parser.add_argument("--overhead-hidden", type=int, nargs="+", default=[64, 256], help="model widths timed")
    parser.add_argument("--expert-scale", type=float, default=1.0, help="multiply the experts' initial weights")
    parser.add_argument("--train", action="store_true", help="the training comparison (GRPO / DHPO-E x none / old)")
    parser.add_argument("--train-batches", type=int, default=6, help="generation batches per training run")
    parser.add_argument("--json", help="--train: write every run's results here")
    parser.add_argument("--summarise", metavar="JSON", help="print the --train table of a --json file, and stop")
    options = parser.parse_args(argv)
    if options.summarise:
        with open(options.summarise) as handle:
            print("\n".join(summary_rows(json.load(handle)["runs"])))
        return
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
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
    for hidden in options.overhead_hidden if options.repeats else []:
        for name, (plain, hooked) in overhead(tokenizer, options.repeats, hidden).items():
            print(f"overhead, hidden {hidden}, {name}: {1e3 * plain:.2f} ms plain, {1e3 * hooked:.2f} ms with "
                  f"{'replay' if name == 'update' else 'record'}: {100 * (hooked - plain) / plain:+.1f}% "
                  "(median CPU time)")


if __name__ == "__main__":
    main()
