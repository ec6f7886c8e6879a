"""The parts of `scripts/gpu_check.sh` that are not a test file or a benchmark: each writes one JSON file.

    python scripts/gpu_check_parts.py wheels --wheels .gpu_wheels --site /tmp/dhpo_site --json wheels.json
    python scripts/gpu_check_parts.py environment --json environment.json
    python scripts/gpu_check_parts.py train --device cuda --shape qwen3-0.6b --json train.json

* `wheels`: installs the carried wheels (`scripts/fetch_gpu_wheels.sh` fills the folder) whose distribution this
  Python lacks or has at another version, into `--site` (no network, no dependency resolution), then checks the
  requirements of what it installed. `--check-only` decides without installing (the CPU dry run).
* `environment`: Python, torch, the GPU, the varlen kernels, and every pinned package's version against the pin of
  pyproject.toml; one line per mismatch or missing piece, saying what to do.
* `train`: DHPO-E off-policy steps with generation on the device, on a randomly initialised Qwen3 (`--shape
  qwen3-0.6b`, or `tiny` for the dry run): losses, the logged metrics, peak memory, the update path and the attention
  kernels that ran. Exits 1 when a loss is not finite or nothing was logged.

Imports beyond the standard library happen inside the parts, so `wheels` runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("trl", "datasets", "math-verify")  # not on the GPU image; the rest of the stack is
FETCH = "run `bash scripts/fetch_gpu_wheels.sh` on a machine with PyPI and carry .gpu_wheels"


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_identity(filename: str) -> tuple[str, str]:
    """(normalised distribution, version) of a wheel file name (PEP 427: name-version-...)."""
    parts = Path(filename).name.split("-")
    if len(parts) < 5 or not filename.endswith(".whl"):
        raise ValueError(f"{filename}: not a wheel file name (name-version-python-abi-platform.whl)")
    return normalise(parts[0]), parts[1]


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def choose_wheels(wheels: list[str], installed: dict[str, str | None]) -> tuple[list[str], list[str]]:
    """(wheels to install, wheels whose version is already installed). Two versions of one distribution are refused:
    pip would install both over each other."""
    seen: dict[str, str] = {}
    install, present = [], []
    for wheel in sorted(wheels):
        name, version = wheel_identity(wheel)
        if name in seen:
            raise ValueError(f"two wheels of {name}: {seen[name]} and {Path(wheel).name}; keep one")
        seen[name] = Path(wheel).name
        (present if installed.get(name) == version else install).append(wheel)
    return install, present


def unmet_requirements(names: list[str]) -> list[str]:
    """One line per requirement of `names` (installed distributions) that this Python does not satisfy."""
    from packaging.requirements import Requirement

    lines = []
    for name in names:
        for text in importlib.metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            found = installed_version(requirement.name)
            if found is None or not requirement.specifier.contains(found, prereleases=True):
                lines.append(f"{name} {installed_version(name)} requires {requirement.name}{requirement.specifier}, "
                             f"found {found or 'nothing'}")  # fmt: skip
    return lines


def file_names(paths: list[str]) -> list[str]:
    return [Path(path).name for path in paths]


def wheels_part(options) -> tuple[dict, int]:
    folder = Path(options.wheels)
    wheels = sorted(str(path) for path in folder.glob("*.whl")) if folder.is_dir() else []
    names = [wheel_identity(wheel)[0] for wheel in wheels]
    install, present = choose_wheels(wheels, {name: installed_version(name) for name in names})
    report = {"folder": str(folder), "wheels": file_names(wheels), "install": file_names(install),
              "already_installed": file_names(present), "site": None, "notes": []}  # fmt: skip
    if install and not options.check_only:
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", options.site, *install]  # fmt: skip
        subprocess.run(command, check=True)
        sys.path.insert(0, options.site)
        report["site"] = options.site
    missing = [name for name in REQUIRED if installed_version(name) is None and name not in names]
    if missing:
        report["notes"].append(f"{', '.join(missing)} not installed and no wheel of it in {folder}: {FETCH}")
    if not wheels:
        report["notes"].append(f"no wheels in {folder}: {FETCH}")
    report["unmet_requirements"] = unmet_requirements([n for n in names if installed_version(n) is not None])
    return report, 1 if missing else 0


# ------------------------------------------------------------------------------------------------- environment
def pins() -> dict[str, str]:
    """pyproject.toml's dependencies: normalised name -> specifier."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {normalise(r.name): str(r.specifier) for r in map(Requirement, project["dependencies"])}


def pin_lines(versions: dict[str, str | None], pinned: dict[str, str]) -> list[str]:
    """One line per pinned package that is missing or outside its pin."""
    from packaging.specifiers import SpecifierSet

    lines = []
    for name, specifier in pinned.items():
        found = versions.get(name)
        if found is None:
            lines.append(f"{name} is not installed (pinned {specifier}): {FETCH}")
        elif not SpecifierSet(specifier).contains(found, prereleases=True):
            lines.append(f"{name} {found} is outside the pinned {specifier}: the figures below are for {name} {found}")
    return lines


