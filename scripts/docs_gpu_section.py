"""Fills docs/performance_gpu.md's figures from one or more `scripts/gpu_check.sh` runs: the block between its two
markers is replaced by the runs (device, date, commit), then each part from the latest run that holds it: the GPU
tests with their measured errors, the training run, the benchmark tables with each arm's warm-up health, the routing
replay figures. A part cut short says so with what it measured. Everything else in the file stays as written.

    python scripts/docs_gpu_section.py /tmp/gpu_check/gpu_check.json
    python scripts/docs_gpu_section.py run1.json run2.json --commit SHA1 --commit SHA2

A CPU dry run's JSON is refused: the section holds GPU runs only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "performance_gpu.md"
BEGIN, END = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"


def _number(value, digits=0, scale=1.0, suffix=""):
    return "" if value is None else f"{value * scale:,.{digits}f}{suffix}"


def _short(commit: str | None) -> str:
    return (commit or "unknown")[:10]


def by_date(reports: list[dict]) -> list[int]:
    """The reports' indices, oldest run first (reports of one date in the order given)."""
    return sorted(range(len(reports)), key=lambda i: reports[i]["date"])


def latest_parts(reports: list[dict]) -> dict[str, tuple[int, dict]]:
    """{part: (index of the run it comes from, its entry)}: each part from the latest run that holds it, in the order
    the parts first ran."""
    chosen: dict[str, tuple[int, dict]] = {}
    for index in by_date(reports):
        for name, entry in reports[index]["parts"].items():
            chosen.setdefault(name, (index, entry))  # keeps its place in the order ...
            chosen[name] = (index, entry)  # ... and takes the later run's entry
    return chosen


def run_label(reports: list[dict], index: int) -> str:
    """`run N`, N counted by date, as the runs table lists them."""
    return f"run {by_date(reports).index(index) + 1}"


def bench_completeness(entry: dict) -> str:
    """What a benchmark part measured against what it was asked: its status, the timed runs of each arm out of the
    repeats asked, the profiles asked and missing. Empty when it ran whole."""
    bench, said = entry.get("result") or {}, []
    repeats, arms = bench.get("options", {}).get("repeats"), bench.get("arms", {})
    timed = {arm: figures.get("timed_runs", 0) for arm, figures in arms.items()}
    wanted = {arm: figures.get("timed_runs_asked", repeats) for arm, figures in arms.items()}  # per arm: shapes
    if timed != wanted:
        counts = sorted(set(timed.values()))
        if len(set(wanted.values())) > 1:
            said.append("timed runs: " + ", ".join(f"{arm} {timed[arm]} of {wanted[arm]}" for arm in arms))
        else:
            each = ", ".join(f"{arm} {count}" for arm, count in timed.items())
            said.append(f"{counts[0]} of {repeats} timed runs per arm" if len(counts) == 1 else
                        f"timed runs of {repeats}: {each}")  # fmt: skip
    asked = [arm for arm in filter(None, bench.get("options", {}).get("profile", "").split(","))]
    missing = [arm for arm in asked if "profile_top_operators" not in arms.get(arm, {})]
    if missing:
        said.append(f"profiles of {', '.join(missing)} not run")
    if entry["status"] != "ok" or said:
        return f"{entry['status']}" + (f": {'; '.join(said)}" if said else "")
    return ""


def unhealthy(figures: dict) -> bool:
    """A warm-up run with a loss, a gradient norm or an update value that is not finite."""
    health = figures.get("warm_up_run") or {}
    values = [*health.get("losses", []), *health.get("grad_norms", [])]
    return bool(health.get("nonfinite_update_values")) or any(v is not None and not math.isfinite(v) for v in values)


