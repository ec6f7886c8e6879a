"""Training-dynamics plots (the paper's Figs. 1-3) from one or more runs' `trainer_state.json` log histories.

    python -m dhpo_trl.evaluation.plotting outputs/grpo outputs/dhpo-e --labels GRPO DHPO-E --out plots/

A run is a `trainer_state.json` file or an output directory (its top-level `trainer_state.json`, else the one in its
last `checkpoint-N/`). Each figure overlays the runs, one labelled line per run, against the optimizer step, and is
written as PNG and SVG: policy entropy, mean response length, average accuracy, the four per-branch clip fractions
and the DHPO mixing weight. A metric that no run logged is skipped with a note instead of drawing an empty figure.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on training machines
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from ..user_errors import DEBUG_FLAG, DEBUG_HELP, run_command

CLIP_BRANCHES = ("token_low", "token_high", "sequence_low", "sequence_high")
# Accuracy: benchmark average from BenchmarkEvalCallback, else the embedded task's held-out accuracy, else reward.
ACCURACY_KEYS = ("eval/avg", "eval/heldout_accuracy", "reward")


@dataclass
class Run:
    label: str
    source: Path
    log_history: list[dict]

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of every log entry that holds `key` with a number."""
        points = [
            (entry["step"], entry[key])
            for entry in self.log_history
            if isinstance(entry.get(key), (int, float)) and not isinstance(entry.get(key), bool) and "step" in entry
        ]
        return [step for step, _ in points], [value for _, value in points]

    def has(self, key: str) -> bool:
        return bool(self.series(key)[0])


def find_trainer_state(path: str | Path) -> Path:
    """The trainer_state.json of a run: the file itself, a top-level one, or the last checkpoint's."""
    path = Path(path).expanduser()
    if path.is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"Run {path} does not exist: pass a trainer_state.json file or a training output directory.")
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    checkpoints = [
        (int(match.group(1)), child)
        for child in path.iterdir()
        if (match := re.fullmatch(r"checkpoint-(\d+)", child.name)) and (child / "trainer_state.json").is_file()
    ]
    if not checkpoints:
        raise ValueError(
            f"Run {path} has no trainer_state.json, neither at the top level nor in a checkpoint-N/ folder. "
            "Save a checkpoint (save_strategy) or call trainer.save_state()."
        )
    return max(checkpoints)[1] / "trainer_state.json"


def load_run(path: str | Path, label: str | None = None) -> Run:
    state_file = find_trainer_state(path)
    state = json.loads(state_file.read_text(encoding="utf-8"))
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        message = f"{state_file} has no 'log_history' list: is it a transformers trainer_state.json?"
        raise ValueError(message)  # noqa: TRY004 - a malformed file is bad input, reported like all bad input
    default_label = Path(path).parent.name if Path(path).is_file() else Path(path).name
    return Run(label=label or default_label, source=state_file, log_history=state["log_history"])


def _line_figure(runs: Sequence[Run], key: str, title: str, ylabel: str):
    figure, axis = plt.subplots(figsize=(6, 4))
    for run in runs:
        steps, values = run.series(key)
        if steps:
            axis.plot(steps, values, label=run.label)
    axis.set(title=title, xlabel="step", ylabel=ylabel)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # optimizer steps are whole numbers
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    return figure


def _clip_figure(runs: Sequence[Run], branches: Sequence[str]):
    figure, axes = plt.subplots(1, len(branches), figsize=(4.5 * len(branches), 4), squeeze=False)
    for axis, branch in zip(axes[0], branches):
        for run in runs:
            steps, values = run.series(f"dhpo/clip_fraction/{branch}")
            if steps:
                axis.plot(steps, values, label=run.label)
        axis.set(title=f"clip fraction: {branch.replace('_', ' ')}", xlabel="step", ylabel="fraction clipped")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    return figure


def build_figures(runs: Sequence[Run]) -> tuple[dict, list[str]]:
    """{figure name: matplotlib Figure} for the metrics some run logged, and notes on the ones skipped."""
    figures, notes = {}, []

    def line(name: str, key: str, title: str, ylabel: str) -> None:
        if any(run.has(key) for run in runs):
            figures[name] = _line_figure(runs, key, title, ylabel)
        else:
            notes.append(f"skipped {name}: no run logged '{key}'")

    line("entropy", "entropy", "Policy entropy", "entropy (nats / token)")
    line("response_length", "completions/mean_length", "Mean response length", "tokens")
    accuracy_key = next((key for key in ACCURACY_KEYS if any(run.has(key) for run in runs)), None)
    if accuracy_key is None:
        notes.append(f"skipped accuracy: no run logged any of {list(ACCURACY_KEYS)}")
    else:
        label = "reward" if accuracy_key == "reward" else "accuracy (%)" if accuracy_key == "eval/avg" else "accuracy"
        figures["accuracy"] = _line_figure(runs, accuracy_key, f"Average accuracy ({accuracy_key})", label)
    branches = [b for b in CLIP_BRANCHES if any(run.has(f"dhpo/clip_fraction/{b}") for run in runs)]
    if branches:
        figures["clip_fraction"] = _clip_figure(runs, branches)
    else:
        notes.append("skipped clip_fraction: no run logged 'dhpo/clip_fraction/*'")
    line("mixing_weight", "dhpo/mixing_weight/mean", "DHPO mixing weight", "mean mixing weight")
    return figures, notes


def plot_runs(paths: Sequence[str | Path], labels: Sequence[str] | None, out_dir: str | Path) -> dict:
    """Load the runs, draw the figures, write <name>.png and <name>.svg under `out_dir`; returns the figures."""
    if labels and len(labels) != len(paths):
        raise ValueError(f"Got {len(labels)} labels for {len(paths)} runs: give one label per run, in order.")
    runs = [load_run(path, label) for path, label in zip(paths, labels or [None] * len(paths))]
    figures, notes = build_figures(runs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, figure in figures.items():
        for extension in ("png", "svg"):
            figure.savefig(out_dir / f"{name}.{extension}", dpi=120)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return figures


def main(argv: list[str] | None = None) -> int:
    """`dhpo-plot`: 0, or 2 after a one-line error for bad input (see `dhpo_trl.user_errors`)."""
    parser = argparse.ArgumentParser(prog="dhpo-plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="trainer_state.json files or training output directories")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: folder names)")
    parser.add_argument("--out", required=True, help="directory for the PNG and SVG files")
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    args = parser.parse_args(argv)

    def report(figures: dict) -> None:
        for name in figures:
            print(Path(args.out) / f"{name}.png")
        plt.close("all")

    # Reading the runs and writing the figures is all this command does: both count as its input.
    return run_command("dhpo-plot", lambda: plot_runs(args.runs, args.labels, args.out), report, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
