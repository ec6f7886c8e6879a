"""Exit check: consecutive two-process `dhpo-train` runs (torchrun, gloo, CPU), counted by how they end.

Usage: python scripts/exit_loop.py [--runs 40] [--modes ddp zero3] [--timeout 180] [--out DIR]

Each run trains a tiny local Qwen3 for 2 steps with one checkpoint and the final save, under DDP or DeepSpeed ZeRO-3
(CPU accelerator, gloo), and is classified as
  ok     exit status 0;
  abort  a rank killed by a signal (SIGABRT: "terminate called without an active exception", gloo's threads at
         interpreter finalisation);
  fail   any other non-zero exit;
  hang   still running `--timeout` seconds after its start: every rank's threads are dumped with
         `py-spy dump --native` (when installed) into OUT/<mode>-<run>.hang.txt before the run is killed.
Also measured: the seconds from the last file written in the output folder (the final model card) to the exit.
The runs are sequential: one two-process run at a time, with one torch thread per rank.
Prints one line per run and a JSON summary; stdout and stderr of every run that is not ok stay in OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import processes  # noqa: E402 - kills the whole tree of a run (torchrun's workers sit in sessions of their own)
import tiny_cli  # noqa: E402 - the tiny run of tests/test_cli.py

ZERO3 = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
         "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "bf16": {"enabled": False}}  # fmt: skip
RANK_ENTRY = "--rank-entry"


def rank_entry(argv: list[str]) -> int:
    """What each torchrun worker runs: `dhpo-train` itself, after choosing DeepSpeed's CPU accelerator for ZeRO-3."""
    if "--deepspeed" in argv:
        from dhpo_trl.demo.tiny import use_deepspeed_on_cpu

        use_deepspeed_on_cpu()  # before deepspeed is first imported
    from dhpo_trl.scale_out.cli import main

    return main(argv)


def build_inputs(folder: Path) -> tuple[Path, Path, Path]:
    """A tiny local model, an 8-problem jsonl and the ZeRO-3 config, written once for every run."""
    folder.mkdir(parents=True, exist_ok=True)
    model = tiny_cli.write_model(folder / "model")
    data = tiny_cli.write_problems(folder / "train.jsonl")
    zero3 = folder / "zero3.json"
    zero3.write_text(json.dumps(ZERO3))
    return model, data, zero3


def train_flags(model: Path, data: Path, output_dir: Path) -> list[str]:
    """tests/test_cli.py's run: 2 optimizer steps, a checkpoint at step 2, then the final save."""
    return tiny_cli.train_flags(model, data, output_dir, "--disable_tqdm", "true")


def last_write(folder: Path) -> float | None:
    times = [path.stat().st_mtime for path in folder.rglob("*") if path.is_file()]
    return max(times) if times else None


def dump_ranks(launcher: subprocess.Popen, path: Path) -> None:
    """Every thread of every process under the launcher, native frames included (py-spy), into `path`."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    sections = []
    for pid in [launcher.pid, *processes.descendants(launcher.pid)]:
        try:
            found = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                   timeout=60)  # fmt: skip
            sections.append(f"== pid {pid}\n{found.stdout}{found.stderr}")
        except (OSError, subprocess.TimeoutExpired) as error:
            sections.append(f"== pid {pid}: no dump ({error})")
    path.write_text("\n".join(sections))


def one_run(mode: str, index: int, inputs, out: Path, timeout: float) -> dict:
    model, data, zero3 = inputs
    output_dir = Path(tempfile.mkdtemp(prefix=f"{mode}-{index}-", dir=out))
    flags = train_flags(model, data, output_dir) + (["--deepspeed", str(zero3)] if mode == "zero3" else [])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(Path(__file__).resolve()), RANK_ENTRY, *flags]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}  # fmt: skip
    log = out / f"{mode}-{index}"
    start = time.monotonic()
    with open(f"{log}.out", "w") as stdout, open(f"{log}.err", "w") as stderr:
        launcher = processes.popen(command, stdout=stdout, stderr=stderr, env=env, cwd=ROOT)
        try:
            launcher.wait(timeout=timeout)
            ended = time.time()
        except subprocess.TimeoutExpired:
            ended = None
            dump_ranks(launcher, Path(f"{log}.hang.txt"))
        finally:
            processes.kill_tree(launcher)
    err = Path(f"{log}.err").read_text()
    if ended is None:
        outcome = "hang"
    elif launcher.returncode == 0:
        outcome = "ok"
    else:
        outcome = "abort" if "Signal 6 (SIGABRT)" in err or "exitcode: -6" in err else "fail"
    written = last_write(output_dir)
    result = {"mode": mode, "run": index, "outcome": outcome, "returncode": launcher.returncode,
              "seconds": round(time.monotonic() - start, 1),
              "save_to_exit_s": round(ended - written, 2) if ended and written else None}  # fmt: skip
    shutil.rmtree(output_dir, ignore_errors=True)
    if outcome == "ok":
        for suffix in (".out", ".err"):
            Path(f"{log}{suffix}").unlink()
    return result


def summary(results: list[dict]) -> dict:
    by_mode = {}
    for mode in dict.fromkeys(result["mode"] for result in results):
        rows = [result for result in results if result["mode"] == mode]
        exits = [row["save_to_exit_s"] for row in rows if row["outcome"] == "ok" and row["save_to_exit_s"] is not None]
        by_mode[mode] = {
            "runs": len(rows),
            **{outcome: sum(row["outcome"] == outcome for row in rows) for outcome in ("ok", "abort", "fail", "hang")},
            "save_to_exit_s_median": statistics.median(exits) if exits else None,
            "save_to_exit_s_max": max(exits) if exits else None,
        }
    return by_mode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="runs per mode")
    parser.add_argument("--modes", nargs="+", choices=("ddp", "zero3"), default=["ddp", "zero3"])
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds before a run counts as hung")
    parser.add_argument("--out", type=Path, default=None, help="folder for the logs of runs that are not ok")
    parser.add_argument("--interleave", action="store_true", help="alternate the modes run by run")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="exit-loop-"))
    out.mkdir(parents=True, exist_ok=True)
    inputs = build_inputs(out / "inputs")
    order = ([(mode, i) for i in range(args.runs) for mode in args.modes] if args.interleave
             else [(mode, i) for mode in args.modes for i in range(args.runs)])  # fmt: skip
    results = []
    for mode, index in order:
        results.append(one_run(mode, index, inputs, out, args.timeout))
        print(json.dumps(results[-1]), flush=True)
    report = summary(results)
    print(json.dumps({"summary": report, "logs": str(out)}, indent=1), flush=True)
    return 0 if all(row["ok"] == row["runs"] for row in report.values()) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == RANK_ENTRY:
        sys.exit(rank_entry(sys.argv[2:]))
    sys.exit(main())