def runs_lines(reports: list[dict]) -> list[str]:
    lines = ["| run | date | commit | parts | device | torch |", "|---|---|---|---|---|---|"]
    for index in by_date(reports):
        report, parts = reports[index], reports[index]["parts"]
        found = [(e.get("result") or {}) for e in parts.values() if isinstance(e.get("result"), dict)]
        device = next((r.get("device_name") for r in found if r.get("device_name")), None) or "unknown"
        torch = next((r.get("torch") for r in found if r.get("torch")), None) or "unknown"
        commit = f"`{_short(report['commit'])}`"
        if report.get("recorded_commit"):
            commit += f" (its JSON records `{_short(report['recorded_commit'])}`)"
        lines.append(f"| {run_label(reports, index)} | {report['date']} | {commit} | {', '.join(parts)} | {device} | "
                     f"{torch} |")  # fmt: skip
    return lines


def collapse(lines: list[str]) -> list[str]:
    """Consecutive equal lines once, with their count: a warning repeated by every run says nothing more."""
    out: list[list] = []
    for line in lines:
        if out and out[-1][0] == line:
            out[-1][1] += 1
        else:
            out.append([line, 1])
    cut = [line if len(line) <= 160 else line[:157] + "..." for line, _ in out]
    return [line if count == 1 else f"{line}  [x{count}]" for line, (_, count) in zip(cut, out, strict=True)]


def render(reports: list[dict] | dict) -> str:
    """The markdown of one gpu_check.json, or of several: each part from the latest run that holds it."""
    reports = [reports] if isinstance(reports, dict) else reports
    chosen = latest_parts(reports)
    parts = {name: entry for name, (_, entry) in chosen.items()}
    environment = parts.get("environment", {}).get("result", {})
    lines = ["Runs of `scripts/gpu_check.sh`; each part below comes from the latest run that holds it.", "",
             *runs_lines(reports), ""]
    if environment:
        versions = environment.get("versions", {})
        lines += [f"Versions (the `environment` part): torch {environment.get('torch')}, transformers "
                  f"{versions.get('transformers')}, trl {versions.get('trl')}; varlen kernels: "
                  f"{', '.join(environment.get('varlen_kernels') or []) or 'none'}.", ""]  # fmt: skip
    lines += ["| part | from | status | seconds | earlier runs |", "|---|---|---|---|---|"]
    for name, (index, entry) in chosen.items():
        status = (bench_completeness(entry) if name.startswith("bench-") else "") or entry["status"]
        earlier = [f"{run_label(reports, i)}: {r['parts'][name]['status']}" for i, r in enumerate(reports)
                   if i != index and name in r["parts"]]  # fmt: skip
        lines.append(f"| {name} | {run_label(reports, index)} | {status} | {entry['seconds']} | "
                     f"{'; '.join(earlier)} |")  # fmt: skip
    notes = [*parts.get("wheels", {}).get("result", {}).get("notes", []), *environment.get("notes", [])]
    if notes:
        lines += ["", "Notes of the runs:", "", *(f"- {note}" for note in notes)]
    for name, entry in parts.items():
        if entry.get("error"):
            lines += ["", f"`{name}` ended {entry['status']}; its last lines:", "", "```text",
                      *collapse(entry["error"])[-8:], "```"]  # fmt: skip
    lines += tests_lines(parts) + train_lines(parts)
    for name, entry in parts.items():
        if name.startswith("bench-") and entry.get("result"):
            lines += bench_lines(name, entry, run_label(reports, chosen[name][0]))
    return "\n".join(lines + routing_lines(parts))


def tests_lines(parts: dict) -> list[str]:
    tests = parts.get("tests", {}).get("result", {}).get("tests", [])
    if not tests:
        return []
    lines = ["", "**GPU tests** (tests/test_gpu.py; errors against the float32 padded forward of the same weights)",
             "",
             "| test | outcome | packed logits / log-probs / gradient error | padded's own | leaking rows |",
             "|---|---|---|---|---|"]  # fmt: skip
    for test in tests:
        p = test["properties"]
        packed = " / ".join(p.get(f"packed_{k}_error", "") for k in ("logits", "logps", "gradient"))
        padded = " / ".join(p.get(f"padded_{k}_error", "") for k in ("logits", "logps", "gradient"))
        outcome = test["outcome"] + (f" ({test['message']})" if test["outcome"] != "passed" else "")
        leaking = p.get("leaking_rows_logits_error", "")
        lines.append(f"| `{test['name']}` | {outcome} | {packed} | {padded} | {leaking} |")
    return lines