def load_attention_kernels():
    """dhpo_trl/training/attention_kernels.py on its own (the package's __init__ would import trl)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("attention_kernels", ROOT / "dhpo_trl/training/attention_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def environment_part(options) -> tuple[dict, int]:
    import torch

    attention_kernels = load_attention_kernels()

    pinned = pins()
    versions = {name: installed_version(name) for name in pinned}
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    cuda = torch.cuda.is_available()
    report = {
        "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": cuda, "device_name": torch.cuda.get_device_name() if cuda else None,
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
        "varlen_attn_parameters": sorted(attention_kernels.parameter_names(varlen_attn)) if varlen_attn else None,
        "flash_kernels_in_torch": torch.backends.cuda.is_flash_attention_available(),
        "varlen_kernels": list(attention_kernels.available()), "versions": versions, "pins": pinned,
        "notes": pin_lines(versions, pinned),
    }  # fmt: skip
    if not cuda and not options.cpu:
        report["notes"].append("no CUDA device is visible to torch: run this on a GPU machine (or `bash "
                               "scripts/gpu_check.sh --cpu OUTPUT_DIR` for the CPU dry run)")  # fmt: skip
    if varlen_attn is None:
        report["notes"].append(f"torch {torch.__version__} has no torch.nn.attention.varlen: packed rows on CUDA run "
                               "the per-sequence SDPA loop; use torch>=2.10 or install flash-attn")  # fmt: skip
    return report, 0


# ------------------------------------------------------------------------------------------------------- train
def content_reward(completions, **kwargs):
    return [float(sum(map(ord, text)) % 5) for text in completions]


def train_part(options) -> tuple[dict, int]:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback

    sys.path.insert(0, str(ROOT))
    from dhpo_trl import DHPOTrainer
    from dhpo_trl.core.presets import config_for
    from dhpo_trl.demo.tiny import QWEN3_SHAPES, build_char_tokenizer, build_qwen3_shape, build_tiny_qwen3
    from dhpo_trl.training import attention_kernels

    cuda = options.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("train: no CUDA device is visible to torch; run on a GPU machine, or --device cpu")
    if options.shape == "tiny":
        tokenizer = build_char_tokenizer()
        model = build_tiny_qwen3(tokenizer, hidden_size=64, num_layers=2, num_heads=4).to(options.device)
    else:  # filler tokens, so that every id the random model generates decodes
        tokenizer = build_char_tokenizer(QWEN3_SHAPES[options.shape]["vocab_size"])
        model = build_qwen3_shape(tokenizer, options.shape, device=options.device, max_position_embeddings=4096)
    # off-policy: steps_per_generation = 2 x gradient_accumulation_steps, two optimizer steps per generation batch
    args = config_for(
        "DHPO-E", output_dir=options.output_dir, per_device_train_batch_size=options.batch_size, num_generations=4,
        gradient_accumulation_steps=2, steps_per_generation=4, max_completion_length=options.max_completion,
        max_steps=options.steps, learning_rate=1e-6, logging_steps=1, save_strategy="no", report_to="none", seed=0,
        bf16=cuda, use_cpu=not cuda, disable_tqdm=True,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [f"{a}+{3 * a + 7}=" for a in range(64)]})
    trainer = DHPOTrainer(model=model, reward_funcs=content_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer)  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    calls, start = attention_kernels.CALLS.copy(), time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    losses = [entry["loss"] for entry in logs]
    report = {
        "shape": options.shape, "device": options.device, "parameters": sum(p.numel() for p in model.parameters()),
        "steps": options.steps, "seconds": seconds, "losses": losses,
        "metrics_logged": sorted({key for entry in logs for key in entry}),
        "last_log": logs[-1] if logs else None, "padding_free": trainer._update.padding_free,
        "attention_kernels": dict(attention_kernels.CALLS - calls),
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }  # fmt: skip
    finite = bool(losses) and all(math.isfinite(loss) for loss in losses)
    ratios = [entry.get("dhpo/token_ratio/max", 1.0) - entry.get("dhpo/token_ratio/min", 1.0) for entry in logs]
    report["off_policy_seen"] = max(ratios, default=0.0) > 0
    report["ok"] = finite and len(logs) == options.steps
    return report, 0 if report["ok"] else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="part", required=True)
    wheels = sub.add_parser("wheels")
    wheels.add_argument("--wheels", default=str(ROOT / ".gpu_wheels"))
    wheels.add_argument("--site", default="/tmp/dhpo_site")
    wheels.add_argument("--check-only", action="store_true", help="decide what would be installed; install nothing")
    environment = sub.add_parser("environment")
    environment.add_argument("--cpu", action="store_true", help="the CPU dry run: no GPU expected")
    train = sub.add_parser("train")
    train.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    train.add_argument("--shape", choices=["qwen3-0.6b", "qwen3-1.7b", "tiny"], default="qwen3-0.6b")
    train.add_argument("--steps", type=int, default=4)
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--max-completion", type=int, default=128)
    train.add_argument("--output-dir", default="/tmp/dhpo_gpu_check_train")
    for each in (wheels, environment, train):
        each.add_argument("--json", required=True, help="where the part writes its figures")
    options = parser.parse_args(argv)
    run = {"wheels": wheels_part, "environment": environment_part, "train": train_part}[options.part]
    report, code = run(options)
    Path(options.json).write_text(json.dumps(report, indent=1, default=str))
    for note in report.get("notes", []):
        print(f"NOTE: {note}")
    return code


if __name__ == "__main__":
    sys.exit(main())
