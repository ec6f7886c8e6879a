"""Staleness study: how each objective copes as the policy drifts further from the one that sampled.

    python benchmarks/staleness.py --ks 2 4 8 16 --seeds 0 1 2 --generation-batches 24 --workers 2
    python benchmarks/staleness.py --task long ...   # long completions: docs/study/long_completions.md has the command

Every cell (objective, k, seed) is `dhpo_trl.demo.embedded.run_embedded` on the warm-started tiny Qwen3 and synthetic
addition. One generation batch (32 prompts x 8 completions) is split into k optimizer steps (TRL's
`steps_per_generation = k`, each completion used once), so step j of a batch updates a policy j - 1 steps away
from pi_old: k is the staleness. Every cell has the same prompts (the sampler's seed), the same first sampled
batch, the same learning rate and the same number of generation batches; k only changes how finely each batch is
cut, and so how far pi_theta drifts before the next batch is sampled. Held-out accuracy is measured every
`--eval-every` generation batches.

Finished cells are kept in `--out-dir/k<k>/<objective>-seed<seed>/summary.json` and reused, so an interrupted sweep
resumes; a cell saved with other settings is run again. Writes `--docs-dir/staleness.md` (tables and the verdict),
`staleness.json` (every cell and the aggregates) and two plots.

`--task long` runs the same cells on chained arithmetic with a scratchpad (`dhpo_trl.demo.long_task`, completions of
30-400 tokens) and writes `long_completions.md` / `.json` instead; `--reference-seeds` adds two-digit-task cells at
each k > 1 to compare the within-sequence spread of log r against. Cells run per k in `--ks` order, so a study
stopped early has whole k's; `--report-only` writes the page from the finished cells and names the missing ones.
`--final-heldout N` (long task) also scores each cell's final policy on N further held-out problems and writes
`long_completions_power.md` / `.json`: the final accuracy on them, the separation rule, a second reading on the
difference of means (the seeds a 3-point gap needs, the pairs it calls), and the seed noise split into evaluation and
training noise (`benchmarks/power_study.sh` runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import multiprocessing
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

from dhpo_trl.core.presets import PAPER_ALGORITHMS
from dhpo_trl.demo.cell_pool import Cell, cell_pool, reported
from dhpo_trl.demo.embedded import EmbeddedSettings, load_task, run_embedded, write_atomically
from dhpo_trl.demo.long_arithmetic import make_chain_splits
from dhpo_trl.demo.long_task import LongSettings
from dhpo_trl.user_errors import DEBUG_FLAG, DEBUG_HELP, debug_given, repeated_values, seed_int

TASKS = {"addition": EmbeddedSettings, "long": LongSettings}  # --task: the settings class of each embedded task

OBJECTIVES = ["GRPO", "GSPO", "GMPO", "CISPO", "DHPO-A", "DHPO-E"]
# Rows beyond the paper's, as (preset, DHPOConfig fields on top). The DHPO presets follow the paper's equations,
# without the dual clip that VERL's GRPO applies to A < 0 (ratio capped at delta = 3); this row adds it to DHPO-E.
# "DHPO-E+GSPO-seq-clip" tests why DHPO-E drifts at high k: its entropy weight puts ~90% on the sequence ratio, whose
# 0.2/0.28 clip rarely binds; this row gives the sequence branch GSPO's trust region (3e-4 / 4e-4) instead.
VARIANTS = {
    # TRL 1.16's SAPO (soft gate instead of a clip, TRL's default temperatures), DHPO's nearest rival.
    "SAPO": ("GRPO", {"algorithm": "sapo", "epsilon_high": None, "delta": None}),
    "DHPO-E+dual-clip": ("DHPO-E", {"delta": 3.0}),
    "DHPO-E+GSPO-seq-clip": ("DHPO-E", {"epsilon_low_seq": 3e-4, "epsilon_high_seq": 4e-4}),
}
# Per-branch clip fractions: the first of these metrics that the row logs (DHPO's per-branch ones before TRL's
# `clip_ratio/*`, which DHPO also logs for its mixed ratio), averaged over all optimizer steps of the cell.
CLIP_METRICS = {
    "token low": ("dhpo/clip_fraction/token_low", "clip_ratio/low_mean"),
    "token high": ("dhpo/clip_fraction/token_high", "clip_ratio/high_mean", "cispo_clip_ratio"),
    "sequence low": ("dhpo/clip_fraction/sequence_low",),
    "sequence high": ("dhpo/clip_fraction/sequence_high",),
}
SPREAD_MEASURES = ("last_step_log_ratio_spread", "last_step_abs_sequence_log_ratio")
COLLAPSE_FRACTION = 0.25  # entropy "collapsed": the last tenth of steps below this share of the first step's


def cell_settings(k: int, generation_batches: int, eval_every: int, learning_rate: float,
                  task: str = "addition") -> dict:  # fmt: skip
    """The `run_embedded` arguments of one cell: `k` optimizer steps per generation batch."""
    settings = dataclasses.replace(TASKS[task](), steps_per_generation=k, learning_rate=learning_rate)
    settings.per_device_train_batch_size()  # early error if k does not divide the generation batch
    return {"settings": settings, "max_steps": generation_batches * k, "eval_every": eval_every * k}


def _cell_dir(job: tuple) -> Path:
    objective, k, seed, out_dir, *_ = job
    return Path(out_dir) / f"k{k}" / f"{objective}-seed{seed}"


def _saved(job: tuple) -> dict | None:
    """The cell's saved summary if it was run with exactly this job's settings, else None (to run)."""
    objective, k, seed, out_dir, generation_batches, eval_every, learning_rate, task, final_heldout = job
    summary_path = _cell_dir(job) / "summary.json"
    if not summary_path.exists():
        return None
    spec = cell_settings(k, generation_batches, eval_every, learning_rate, task)
    expected = {**dataclasses.asdict(spec["settings"]), "max_steps": spec["max_steps"], "eval_every": spec["eval_every"]}
    summary = json.loads(summary_path.read_text())
    overrides = VARIANTS.get(objective, (objective, {}))[1]
    # A setting the cell's summary lacks was added to the task after the cell ran: the code that ran it acted as its
    # default does, so a cell matches if the setting is at its default in this job.
    defaults = dataclasses.asdict(type(spec["settings"])())
    saved = {**{key: value for key, value in defaults.items() if key not in summary["settings"]}, **summary["settings"]}
    same = json.loads(json.dumps(saved)) == json.loads(json.dumps(expected))  # as saved: tuples read back as lists
    final = summary.get("final_heldout")
    same_final = (final or {}).get("num_problems") == final_heldout  # a cell without the final set is run again
    # A run a stop signal cut short wrote a summary before run_embedded refused to: never a finished cell.
    finished = summary.get("optimizer_steps") == spec["max_steps"]
    return summary if same and same_final and finished and summary.get("config_overrides", {}) == overrides else None


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (user + system)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _run_cell(job: tuple) -> tuple[tuple, dict, bool]:
    objective, k, seed, out_dir, generation_batches, eval_every, learning_rate, task, final_heldout = job
    if (summary := _saved(job)) is not None:
        return (objective, k, seed), summary, True
    preset, overrides = VARIANTS.get(objective, (objective, {}))
    spec = cell_settings(k, generation_batches, eval_every, learning_rate, task)
    started = _cpu_seconds()
    summary = run_embedded(preset, seed=seed, output_dir=_cell_dir(job), disable_tqdm=True, config_overrides=overrides,
                           final_heldout=final_heldout, **spec)  # fmt: skip
    # Saved with the cell, so that a resumed study still sums the CPU time of every cell.
    summary["cpu_seconds"] = round(_cpu_seconds() - started, 1)
    write_atomically(Path(summary["summary_path"]), json.dumps(summary, indent=2))
    return (objective, k, seed), summary, False


def cell_metrics(log_history: list[dict], k: int) -> dict:
    """The study's measures of one cell, from its trainer log history (one entry per optimizer step, plus evals)."""
    steps = [e for e in log_history if "loss" in e]
    evals = [(e["step"], e["eval/heldout_accuracy"]) for e in log_history if "eval/heldout_accuracy" in e]
    accuracies = [a for _, a in evals]
    # Area under the accuracy curve, over generation batches, divided by their number: the mean accuracy of the run
    # (trapezoids between evaluations), so 1.0 means perfect from the first batch on.
    area = sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in itertools.pairwise(evals))
    entropy = [e["entropy"] for e in steps]
    tail = entropy[-max(1, len(entropy) // 10) :]

    def mean_of(*keys, last_steps=False):
        key = next((key for key in keys if any(key in e for e in steps)), None)
        values = [e[key] for e in steps
                  if key in e and math.isfinite(e[key]) and (not last_steps or e["step"] % k == 0)]  # fmt: skip
        return statistics.fmean(values) if values else None

    return {
        "final_accuracy": accuracies[-1],
        "peak_accuracy": max(accuracies),
        "auc": area / (evals[-1][0] - evals[0][0]),
        "end_entropy": statistics.fmean(tail),
        "collapsed": statistics.fmean(tail) < COLLAPSE_FRACTION * entropy[0],
        # How off-policy the updates really were: pi_theta vs pi_old on the last step of each generation batch.
        "last_step_abs_log_ratio": statistics.fmean(e["off_policy/abs_log_ratio"] for e in steps if e["step"] % k == 0),
        # How far token ratios spread around their sequence ratio (std_t log r_t, mean over sequences) and how far
        # the sequence ratio itself moved (|log s|), on the same last steps; None in logs written without them.
        "last_step_log_ratio_spread": mean_of("off_policy/log_ratio_spread", last_steps=True),
        "last_step_abs_sequence_log_ratio": mean_of("off_policy/abs_sequence_log_ratio", last_steps=True),
        "completion_length": mean_of("completions/mean_length"),
        "clip": {branch: mean_of(*keys) for branch, keys in CLIP_METRICS.items()},
        "mixing_weight_mean": mean_of("dhpo/mixing_weight/mean"),
        "mixing_weight_std": mean_of("dhpo/mixing_weight/std"),
        "curve": evals,
    }


def final_metrics(summary: dict) -> dict:
    """The cell's accuracy on the final held-out set (`--final-heldout`), its size, its per-problem 0/1 string and
    the warm start it started from; empty for a cell run without the set."""
    final = summary.get("final_heldout")
    if not final:
        return {}
    return {"final_heldout_accuracy": final["accuracy"], "final_heldout_problems": final["num_problems"],
            "final_heldout_correct": final["correct"], "warm_start_key": summary.get("warm_start_key"),
            "cpu_seconds": summary.get("cpu_seconds")}  # fmt: skip


def _mean_std(values: list[float]) -> list[float]:
    return [statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0]


def aggregate(cells: dict[tuple, dict]) -> dict[str, dict[int, dict]]:
    """objective -> k -> mean and std over seeds of every scalar measure (None where the row has none)."""
    table: dict[str, dict[int, dict]] = {}
    for (objective, k), group in itertools.groupby(sorted(cells), key=lambda key: key[:2]):
        runs = [cells[key] for key in group]
        row = {"seeds": len(runs), "collapsed": sum(r["collapsed"] for r in runs)}
        for name in ("final_accuracy", "final_heldout_accuracy", "peak_accuracy", "auc", "end_entropy", "last_step_abs_log_ratio",
                     "mixing_weight_mean", "mixing_weight_std", "completion_length", *SPREAD_MEASURES):  # fmt: skip
            values = [r[name] for r in runs if r.get(name) is not None]
            row[name] = _mean_std(values) if values else None
        row["clip"] = {b: (_mean_std(v) if (v := [r["clip"][b] for r in runs if r["clip"][b] is not None]) else None)
                       for b in CLIP_METRICS}  # fmt: skip
        table.setdefault(objective, {})[k] = row
    return table


def separations(table: dict[str, dict[int, dict]], measure: str = "final_accuracy") -> dict[int, list[tuple]]:
    """Per k, every pair (better, worse, gap, threshold) whose mean gap exceeds twice the larger seed std."""
    found = {}
    for k in sorted({k for rows in table.values() for k in rows}):
        pairs = []
        for a, b in itertools.permutations(table, 2):
            # a row needs two seeds to have a noise; a study stopped early may lack a row at this k
            if any(k not in table[o] or table[o][k]["seeds"] < 2 for o in (a, b)):
                continue
            (ma, sa), (mb, sb) = table[a][k][measure], table[b][k][measure]
            threshold = 2 * max(sa, sb)
            if ma - mb > threshold:
                pairs.append((a, b, ma - mb, threshold))
        found[k] = pairs
    return found


def _fmt(cell, percent=True, digits=3):
    if cell is None:
        return "—"
    mean, std = cell
    return f"{mean:.1%} ± {std:.1%}" if percent else f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown(table, meta: dict) -> str:
    ks = sorted({k for rows in table.values() for k in rows})
    head = "| objective | " + " | ".join(f"k = {k}" for k in ks) + " |"
    rule = "|---|" + "---|" * len(ks)

    def grid(title, render):
        return [f"**{title}**", "", head, rule] + [
            f"| {o} | " + " | ".join(render(table[o][k]) if k in table[o] else "—" for k in ks) + " |" for o in table
        ] + [""]  # fmt: skip

    lines = [
        "# Staleness study: which objective holds as updates go off-policy",
        "",
        "**Small-scale study on the embedded CPU task, not the paper's experiment**: the warm-started tiny Qwen3",
        f"(dhpo_trl.demo.tiny, {meta['parameters']:,} parameters) on synthetic two-digit addition, completions of at most",
        f"{meta['max_completion_length']} tokens, reward 1/0 from math-verify. Each generation batch (32 prompts x 8",
        "completions) is split into k optimizer steps, every completion used once, so the last step of a batch updates a",
        "policy k - 1 steps away from the one that sampled. Same prompts, same first batch, same learning rate",
        f"({meta['learning_rate']:g}, Adam, constant) and {meta['generation_batches']} generation batches in every cell; held-out",
        f"accuracy (greedy, {meta['num_heldout']} problems) every {meta['eval_every']} generation batches. Mean ± sample std",
        f"over {meta['seeds']} seeds; dynamic batching on. Produced on {meta['machine']} ({meta['cell_minutes']:.0f} min summed "
        "over the cells, which the command resumes from `outputs/staleness/` when run again), with the code at commit "
        f"{', '.join(meta['commits'])}, by:",
        "",
        "```bash",
        meta["command"],
        "```",
        "",
    ]
    lines += grid("Final held-out accuracy", lambda c: _fmt(c["final_accuracy"]))
    lines += grid("Peak held-out accuracy", lambda c: _fmt(c["peak_accuracy"]))
    lines += grid("Area under the accuracy curve (mean accuracy over the run)", lambda c: _fmt(c["auc"]))
    lines += grid("Mean |log π_θ/π_old| on the last step of each generation batch (how stale the updates were)",
                  lambda c: _fmt(c["last_step_abs_log_ratio"], percent=False))  # fmt: skip
    lines += grid("Entropy at the end (mean of the last tenth of steps); runs collapsed below "
                  f"{COLLAPSE_FRACTION:.0%} of the first step's entropy",
                  lambda c: f"{_fmt(c['end_entropy'], percent=False)} ({c['collapsed']}/{c['seeds']})")  # fmt: skip
    lines += grid("Clip fractions per branch, token low / token high / sequence low / sequence high (CISPO: capped "
                  "share of A > 0 tokens, as token high)",
                  lambda c: " / ".join("—" if v is None else f"{v[0]:.3f}" for v in c["clip"].values()))  # fmt: skip
    dhpo = {o: rows for o, rows in table.items() if o.startswith("DHPO")}
    lines += ["**DHPO mixing weight w (token mean, and its std within a step)**", "", head, rule]
    for o, rows in dhpo.items():
        cells = [f"{_fmt(rows[k]['mixing_weight_mean'], False)}; std {_fmt(rows[k]['mixing_weight_std'], False)}"
                 if k in rows else "—" for k in ks]  # fmt: skip
        lines.append(f"| {o} | " + " | ".join(cells) + " |")
    lines += ["", "![final accuracy against k](staleness_accuracy.png) "
              f"![held-out accuracy curves at k = {ks[-1]}](staleness_curves.png)", ""]  # fmt: skip
    lines += ["## What separates", "", summary(table) + " " + drift(table), "", verdict(table), ""]
    if text := variant_verdict(table):
        lines += ["## Does a tighter sequence clip explain DHPO-E at high k?", "", text, ""]
    lines += AT_SCALE.splitlines()
    return "\n".join(lines)


AT_SCALE = """A second way to raise the drift, a 4x higher learning rate, was not swept here for lack of CPU time;
`python benchmarks/staleness.py --learning-rate 8e-4 --out-dir outputs/staleness_lr8e-4 --docs-dir
docs/study/lr8e-4` runs it.

## What this task cannot show, and the run that can

Three properties of this task limit how far the objectives can separate here. **Completion length**: with at most 12
tokens, the sequence ratio s_i (the geometric mean of a dozen token ratios) stays close to every token ratio, so
the token, sequence and mixed ratios hardly differ, and neither do their clips; the paper's argument is about
long, variable-length responses (up to 4096 tokens), where one sequence ratio averages hundreds of noisy token
ratios. **Model size**: a 0.3M-parameter policy changes little per step, so even k = 16 keeps |log r| small (the
table above) and the trust regions rarely bind. **Reward sparsity**: a binary reward on a task the warm start
half solves gives many groups with a useful spread; the separation the paper reports comes from hard problems where
most groups are all-wrong and a few long successes carry the signal. To see where each objective breaks, run the
same sweep on the paper's 1.7B recipe, one 8-GPU node per run. The generation batch is the recipe's 512 prompts,
so k = 512 / `prompts_per_optimizer_step`, and every cell gets the same 100 generation batches (`max_steps` =
100 k). The cell GSPO, k = 16, seed 0:

```bash
bash examples/vllm_server/serve_and_train_single_node.sh --overlay examples/recipes/algorithms/gspo.yaml \\
    --prompts_per_optimizer_step 32 --max_steps 1600 --seed 0 --output_dir outputs/staleness_1.7b/k16/gspo-seed0
```

For k = 2, 4, 8 set `prompts_per_optimizer_step` to 256, 128, 64 and `max_steps` to 200, 400, 800; the other rows
take their overlay from `examples/recipes/algorithms/` (DHPO-E is the recipe itself, without `--overlay`); seeds 0,
1, 2. Each run logs the same measures as this study (`off_policy/abs_log_ratio`, `dhpo/clip_fraction/*`,
`clip_ratio/*`, `dhpo/mixing_weight/*`, `entropy`); `dhpo-evaluate` on the saved checkpoints gives the accuracies.
"""


def first_fall(table, measure: str = "final_accuracy") -> dict[str, int | None]:
    """Per objective, the smallest k at which another objective beats it by more than twice the seed noise."""
    fallen: dict[str, int | None] = {objective: None for objective in table}
    for k, pairs in separations(table, measure).items():
        for _, worse, _, _ in pairs:
            if fallen[worse] is None:
                fallen[worse] = k
    return fallen


def summary(table) -> str:
    """One plain paragraph: which objectives hold at every k, and from which k the others fall behind."""
    sentences = []
    for measure, name in (("final_accuracy", "final accuracy"), ("auc", "area under the accuracy curve")):
        fallen = first_fall(table, measure)
        hold = [o for o, k in fallen.items() if k is None]
        behind = [f"{o} from k = {k}" for o, k in sorted(fallen.items(), key=lambda item: item[1] or 0) if k]
        quiet = [k for k, pairs in separations(table, measure).items() if not pairs]
        sentences.append(
            f"On {name}, "
            + (f"no objective is behind another by more than twice the seed noise at k = {', '.join(map(str, quiet))}"
               if quiet else "some objective is behind another by more than twice the seed noise at every k")
            + (f"; {', '.join(hold)} {'stays' if len(hold) == 1 else 'stay'} within it of the best at every k"
               if hold else "")  # fmt: skip
            + (f"; falling behind: {', '.join(behind)}" if behind else "")
            + "."
        )
    return " ".join(sentences)


def drift(table) -> str:
    """How far each objective let pi_theta drift at the largest k, and how much of DHPO-E rides on the sequence ratio."""
    k = max(k for rows in table.values() for k in rows)
    ratios = {o: rows[k]["last_step_abs_log_ratio"][0] for o, rows in table.items() if k in rows}
    ranked = ", ".join(f"{o} {v:.3f}" for o, v in sorted(ratios.items(), key=lambda item: item[1]))
    text = f"At k = {k}, the mean |log r| on the last step of each generation batch ranks {ranked}."
    if "DHPO-E" in table and k in table["DHPO-E"] and "GRPO" in ratios:
        row = table["DHPO-E"][k]
        text += (
            f" DHPO-E's entropy weight puts a mean w = {row['mixing_weight_mean'][0]:.2f} on the token ratio, so"
            f" {1 - row['mixing_weight_mean'][0]:.0%} of its mixed ratio is the sequence ratio, whose clip binds on"
            f" {row['clip']['sequence low'][0] + row['clip']['sequence high'][0]:.1%} of tokens there; its drift is"
            f" {ratios['DHPO-E'] / ratios['GRPO']:.1f}x GRPO's, whose clip acts on every token."
        )
    return text


def variant_verdict(table, variant: str = "DHPO-E+GSPO-seq-clip", reference: str = "GRPO") -> str:
    """Whether giving DHPO-E's sequence branch GSPO's trust region closes DHPO-E's gap to `reference` at k >= 8.

    Same rule as everywhere on the page: a gap counts only above twice the larger seed std of the two rows."""
    if not {variant, "DHPO-E", reference} <= set(table):
        return ""
    sentences = []
    rows = (table["DHPO-E"], table[variant], table[reference])
    for k in sorted(k for k in table["DHPO-E"] if k >= 8 and all(k in r and r[k]["seeds"] >= 2 for r in rows)):
        parts = []
        for measure, name in (("final_accuracy", "final accuracy"), ("auc", "area under the curve")):
            ref = table[reference][k][measure]
            gaps = {}
            for row in ("DHPO-E", variant):
                mean, std = table[row][k][measure]
                gaps[row] = (ref[0] - mean, 2 * max(ref[1], std))
            (gap_e, thr_e), (gap_v, thr_v) = gaps["DHPO-E"], gaps[variant]
            if gap_e <= thr_e:
                reading = "DHPO-E has no gap to close"
            elif gap_v <= thr_v:
                reading = "the tighter sequence clip closes the gap"
            else:
                reading = "the tighter sequence clip does not close the gap"
            def lead(gap):  # the reference's lead over a row; a negative lead reads as trailing it
                return f"{'leads' if gap >= 0 else 'trails'} {{}} by {abs(gap):.1%}"

            parts.append(
                f"on {name} {reference} " + lead(gap_e).format("DHPO-E") + f" (2 std = {thr_e:.1%}) and "
                + lead(gap_v).format(variant) + f" (2 std = {thr_v:.1%}): {reading}"
            )
        drift_of = {row: table[row][k]["last_step_abs_log_ratio"][0] for row in ("DHPO-E", variant, reference)}
        sentences.append(
            f"At k = {k}, " + "; ".join(parts) + f". Mean |log r| on the last step of a generation batch: {variant} "
            f"{drift_of[variant]:.3f}, DHPO-E {drift_of['DHPO-E']:.3f}, {reference} {drift_of[reference]:.3f}."
        )
    return " ".join(sentences)


def verdict(table) -> str:
    """The plain-language reading of the final-accuracy and area tables against twice the seed noise."""
    sentences = []
    for measure, name in (("final_accuracy", "Final held-out accuracy"), ("auc", "Area under the accuracy curve")):
        found = separations(table, measure)
        noise = statistics.fmean(row[measure][1] for rows in table.values() for row in rows.values())
        parts = []
        for k, pairs in found.items():
            means = {o: table[o][k][measure][0] for o in table if k in table[o]}
            spread = max(means.values()) - min(means.values())
            if pairs:
                listed = "; ".join(f"{a} > {b} by {gap:.1%} (2 std = {t:.1%})" for a, b, gap, t in pairs)
                parts.append(f"at k = {k} the means span {spread:.1%}, and these pairs separate: {listed}")
            else:
                parts.append(f"at k = {k} they span {spread:.1%} and no pair differs by more than twice its seed noise")
        sentences.append(
            f"{name}, pair by pair, counting a difference only where the gap between two objectives' means exceeds "
            f"twice the larger of their seed standard deviations (typical std {noise:.1%}): " + "; ".join(parts) + "."
        )
    return "\n\n".join(sentences)


def plot(table, out_dir: Path, name: str = "staleness_accuracy.png") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({k for rows in table.values() for k in rows})
    figure, axis = plt.subplots(figsize=(6, 4))
    for objective, rows in table.items():
        present = [k for k in ks if k in rows]
        axis.errorbar(present, [rows[k]["final_accuracy"][0] for k in present],
                      yerr=[rows[k]["final_accuracy"][1] for k in present], marker="o", capsize=3, label=objective)  # fmt: skip
    axis.set(xscale="log", xlabel="optimizer steps per generation batch (k)", ylabel="final held-out accuracy")
    axis.set_xticks(ks, [str(k) for k in ks])
    axis.minorticks_off()  # the log axis would label 3, 6, ... too
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out_dir / name, dpi=100)
    plt.close(figure)


def plot_curves(cells: dict[tuple, dict], k: int, out_dir: Path, name: str = "staleness_curves.png") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for objective in [*OBJECTIVES, *VARIANTS]:
        curves = [c["curve"] for (o, kk, _), c in cells.items() if o == objective and kk == k]
        if curves:
            steps = [s / k for s, _ in curves[0]]
            axis.plot(steps, [statistics.fmean(c[i][1] for c in curves) for i in range(len(steps))], label=objective)
    axis.set(xlabel="generation batch", ylabel="held-out accuracy (mean over seeds)", title=f"k = {k}")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out_dir / name, dpi=100)
    plt.close(figure)