def train_lines(parts: dict) -> list[str]:
    train = parts.get("train", {}).get("result")
    if not train:
        return []
    return ["", f"**Training** (DHPO-E, off-policy, generation on the GPU, random Qwen3 {train['shape']}, "
            f"{train['parameters'] / 1e9:.2f}B parameters): {train['steps']} steps in {train['seconds']:.1f} s, "
            f"losses {', '.join(f'{loss:.4g}' for loss in train['losses'])}, {len(train['metrics_logged'])} metrics "
            f"logged, peak memory {_number(train['peak_memory_bytes'], 2, 2**-30, ' GiB')}, padding-free "
            f"{train['padding_free']}, attention calls {train['attention_kernels']}."]  # fmt: skip


def _health(figures: dict, parameters: int | None) -> list[str]:
    """Warm-up losses, gradient norms and non-finite update values (share of the parameters), as table cells."""
    health = figures.get("warm_up_run")
    if not health:
        return ["", "", ""]
    nonfinite = health.get("nonfinite_update_values")
    share = f" ({100 * nonfinite / parameters:.0f}%)" if nonfinite and parameters else ""
    return [", ".join(f"{v:.3g}" for v in health.get("losses", [])),
            ", ".join("None" if v is None else f"{v:.3g}" for v in health.get("grad_norms", [])),
            "" if nonfinite is None else f"{nonfinite:,}{share}"]  # fmt: skip


