"""Fills docs/performance_gpu.md's figures from a `scripts/gpu_check.sh` run: the block between its two markers is
replaced by the run's device, date and commit, the GPU tests with their measured errors, the training run and the
benchmark tables. Everything else in the file stays as written.

    python scripts/docs_gpu_section.py /tmp/gpu_check/gpu_check.json

A CPU dry run's JSON is refused: the section holds GPU runs only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "performance_gpu.md"
BEGIN, END = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"


def _number(value, digits=0, scale=1.0, suffix=""):
    return "" if value is None else f"{value * scale:,.{digits}f}{suffix}"


def render(report: dict) -> str:
    """The markdown of one gpu_check.json."""
    parts = report["parts"]
    environment = parts.get("environment", {}).get("result", {})
    lines = [
        f"Run of `bash scripts/gpu_check.sh` on **{environment.get('device_name') or 'no GPU'}**, "
        f"{report['date']}, commit `{(report.get('commit') or 'unknown')[:10]}`; torch {environment.get('torch')}, "
        f"transformers {environment.get('versions', {}).get('transformers')}, trl "
        f"{environment.get('versions', {}).get('trl')}; varlen kernels: "
        f"{', '.join(environment.get('varlen_kernels') or []) or 'none'}.",
        "",
        "| part | status | seconds |",
        "|---|---|---|",
        *(f"| {name} | {entry['status']} | {entry['seconds']} |" for name, entry in parts.items()),
    ]
    notes = [*parts.get("wheels", {}).get("result", {}).get("notes", []), *environment.get("notes", [])]
    if notes:
        lines += ["", "Notes of the run:", "", *(f"- {note}" for note in notes)]
    failed = {name: entry for name, entry in parts.items() if entry.get("error")}
    for name, entry in failed.items():
        lines += ["", f"`{name}` ended {entry['status']}; its last lines:", "", "```text", *entry["error"][-8:], "```"]
    tests = parts.get("tests", {}).get("result", {}).get("tests", [])
    if tests:
        lines += ["", "**GPU tests** (tests/test_gpu.py; errors against the float32 padded forward of the same "
                  "weights)", "", "| test | outcome | packed logits / log-probs / gradient error | padded's own | leaking rows |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for test in tests:
            p = test["properties"]
            packed = " / ".join(p.get(f"packed_{k}_error", "") for k in ("logits", "logps", "gradient"))
            padded = " / ".join(p.get(f"padded_{k}_error", "") for k in ("logits", "logps", "gradient"))
            outcome = test["outcome"] + (f" ({test['message']})" if test["outcome"] != "passed" else "")
            lines.append(f"| `{test['name']}` | {outcome} | {packed} | {padded} | "
                         f"{p.get('leaking_rows_logits_error', '')} |")  # fmt: skip
    train = parts.get("train", {}).get("result")
    if train:
        lines += ["", f"**Training** (DHPO-E, off-policy, generation on the GPU, random Qwen3 {train['shape']}, "
                  f"{train['parameters'] / 1e9:.2f}B parameters): {train['steps']} steps in {train['seconds']:.1f} s, "
                  f"losses {', '.join(f'{loss:.4g}' for loss in train['losses'])}, "
                  f"{len(train['metrics_logged'])} metrics logged, peak memory "
                  f"{_number(train['peak_memory_bytes'], 2, 2**-30, ' GiB')}, padding-free {train['padding_free']}, "
                  f"attention calls {train['attention_kernels']}."]  # fmt: skip
    for name, entry in parts.items():
        bench = entry.get("result") if name.startswith("bench-") else None
        if not bench:
            continue
        options = bench["options"]
        lines += ["", f"**Update benchmark, {bench['shape'] or name}** ({bench['parameters'] / 1e9:.2f}B parameters, "
                  f"{bench['dtype']}, batch {options['batch_size']} x {options['accumulation']} accumulation, "
                  f"completions up to {options['max_completion']} tokens, median {options['median_fraction']:.3f} of "
                  f"it; {options['repeats']} timed runs per arm, interleaved; peak {bench['peak_tflops']} TFLOPS)", "",
                  "| arm | trained tok/s | all tok/s | MFU | peak step memory | padding | attention calls |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for arm, figures in bench["arms"].items():
            lines.append(f"| {arm} | {_number(figures.get('trained_tokens_per_second'))} | "
                         f"{_number(figures.get('real_tokens_per_second'))} | "
                         f"{_number(figures.get('mfu'), 1, 100, '%')} | "
                         f"{_number(figures['peak_step_memory_bytes'], 2, 2**-30, ' GiB')} | "
                         f"{_number(figures['padding_fraction'], 1, 100, '%')} | {figures['attention_kernels']} |")  # fmt: skip
        ratios, targets = bench.get("throughput_ratios", {}), entry.get("targets", {})
        if ratios:
            verdicts = {ratio: f" (target >= {judged['target']}x: {'met' if judged['met'] else 'NOT met'})"
                        for ratio, judged in targets.items()}  # fmt: skip
            lines += ["", "Throughput ratios: " + ", ".join(f"{ratio} {value:.2f}x{verdicts.get(ratio, '')}"
                                                           for ratio, value in ratios.items())]  # fmt: skip
    return "\n".join(lines + routing_lines(parts))


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
    parser.add_argument("report", help="gpu_check.json of a GPU run")
    parser.add_argument("--doc", default=str(DOC))
    parser.add_argument("--commit", default=None,
                        help="the commit that ran, where the report has none (a copy of the tree without .git)")  # fmt: skip
    options = parser.parse_args(argv)
    report = json.loads(Path(options.report).read_text())
    report["commit"] = report.get("commit") or options.commit
    if not report["commit"]:
        parser.error(f"{options.report} names no commit (the tree that ran had no .git): pass --commit SHA")
    if report.get("mode") != "gpu":
        parser.error(f"{options.report} is a CPU dry run (mode {report.get('mode')!r}): the section holds GPU runs")
    doc = Path(options.doc)
    doc.write_text(fill(doc.read_text(), render(report)))
    print(f"{doc}: filled from {options.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