def long_meta(args, summaries: dict[tuple, dict], missing: list[tuple]) -> dict:
    """What the long-completion page states beyond the staleness page: the task, the lengths it teaches, the CPU
    time of every cell, the reference cells' settings and the cells not yet run."""
    from dhpo_trl.demo.tiny import build_char_tokenizer

    settings = TASKS[args.task]()
    _, heldout = make_chain_splits(settings.num_train, settings.num_heldout, seed=0, lengths=settings.lengths())
    tokenizer = build_char_tokenizer()
    lengths = sorted(len(tokenizer(p.target_completion())["input_ids"]) + 1 for p in heldout)  # + end of text
    cpu = [s["cpu_seconds"] for s in summaries.values() if "cpu_seconds" in s]
    return {
        "task": args.task,
        "settings": dataclasses.asdict(settings),
        "taught_lengths": {"min": lengths[0], "median": statistics.median(lengths),
                           "p90": lengths[int(0.9 * (len(lengths) - 1))], "max": lengths[-1]},  # fmt: skip
        "cpu_minutes": sum(cpu) / 60,
        "cells_without_cpu_time": len(summaries) - len(cpu),
        "reference": {"task": "addition", "seeds": args.reference_seeds, "generation_batches": args.generation_batches},
        "on_policy_objectives": args.on_policy_objectives if 1 in args.ks else None,
        "missing": [f"{task} {o} k={k} seed {seed}" for o, k, seed, *_, task, _ in missing],
    }