def bench_lines(name: str, entry: dict, label: str) -> list[str]:
    bench, options = entry["result"], entry["result"]["options"]
    cut = bench_completeness(entry)
    lines = ["", f"**Update benchmark, {bench['shape'] or name}** ({label}; {bench['parameters'] / 1e9:.2f}B "
             f"parameters, {options['algorithm']} row, {bench['dtype']}, batch {options['batch_size']} x "
             f"{options['accumulation']} accumulation, "
             f"completions up to {options['max_completion']} tokens, median {options['median_fraction']:.3f} of it; "
             f"{options['repeats']} timed runs per arm asked, interleaved; peak {bench['peak_tflops']} TFLOPS)"
             + (f". **Not complete**: {cut}." if cut else ""), "",
             "| arm | timed runs | trained tok/s | all tok/s | MFU | peak step memory | padding | attention calls | "
             "warm-up losses | warm-up grad norms | non-finite update values |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, figures in bench["arms"].items():
        cells = [arm, str(figures.get("timed_runs", 0)), _number(figures.get("trained_tokens_per_second")),
                 _number(figures.get("real_tokens_per_second")), _number(figures.get("mfu"), 1, 100, "%"),
                 _number(figures["peak_step_memory_bytes"], 2, 2**-30, " GiB"),
                 _number(figures["padding_fraction"], 1, 100, "%"), str(figures["attention_kernels"]),
                 *_health(figures, bench.get("parameters"))]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    broken = [arm for arm, figures in bench["arms"].items() if unhealthy(figures)]
    if broken:
        lines += ["", f"Not finite in the warm-up run: {', '.join(broken)}. Those arms' speeds time an update whose "
                  "gradients or parameter change are not finite."]  # fmt: skip
    ratios, targets = bench.get("throughput_ratios", {}), entry.get("targets", {})
    if ratios:
        verdicts = {ratio: f" (target >= {judged['target']}x: {'met' if judged['met'] else 'NOT met'})"
                    for ratio, judged in targets.items()}  # fmt: skip
        flags = {ratio: f" [{', '.join(a for a in ratio.split('/') if a in broken)} not finite]"
                 for ratio in ratios if set(ratio.split("/")) & set(broken)}  # fmt: skip
        lines += ["", "Throughput ratios" + (f" ({cut})" if cut else "") + ": " + ", ".join(
            f"{ratio} {value:.2f}x{verdicts.get(ratio, '')}{flags.get(ratio, '')}" for ratio, value in ratios.items())]
    return lines + profile_lines(bench)


def profile_summary_lines(bench: dict) -> list[str]:
    """Per micro-step figures of each profiled arm's window (`dhpo_trl.training.step_profile`): what decides whether
    the host (launches, synchronisations, cuDNN's plan building inside attention) or the device bounds a micro-step."""
    rows = [(arm, figures["profile_summary"]) for arm, figures in bench["arms"].items()
            if figures.get("profile_summary")]  # fmt: skip
    if not rows:
        return []
    lines = ["", "Profiled micro-steps (per micro-step of each profiled window; device busy: device activity over wall "
             "time; host waiting: the host inside synchronising calls; host in operators and attention: shares of "
             "wall time the host spends in aten operators, waits inside them included, and in the attention "
             "operators among them):", "",
             "| arm | micro-steps | wall ms | aten ops | kernel launches | synchronisations | device busy | host "
             "waiting | host in operators | attention (host) |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, summary in rows:
        lines.append(f"| {arm} | {summary['micro_steps']} | {_number(summary['wall_seconds_per_micro_step'], 1, 1e3)} | "
                     f"{_number(summary['aten_ops_per_micro_step'])} | "
                     f"{_number(summary['kernel_launches_per_micro_step'])} | "
                     f"{_number(summary['synchronisations_per_micro_step'], 1)} | "
                     f"{_number(summary['device_busy_fraction'], 0, 100, '%')} | "
                     f"{_number(summary.get('host_waiting_fraction'), 0, 100, '%')} | "
                     f"{_number(summary['host_in_operators_fraction'], 0, 100, '%')} | "
                     f"{_number(summary['attention_host_fraction'], 0, 100, '%')} |")  # fmt: skip
    return lines


def profile_lines(bench: dict, count: int = 8) -> list[str]:
    """The profiled arms' per micro-step figures, then their top operators by self device time (CPU time on a CPU
    run)."""
    lines = profile_summary_lines(bench)
    for arm, figures in bench["arms"].items():
        operators = figures.get("profile_top_operators")
        if not operators:
            continue
        window = figures.get("profile_window") or {}
        where = f"micro-steps {window['micro_steps']}" if "micro_steps" in window else "one run"
        lines += ["", f"Top operators of `{arm}` under torch.profiler ({where}, untimed run):", "",
                  "| operator | calls | self device ms | self CPU ms |", "|---|---|---|---|",
                  *(f"| `{o['name']}` | {o['calls']} | {o['self_device_ms']:.1f} | {o['self_cpu_ms']:.1f} |"
                    for o in operators[:count])]  # fmt: skip
    return lines


def routing_lines(parts: dict) -> list[str]:
    """The routing-replay parts: the overhead of recording and replaying, and R3 against vLLM's engine."""
    lines = []
    for result in (parts.get("routing-overhead", {}).get("result") or {}).get("overhead", []):
        check = result["replay_check"]
        lines += ["", f"**Routing replay overhead** ({result['shape']}, {result['parameters'] / 1e9:.2f}B parameters, "
                  f"{result['layers']} MoE layers, top-{result['top_k']}, {result['dtype']}, {result['rows']} x "
                  f"{result['length']} tokens; median of {result['repeats']} interleaved runs, "
                  f"{'CPU time' if result['device'] == 'cpu' else 'wall time between synchronisations'}). After noise "
                  f"on the routers, {100 * check['flipped_fraction']:.1f}% of the live "
                  f"decisions flip; the replayed pass ran {check['decisions'] - check['differing']} of "
                  f"{check['decisions']} token-layer decisions as recorded.", "",
                  "| pass | plain | with the hooks | overhead |", "|---|---|---|---|"]  # fmt: skip
        for name, arm in result["arms"].items():
            hooks = "replay" if name == "update" else "record"
            lines.append(f"| {name} ({hooks}) | {_number(arm['plain_s'], 1, 1e3, ' ms')} | "
                         f"{_number(arm['hooked_s'], 1, 1e3, ' ms')} | {arm['overhead_percent']:+.1f}% |")  # fmt: skip
    rollout = parts.get("routing-rollout", {}).get("result")
    if rollout and "skipped" in rollout:
        lines += ["", f"**R3 against vLLM's engine**: not run: {rollout['skipped']}."]
    elif rollout and "flip_fraction_before_replay" in rollout:
        engine = rollout["engine"] + (f" {rollout['vllm']}" if "vllm" in rollout else "")
        lines += ["", f"**R3 against vLLM's engine** ({engine}, Qwen3-MoE {rollout['shape']}, "
                  f"{rollout['sequences']} completions, {rollout['tokens']} tokens, "
                  f"{rollout['layers']} layers, top-{rollout['top_k']}, policy in {rollout['dtype']}): routing "
                  f"returned as {rollout['routing_dtype']}; flip fraction before replay "
                  f"{rollout['flip_fraction_before_replay']:.4f} ({rollout['flipped_decisions']} of "
                  f"{rollout['decisions']} token-layer decisions); replayed pass: "
                  f"{rollout['replayed_decisions_differing']} of {rollout['replayed_decisions_checked']} decisions "
                  f"differ from the engine's, replayed fraction {rollout['replayed_fraction']:.3f}; "
                  f"|log pi_policy - log pi_engine| over the sampled tokens, mean / max: live "
                  f"{rollout['logp_gap_live_mean']:.4f} / {rollout['logp_gap_live_max']:.4f}, replayed "
                  f"{rollout['logp_gap_replayed_mean']:.4f} / {rollout['logp_gap_replayed_max']:.4f}."]  # fmt: skip
    return lines


def fill(document: str, block: str) -> str:
    if document.count(BEGIN) != 1 or document.count(END) != 1 or document.index(BEGIN) > document.index(END):
        raise ValueError(f"the document needs one {BEGIN} and one {END} line after it")
    head, rest = document.split(BEGIN)
    return f"{head}{BEGIN}\n{block}\n{END}{rest.split(END, 1)[1]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="gpu_check.json of one or more GPU runs (each part is shown from "
                        "the latest run, by the date each JSON records, that holds it)")  # fmt: skip
    parser.add_argument("--doc", default=str(DOC))
    parser.add_argument("--commit", action="append", default=[],
                        help="the commit each run's tree was, once per report in the order given (a copy "
                             "without .git records none; a checkout with uncommitted changes its HEAD)")
    options = parser.parse_args(argv)
    if options.commit and len(options.commit) != len(options.reports):
        parser.error(f"--commit: give it once per report ({len(options.reports)} reports, {len(options.commit)} "
                     "--commit) or not at all")  # fmt: skip
    reports = []
    for position, path in enumerate(options.reports):
        report = json.loads(Path(path).read_text())
        if report.get("mode") != "gpu":
            parser.error(f"{path} is a CPU dry run (mode {report.get('mode')!r}): the section holds GPU runs")
        if options.commit:
            given, recorded = options.commit[position], report.get("commit")
            report["commit"] = given
            if recorded and not recorded.startswith(given) and not given.startswith(recorded):
                report["recorded_commit"] = recorded
        if not report.get("commit"):
            parser.error(f"{path} names no commit (the tree that ran had no .git): pass --commit SHA for each report")
        reports.append(report)
    doc = Path(options.doc)
    doc.write_text(fill(doc.read_text(), render(reports)))
    print(f"{doc}: filled from {', '.join(options.reports)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