def _relative_spread(row: dict) -> list[float] | None:
    """Mean within-sequence spread over mean |log s| (means over seeds): how far the token ratios stray from a
    sequence ratio, in units of how far the sequence ratio itself moved."""
    spread, sequence = row.get("last_step_log_ratio_spread"), row.get("last_step_abs_sequence_log_ratio")
    return None if spread is None or not sequence or sequence[0] == 0 else [spread[0] / sequence[0], 0.0]


def spread_comparison(table, reference) -> list[str]:
    """Per objective and k > 1: the within-sequence spread of log r on this task, on the two-digit task, and their
    ratio; then mean |log s| the same way, and the spread in units of |log s|."""
    ks = sorted({k for rows in table.values() for k in rows if k > 1})
    lines = []
    measures = (
        (lambda row: row.get("last_step_log_ratio_spread"), 4,
         "Within-sequence spread of the token log-ratio, mean over sequences of std_t log r_t"),
        (lambda row: row.get("last_step_abs_sequence_log_ratio"), 4, "Sequence log-ratio, mean over sequences of |log s|"),
        (_relative_spread, 1, "Spread relative to the sequence log-ratio, the first table over the second"),
    )  # fmt: skip
    for value, digits, title in measures:
        lines += [f"**{title}, on the last step of each generation batch: this task / two-digit task (ratio)**", "",
                  "| objective | " + " | ".join(f"k = {k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]  # fmt: skip
        for objective, rows in table.items():
            cells = []
            for k in ks:
                here = value(rows[k]) if k in rows else None
                there = value(reference[objective][k]) if k in reference.get(objective, {}) else None
                if here is None:
                    cells.append("—")
                elif there is None or there[0] == 0:
                    cells.append(f"{here[0]:.{digits}f} / —")
                else:
                    cells.append(f"{here[0]:.{digits}f} / {there[0]:.{digits}f} ({here[0] / there[0]:.1f}x)")
            lines.append(f"| {objective} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def dhpo_answer(table, rows=("DHPO-E", "DHPO-A"), rivals=("GRPO", "GSPO", "SAPO")) -> str:
    """Whether a DHPO row beats GRPO, GSPO or SAPO by more than twice the seed noise, per measure and k."""
    sentences = []
    for measure, name in (("final_accuracy", "final accuracy"), ("auc", "area under the accuracy curve")):
        wins, losses, compared = [], [], set()
        for k, pairs in separations(table, measure).items():
            compared.add(k)
            for better, worse, gap, threshold in pairs:
                if better in rows and worse in rivals:
                    wins.append(f"{better} > {worse} at k = {k} by {gap:.1%} (2 std = {threshold:.1%})")
                if worse in rows and better in rivals:
                    losses.append(f"{better} > {worse} at k = {k} by {gap:.1%} (2 std = {threshold:.1%})")
        sentences.append(
            f"On {name}, " + (f"DHPO beats a rival: {'; '.join(wins)}" if wins else
                              f"no DHPO row beats {', '.join(rivals)} by more than twice the seed noise at any k")
            + (f"; a rival beats DHPO: {'; '.join(losses)}" if losses else "; no rival beats DHPO by that margin")
            + "."
        )  # fmt: skip
    return " ".join(sentences)


def long_markdown(table, meta: dict, reference) -> str:
    ks = sorted({k for rows in table.values() for k in rows})
    head = "| objective | " + " | ".join(f"k = {k}" for k in ks) + " |"
    rule = "|---|" + "---|" * len(ks)
    settings, lengths = meta["settings"], meta["taught_lengths"]

    def grid(title, render):
        return [f"**{title}**", "", head, rule] + [
            f"| {o} | " + " | ".join(render(table[o][k]) if k in table[o] else "—" for k in ks) + " |" for o in table
        ] + [""]  # fmt: skip

    seeds = sorted({row["seeds"] for rows in table.values() for row in rows.values()})
    lines = [
        "# Long completions: where the objectives can differ",
        "",
        "**Small-scale study on an embedded CPU task, not the paper's experiment.** The task (`python -m dhpo_trl "
        "--task long`, dhpo_trl/demo/long_task.py): a start (0-99) and a step (1-9) added 2 to 26 times, worked "
        "through in a written scratchpad, one line per addition with the running total, the final total boxed; each "
        "line has two free choices the reward does not check (how its label is marked, which summand comes first), "
        "taught uniformly, so that a long completion has forking tokens where the policy is genuinely uncertain; "
        "reward "
        f"1/0 from math-verify on the boxed answer. The taught completions run from {lengths['min']} to "
        f"{lengths['max']} tokens (median {lengths['median']:g}, 90th percentile {lengths['p90']}); sampled ones are "
        f"capped at {meta['max_completion_length']}. Policy: a tiny Qwen3 ({meta['parameters']:,} parameters, "
        f"{settings['num_layers']} layers, hidden size {settings['hidden_size']}) warm-started by supervised steps "
        "until it writes the whole scratchpad right for "
        f"{settings['warmup_target_accuracy']:.0%} of 100 training problems. Each generation batch "
        f"({settings['prompts_per_generation']} prompts x {settings['num_generations']} completions) is split into k "
        "optimizer steps, every completion used once; k = 1 is on-policy, where every ratio is 1, no clip or gate "
        "acts and the rows differ only in how they weight token gradients"
        + (f" (so only {', '.join(meta['on_policy_objectives'])} run there)" if meta.get("on_policy_objectives") else "")
        + f". Same prompts, learning rate ({meta['learning_rate']:g}) and "
        f"{meta['generation_batches']} generation batches in every cell; held-out accuracy (greedy, "
        f"{meta['num_heldout']} problems) every {meta['eval_every']} generation batches. Mean ± sample std over "
        f"{' or '.join(map(str, seeds))} seeds per cell. Produced on {meta['machine']} "
        f"({meta['cpu_minutes']:.0f} CPU minutes summed over the cells, two-digit reference cells included), with "
        f"the code at commit {', '.join(meta['commits'])}, by:",
        "",
        "```bash",
        meta["command"],
        "```",
        "",
    ]
    if meta["missing"]:
        lines += [f"**Incomplete: {len(meta['missing'])} cells of the command are not run yet** "
                  f"({', '.join(meta['missing'])}). Finished cells are kept: the command above runs the missing "
                  "ones, and the same command with `--report-only` rewrites this page from the finished ones.", ""]  # fmt: skip
    lines += ["## Do the ratios differ here?", ""]
    lines += spread_comparison(table, reference)
    lines += [f"The two-digit reference cells are the staleness study's task (completions of at most 12 tokens) "
              f"with seeds {meta['reference']['seeds']} and this study's learning rate, generation batches, k and "
              "objectives.", ""]  # fmt: skip
    lines += ["## Accuracy", ""]
    lines += grid("Final held-out accuracy", lambda c: _fmt(c["final_accuracy"]))
    lines += ["[long_completions_power.md](long_completions_power.md) measures the final accuracy of GRPO, GSPO, SAPO, "
              "DHPO-A and DHPO-E on a larger held-out set, and splits its seed noise into evaluation and training "
              "noise.", ""]  # fmt: skip
    lines += grid("Area under the accuracy curve (mean accuracy over the run)", lambda c: _fmt(c["auc"]))
    lines += grid("Mean |log π_θ/π_old| per token on the last step of each generation batch",
                  lambda c: _fmt(c["last_step_abs_log_ratio"], percent=False))  # fmt: skip
    lines += grid("Clip fractions per branch, token low / token high / sequence low / sequence high (CISPO: capped "
                  "share of A > 0 tokens, as token high)",
                  lambda c: " / ".join("—" if v is None else f"{v[0]:.3f}" for v in c["clip"].values()))  # fmt: skip
    lines += grid("DHPO mixing weight w on the token ratio (token mean)",
                  lambda c: _fmt(c["mixing_weight_mean"], percent=False))  # fmt: skip
    lines += grid("Mean sampled completion length (tokens)", lambda c: _fmt(c["completion_length"], False, 0))
    lines += ["![final accuracy against k](long_completions_accuracy.png) "
              f"![held-out accuracy curves at k = {ks[-1]}](long_completions_curves.png)", ""]  # fmt: skip
    lines += ["## Does DHPO beat GRPO, GSPO or SAPO?", "", dhpo_answer(table), "", verdict(table), ""]
    if text := variant_verdict(table):
        lines += ["## Does a tighter sequence clip change DHPO-E?", "", text, ""]
    lines += LONG_AT_SCALE.splitlines()
    return "\n".join(lines)


LONG_AT_SCALE = """## What this scale cannot show

A policy of a few hundred thousand parameters on a task it partly solves after minutes of supervised training: the
completions are long, but apart from the two free choices per line and the sums' digits each token is nearly
determined by the ones before it (a copy, a label), so most token ratios stay close to 1 and the trust regions bind
on few tokens. The within-sequence spread of log r is a standard deviation, not a sum: it does not grow with length,
and a two-digit completion, a dozen tokens of which a few are uncertain digits, already has as dense a share of
uncertain tokens as a scratchpad. What length changes is the sequence ratio, the mean of many token log-ratios,
which stays far closer to 1 (the |log s| table) than the token ratios around it. Few seeds and a 100-problem held-out set
make the seed noise several points, more than the 3-point differences the paper reports. Reasoning traces of a 1.7B+ model, with
real uncertainty at many positions, hard problems where most groups score 0, and thousands of tokens per answer,
are the regime of the paper's claims; docs/study/staleness.md gives the command for that sweep on the paper's
recipe.
"""


def final_set(settings: LongSettings, count: int) -> tuple[list, list]:
    """The long task's curve set and its final held-out set of `count` problems, as `run_embedded` draws them."""
    train, heldout = make_chain_splits(settings.num_train, settings.num_heldout, seed=0, lengths=settings.lengths())
    return heldout, settings.final_heldout(count, train, heldout)


def power_meta(args, summaries: dict[tuple, dict]) -> dict:
    """What the powered page states beyond the long page: the final set (size, seed, how long its chains run
    against the curve's set), the warm starts the cells started from, where the study resumes."""
    settings = TASKS[args.task]()
    heldout, final = final_set(settings, args.final_heldout)
    return {
        "final_heldout": args.final_heldout,
        "final_heldout_seed": settings.final_heldout_seed,
        "final_heldout_mean_lines": statistics.fmean(p.count for p in final),
        "heldout_mean_lines": statistics.fmean(p.count for p in heldout),
        "warm_start_keys": sorted({str(s.get("warm_start_key")) for s in summaries.values()}),
        "out_dir": str(args.out_dir),
        "ks": args.ks,
    }


def noise_table(cells: dict[tuple, dict]) -> dict[str, dict[int, dict]]:
    """objective -> k -> `seed_noise` of its seeds' final held-out scores, for rows with two seeds or more."""
    from dhpo_trl.evaluation.seed_noise import seed_noise

    table: dict[str, dict[int, dict]] = {}
    for (objective, k), group in itertools.groupby(sorted(cells), key=lambda key: key[:2]):
        correct = [cells[key]["final_heldout_correct"] for key in group]
        if len(correct) >= 2:
            table.setdefault(objective, {})[k] = seed_noise(correct)
    return table


def callable_gaps(table, noise, ks) -> list[dict]:
    """Per k: the separation rule's thresholds (2 x the larger seed std of a pair) on the final held-out accuracy,
    smallest and largest over the pairs of rows with two seeds or more, and the largest if evaluation noise were
    gone (2 x the larger training std)."""
    rows = []
    for k in ks:
        stds = sorted(table[o][k]["final_heldout_accuracy"][1] for o in table
                      if k in table[o] and table[o][k]["seeds"] >= 2)  # fmt: skip
        training = [noise[o][k]["training_std"] for o in noise if k in noise[o]]
        rows.append({"k": k, "rows": len(stds), "smallest": 2 * stds[1] if len(stds) >= 2 else None,
                     "largest": 2 * stds[-1] if len(stds) >= 2 else None,
                     "training_only": 2 * max(training) if len(training) >= 2 else None})  # fmt: skip
    return rows


RESOLVE_GAP = 0.03  # the gap in final accuracy the powered study is to resolve (3 points)


def mean_gap_threshold(s1: float, n1: int, s2: float, n2: int) -> float:
    """Twice the standard error of a difference of two means: 2 sqrt(s1^2 / n1 + s2^2 / n2), for rows of n1 and n2
    seeds with seed stds s1 and s2. Unlike a seed std, it shrinks as seeds are added."""
    return 2 * math.sqrt(s1**2 / n1 + s2**2 / n2)


def seeds_to_call(s1: float, s2: float, gap: float = RESOLVE_GAP) -> int:
    """The fewest seeds per row (the same n in both) at which `gap` exceeds `mean_gap_threshold`:
    n >= 4 (s1^2 + s2^2) / gap^2 (8 s^2 / gap^2 for equal stds), and at least 2, the fewest with a std."""
    # rounded first, so that a bound that is a whole number in exact arithmetic is not pushed up by float error
    return max(2, math.ceil(round(4 * (s1**2 + s2**2) / gap**2, 9)))


def _noisy_rows(table, k: int, measure: str) -> dict[str, tuple[float, float, int]]:
    """The rows at k with two seeds or more (a seed std), as objective -> (mean, std, seeds)."""
    return {o: (*rows[k][measure], rows[k]["seeds"]) for o, rows in table.items()
            if k in rows and rows[k]["seeds"] >= 2}  # fmt: skip


def seeds_for_gap(table, ks, measure: str = "final_heldout_accuracy", gap: float = RESOLVE_GAP) -> list[dict]:
    """Per k: the seeds each row has, and the seeds per row a difference of means needs to call `gap` at twice its
    standard error, from the rows' measured seed stds, for the pair with the smallest stds and for the pair with
    the largest (which every pair needs); None where fewer than two rows have a std."""
    found = []
    for k in ks:
        rows = _noisy_rows(table, k, measure)
        pairs = sorted(itertools.combinations(rows, 2), key=lambda pair: rows[pair[0]][1] ** 2 + rows[pair[1]][1] ** 2)
        need = {pair: seeds_to_call(rows[pair[0]][1], rows[pair[1]][1], gap) for pair in pairs}
        low, high = (pairs[0], pairs[-1]) if pairs else (None, None)
        found.append({"k": k, "seeds": sorted({n for _, _, n in rows.values()}), "smallest_pair": low,
                      "smallest": need.get(low), "largest_pair": high, "largest": need.get(high)})  # fmt: skip
    return found


def mean_separations(table, ks, measure: str = "final_heldout_accuracy") -> dict[int, list[tuple]]:
    """Per k, every pair (better, worse, gap, threshold) whose difference of means exceeds `mean_gap_threshold`
    with the seeds each row has."""
    found = {}
    for k in ks:
        rows = _noisy_rows(table, k, measure)
        found[k] = []
        for a, b in itertools.permutations(rows, 2):
            (mean_a, std_a, seeds_a), (mean_b, std_b, seeds_b) = rows[a], rows[b]
            threshold = mean_gap_threshold(std_a, seeds_a, std_b, seeds_b)
            if mean_a - mean_b > threshold:
                found[k].append((a, b, mean_a - mean_b, threshold))
    return found


def _seeded(row: dict, measure: str) -> str:
    """Mean ± seed std (seeds done); a single seed has no std to show."""
    if row["seeds"] < 2:
        return f"{row[measure][0]:.1%} (1)"
    return f"{_fmt(row[measure])} ({row['seeds']})"


def _count(value) -> str:
    return "—" if value is None else str(value)


def _points(value) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def mean_reading(table, ks, gap: float = RESOLVE_GAP) -> list[str]:
    """The power page's second reading of its final held-out accuracy, on the difference of means: the seeds a
    `gap` needs, and the pairs that difference calls with the seeds the rows have."""

    def pair(names, row_stds):
        return "—" if names is None else f"{names[0]}, {names[1]} ({', '.join(_points(row_stds[o]) for o in names)})"

    lines = [f"**A second reading, on the difference of means; it does not replace the rule above.** The rule "
             "compares a gap with the two rows' seed stds, which do not shrink as seeds are added. The difference of "
             "two rows' means has the standard error sqrt(s1²/n1 + s2²/n2), s a row's seed std and n its seeds, "
             "which does. Read against twice that error, a gap g is called with n seeds in each row once "
             "n ≥ 4(s1² + s2²)/g² (8s²/g² when both stds are s). Per k, the seeds per row a "
             f"{100 * gap:g}-point gap needs at the measured seed stds (in points), for the pair of rows with the "
             "smallest stds and for the pair with the largest (which every pair needs), next to the seeds the rows "
             "have:", "",
             "| k | seeds per row | pair with the smallest stds | seeds it needs | pair with the largest stds | "
             "seeds every pair needs |", "|---|---|---|---|---|---|"]  # fmt: skip
    for row in seeds_for_gap(table, ks, gap=gap):
        stds = {o: rows[row["k"]]["final_heldout_accuracy"][1] for o, rows in table.items() if row["k"] in rows}
        seeds = "—" if not row["seeds"] else "–".join(map(str, sorted({row["seeds"][0], row["seeds"][-1]})))
        lines.append(f"| {row['k']} | {seeds} | {pair(row['smallest_pair'], stds)} | {_count(row['smallest'])} | "
                     f"{pair(row['largest_pair'], stds)} | {_count(row['largest'])} |")  # fmt: skip
    lines += ["", "Pairs whose difference of means exceeds twice its standard error, with the seeds each row has:", ""]
    lines += [f"- k = {k}: " + ("; ".join(f"{a} > {b} by {g:.1%} (2 SE = {t:.1%})" for a, b, g, t in pairs) or "none")
              for k, pairs in mean_separations(table, ks).items()]  # fmt: skip
    lines += ["", "Twice the standard error is a normal-approximation bar: with a few seeds each std is itself "
              "uncertain (a Student t bar would be higher), the seeds needed above rest on those uncertain stds, and "
              "every pair at a k is read at once, so a pair called here is a lead for more seeds, not a separation "
              "by the page's rule.", ""]  # fmt: skip
    return lines


def power_markdown(table, meta: dict, noise) -> str:
    """The powered page: final accuracy on the large held-out set, the separation rule on it, and where the seed
    noise comes from."""
    ks, n = meta["ks"], meta["final_heldout"]
    present = [k for k in ks if any(k in rows for rows in table.values())]
    done, missing = sum(row["seeds"] for rows in table.values() for row in rows.values()), meta["missing"]
    keys = meta["warm_start_keys"]
    lines = [
        f"# Long completions, powered: final accuracy on {n:,} held-out problems",
        "",
        "The long-completion study's cells ([long_completions.md](long_completions.md): same task, warm start, "
        f"learning rate {meta['learning_rate']:g}, {meta['generation_batches']} generation batches), with each cell's "
        f"final accuracy also measured on {n:,} further problems: drawn from seed {meta['final_heldout_seed']}, "
        "none of them a training problem or one of the curve's "
        f"{meta['num_heldout']}, greedy, scored by math-verify. Drawn from what the training problems left, its "
        f"chains run {meta['final_heldout_mean_lines']:.2f} scratchpad lines on average against "
        f"{meta['heldout_mean_lines']:.2f} in the curve's set, so its accuracy level need not be the curve's; the "
        "comparison between objectives is what it is for. The accuracy curve, and its area, stay on the curve's "
        f"{meta['num_heldout']} problems. "
        + (f"Every cell started from the same cached warm start, `warmstart-{keys[0]}`." if len(keys) == 1 else
           f"The cells started from {len(keys)} different warm starts ({', '.join(keys)}): not one study.")
        + f" Produced on {meta['machine']} ({meta['cpu_minutes']:.0f} CPU minutes summed over the finished cells), "
        f"with the code at commit {', '.join(meta['commits'])}, by:",
        "",
        "```bash",
        meta["command"],
        "```",
        "",
        f"`bash benchmarks/power_study.sh {meta['out_dir']}` starts or resumes it in the background; "
        f"`bash benchmarks/power_study.sh {meta['out_dir']} --report` rewrites this page and its JSON from the "
        "finished cells.",
        "",
    ]
    if missing:
        per_cell = meta["cpu_minutes"] / done
        lines += [f"**Partial: {done} of {done + len(missing)} cells finished**; about {per_cell * len(missing):.0f} CPU "
                  f"minutes left at the finished cells' mean of {per_cell:.1f}. Not run yet: {', '.join(missing)}.", ""]  # fmt: skip
    head = "| objective | " + " | ".join(f"k = {k}" for k in present) + " |"
    rule = "|---|" + "---|" * len(present)

    def grid(measure):
        return [head, rule] + [
            f"| {o} | " + " | ".join(_seeded(rows[k], measure) if k in rows else "—"
                                     for k in present) + " |" for o, rows in table.items()
        ] + [""]  # fmt: skip

    lines += ["## Final accuracy", "", f"Mean ± sample std over seeds (seeds done), on the {n:,} problems:", ""]
    lines += grid("final_heldout_accuracy")
    lines += [f"The same cells on the curve's {meta['num_heldout']} problems:", ""]
    lines += grid("final_accuracy")
    lines += ["## Can the rule call a 3-point gap?", "",
              "A gap between two objectives counts only above twice the larger of their seed stds. Per k, over the "
              "pairs of rows with two seeds or more: the smallest gap the rule can call (the pair with the smallest "
              "threshold), the gap every pair needs, and that gap with the evaluation noise taken out (twice the "
              "largest training std below), in points:", "",
              "| k | rows | smallest callable gap | gap every pair needs | at most 3 points? | without evaluation noise |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for row in callable_gaps(table, noise, present):
        verdict_ = "—" if row["largest"] is None else ("yes" if row["largest"] <= 0.03 else
                                                         "for some pairs" if row["smallest"] <= 0.03 else "no")
        lines.append(f"| {row['k']} | {row['rows']} | {_points(row['smallest'])} | {_points(row['largest'])} | "
                     f"{verdict_} | {_points(row['training_only'])} |")  # fmt: skip
    found = separations(table, "final_heldout_accuracy")
    called = [f"{a} > {b} at k = {k} by {gap:.1%} (2 std = {threshold:.1%})"
              for k, pairs in found.items() for a, b, gap, threshold in pairs]  # fmt: skip
    lines += ["", "Pairs that separate on the final held-out accuracy: " + ("; ".join(called) if called else "none") + ".",
              ""]  # fmt: skip
    lines += mean_reading(table, present)
    lines += ["## Where the seed noise comes from", "",
              "Per row, the seed std s of the final accuracy on the "
              f"{n:,} problems split exactly into each problem's own disagreement between seeds (d, the evaluation "
              "noise: it shrinks as 1/sqrt(N) with a larger set) and problems moving together (sqrt(s² − d²), the "
              "training noise: better or worse policies; 0 where a few seeds make s² − d² come out negative); "
              "`dhpo_trl/evaluation/seed_noise.py`. The binomial sqrt(p(1 − p)/N) is d if every problem were "
              "equally hard for every seed, an upper bound. In points:", "",
              f"| objective | k | seeds | s | binomial at {n:,} | evaluation d | training | s on the curve's "
              f"{meta['num_heldout']} | binomial at {meta['num_heldout']} |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    split = [(o, k) for o in table for k in present if k in noise.get(o, {})]
    for o, k in split:
        row, small = noise[o][k], table[o][k]["final_accuracy"]
        lines.append(f"| {o} | {k} | {row['seeds']} | {_points(row['seed_std'])} | {_points(row['binomial_std'])} "
                     f"| {_points(row['evaluation_std'])} | {_points(row['training_std'])} | {_points(small[1])} "
                     f"| {_points(math.sqrt(small[0] * (1 - small[0]) / meta['num_heldout']))} |")  # fmt: skip
    if not split:
        lines += ["", "No row has two seeds yet: nothing to split."]
    return "\n".join(lines + [""])


def page_from_json(results: dict) -> str:
    """The page (`staleness.md` or `long_completions.md`) for its saved JSON (JSON turns the k keys into strings)."""
    def keyed(aggregate):
        return {o: {int(k): row for k, row in rows.items()} for o, rows in aggregate.items()}

    if results["meta"].get("task", "addition") == "addition":
        return markdown(keyed(results["aggregate"]), results["meta"])
    if results["meta"].get("final_heldout"):
        return power_markdown(keyed(results["aggregate"]), results["meta"], keyed(results["noise"]))
    return long_markdown(keyed(results["aggregate"]), results["meta"], keyed(results["reference"]))


def plan(args) -> list[tuple]:
    """Every cell, in the order run: per k (in `--ks` order), each objective with the first seed followed by its
    reference-task cells at that k, then the other seeds, so that a study stopped early has whole k's and compares
    the spreads from its second cell on."""
    jobs = []
    for k in args.ks:
        objectives = args.on_policy_objectives if k == 1 and args.on_policy_objectives else args.objectives
        cells = [[(o, k, s, str(args.out_dir), args.generation_batches, args.eval_every, args.learning_rate, args.task,
                   args.final_heldout) for o in objectives] for s in args.seeds]  # fmt: skip
        # on-policy (k = 1) every ratio is 1 on every task: no reference to compare with
        reference = [[(o, k, s, str(args.out_dir / "reference-addition"), args.generation_batches, args.eval_every,
                       args.learning_rate, "addition", None) for s in args.reference_seeds] if k > 1 else []
                     for o in objectives]  # fmt: skip
        jobs += [job for cell, extra in zip(cells[0], reference) for job in (cell, *extra)]
        jobs += [job for seed_cells in cells[1:] for job in seed_cells]
    return jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="addition", choices=list(TASKS),
                        help="addition: two-digit sums (docs/study/staleness.md); long: chained arithmetic with a "
                             "scratchpad, completions of 30-400 tokens (docs/study/long_completions.md)")  # fmt: skip
    parser.add_argument("--objectives", nargs="+", default=OBJECTIVES, choices=[*PAPER_ALGORITHMS, *VARIANTS])
    parser.add_argument("--ks", nargs="+", type=int, default=[2, 4, 8, 16], help="optimizer steps per generation batch")
    parser.add_argument("--on-policy-objectives", nargs="+", default=None, choices=[*PAPER_ALGORITHMS, *VARIANTS],
                        help="at k = 1 run only these of --objectives (default: all): on-policy every ratio is 1, no "
                             "clip or gate acts, and the rows differ only in how they weight token gradients")  # fmt: skip
    parser.add_argument("--seeds", nargs="+", type=seed_int, default=[0, 1, 2])
    parser.add_argument("--reference-seeds", nargs="*", type=seed_int, default=[],
                        help="--task long: seeds of two-digit-task cells at each k > 1, run with the study's "
                             "learning rate and generation batches, to compare the within-sequence spread of log r "
                             "against")  # fmt: skip
    parser.add_argument("--generation-batches", type=int, default=24, help="generation batches per cell")
    parser.add_argument("--eval-every", type=int, default=4, help="held-out evaluation every this many generation batches")
    parser.add_argument("--learning-rate", type=float, default=None, help="(default: the task's)")
    parser.add_argument("--workers", type=int, default=2, help="cells in parallel (one torch thread each)")
    parser.add_argument("--out-dir", type=Path, default=None, help="(default outputs/staleness, or outputs/long_completions)")
    parser.add_argument("--docs-dir", type=Path, default=Path("docs/study"))
    parser.add_argument("--final-heldout", type=int, default=None, metavar="N",
                        help="--task long: also measure each cell's final accuracy on N further held-out problems "
                             "(disjoint from the training and the curve's problems; same warm start), with less "
                             "evaluation noise than the curve's 100; the page is long_completions_power.md")  # fmt: skip
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: write the page from the cells already saved, naming the missing ones")  # fmt: skip
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)  # acted on by `cli` (cell_pool.reported)
    args = parser.parse_args(argv)
    for name in ("generation_batches", "eval_every", "workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if repeated := repeated_values(args, "objectives", "ks", "seeds", "reference_seeds", "on_policy_objectives"):
        parser.error(repeated)
    if args.on_policy_objectives and not set(args.on_policy_objectives) <= set(args.objectives):
        parser.error("--on-policy-objectives must be among --objectives")
    if args.on_policy_objectives and 1 not in args.ks:
        parser.error("--on-policy-objectives chooses the rows run at k = 1: add 1 to --ks")
    if args.reference_seeds and args.task == "addition":
        parser.error("--reference-seeds compares another task with the two-digit one: use it with --task long")
    if args.final_heldout is not None:
        if args.task != "long":
            parser.error("--final-heldout: only --task long has a final held-out set; add --task long or drop it")
        if args.reference_seeds:
            parser.error("--final-heldout measures the long task only: drop --reference-seeds")
        try:  # drawn once here, so that a set larger than the task's unused problems fails before any cell
            final_set(TASKS[args.task](), args.final_heldout)
        except ValueError as error:
            parser.error(f"--final-heldout {args.final_heldout}: {error}")
    args.learning_rate = TASKS[args.task].learning_rate if args.learning_rate is None else args.learning_rate
    args.out_dir = args.out_dir or Path("outputs/staleness" if args.task == "addition" else "outputs/long_completions")
    for k in args.ks:  # every k must split the generation batch before anything runs
        try:
            cell_settings(k, args.generation_batches, args.eval_every, args.learning_rate, args.task)
        except ValueError as error:
            parser.error(f"--ks {k}: {error}")

    started = time.perf_counter()
    jobs = plan(args)
    saved = [job for job in jobs if _saved(job) is not None]
    print(f"[staleness] {len(jobs)} cells, {len(saved)} saved, {len(jobs) - len(saved)} to run", flush=True)
    if args.report_only:
        if not saved:
            parser.error(f"--report-only: no finished cell in {args.out_dir}")
        missing, jobs = [job for job in jobs if job not in saved], saved
    else:
        missing = []
    if args.workers > 1 and not args.report_only:
        # Warm start once, before the workers, so they load it from the cache instead of racing to train it.
        for task in dict.fromkeys(job[7] for job in jobs):
            load_task(TASKS[task]())
    summaries, ran = {}, 0
    # One worker runs the cells in this process, in plan order; more run them in a pool of spawned processes.
    # A stop signal or an error ends the pool's workers too, with no cell half-saved (dhpo_trl/demo/cell_pool.py).
    # In this process, a cell's SystemExit is a lost cell too, not the study's end (`Cell`).
    with cell_pool(args.workers) if args.workers > 1 else contextlib.nullcontext() as pool:
        results = pool.imap_unordered(_run_cell, jobs) if pool else map(Cell(_run_cell, (SystemExit,)), jobs)
        for done, (key, summary, reused) in enumerate(results, start=1):
            summaries[key + (summary.get("task", "addition"),)] = summary
            elapsed = time.perf_counter() - started
            ran += not reused
            eta = f"{elapsed / ran * (len(jobs) - len(saved) - ran) / 60:.0f} min left" if ran else "resumed"
            print(f"[staleness] {done}/{len(jobs)} {summary.get('task', 'addition')} {key[0]} k={key[1]} seed {key[2]}: "
                  f"{summary['heldout_accuracy_before']:.1%} -> {summary['heldout_accuracy_after']:.1%}"
                  f"{' (saved)' if reused else ' in %.0fs' % summary['train_seconds']}; {eta}", flush=True)  # fmt: skip
    cells = {key: {**cell_metrics(json.loads(Path(s["log_history_path"]).read_text())["log_history"], key[1]),
                   **final_metrics(s)} for key, s in summaries.items()}  # fmt: skip
    main_cells = {key[:3]: c for key, c in cells.items() if key[3] == args.task}
    reference_cells = {key[:3]: c for key, c in cells.items() if key[3] != args.task}
    table = aggregate(main_cells)
    table = {o: table[o] for o in args.objectives if o in table}
    main_summaries = [s for key, s in summaries.items() if key[3] == args.task]
    any_summary = main_summaries[0]
    argv_text = " ".join(arg for arg in (argv if argv is not None else sys.argv[1:]) if not debug_given([arg]))
    meta = {
        "command": "python benchmarks/staleness.py " + argv_text.replace(" --report-only", ""),
        "machine": f"{platform.machine()} CPU, {multiprocessing.cpu_count()} cores, {args.workers} workers",
        "cell_minutes": sum(s["wall_seconds"] for s in main_summaries) / 60,
        "seeds": len(args.seeds),
        "generation_batches": args.generation_batches,
        "eval_every": args.eval_every,
        "learning_rate": args.learning_rate,
        "num_heldout": any_summary["num_heldout"],
        "max_completion_length": any_summary["settings"]["max_completion_length"],
        "parameters": any_summary.get("parameters", 0),
        "commits": sorted({str(s.get("commit")) for s in main_summaries}),
    }
    name = "staleness"
    if args.task != "addition":
        name = "long_completions"
        meta.update(long_meta(args, summaries, missing))
    if args.final_heldout is not None:  # its own page, on the final held-out accuracy, without plots
        name = "long_completions_power"
        meta.update(power_meta(args, {key: s for key, s in summaries.items() if key[3] == args.task}))
    args.docs_dir.mkdir(parents=True, exist_ok=True)
    if args.final_heldout is None:
        plot(table, args.docs_dir, f"{name}_accuracy.png")
        plot_curves(main_cells, max(k for _, k, _ in main_cells), args.docs_dir, f"{name}_curves.png")
    cell_rows = [{"objective": o, "k": k, "seed": s, "task": t, **c} for (o, k, s, t), c in cells.items()]
    results = {"meta": meta, "aggregate": table, "cells": cell_rows}
    if args.task != "addition":
        results["reference"] = {o: rows for o, rows in aggregate(reference_cells).items()}
    if args.final_heldout is not None:
        results["noise"] = noise_table(main_cells)
    (args.docs_dir / f"{name}.json").write_text(json.dumps(results, indent=1))
    # The page is written from the JSON just saved, so every figure on it is the JSON's (tests/test_study_pages.py).
    (args.docs_dir / f"{name}.md").write_text(page_from_json(json.loads((args.docs_dir / f"{name}.json").read_text())))
    print((args.docs_dir / f"{name}.md").read_text())
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`main`, with a stop or a lost cell (a dead worker, a cell's `SystemExit`) reported on one line of stderr: the
    exit status."""
    return reported(main, argv, "[staleness]")


if __name__ == "__main__":
    sys.exit(cli())
