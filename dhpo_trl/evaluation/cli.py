"""`python -m dhpo_trl.evaluation` / `dhpo-evaluate`: score a model or checkpoint on the paper's benchmarks.

Everything that can be wrong with the input (benchmark names, data files, the checkpoint path) is checked before a
model is loaded, so a typo costs seconds, not a GPU allocation.

    dhpo-evaluate outputs/dhpo/checkpoint-500 --benchmarks all --data-dir benchmarks/ --output results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..user_errors import (DEBUG_FLAG, DEBUG_HELP, check_model_path, debug_given, make_folder, positive_int,
                           run_command, seed_int)
from .backends import SamplingSettings, TransformersBackend, VLLMBackend, vllm_available
from .benchmarks import BENCHMARKS, check_benchmark_keys, load_benchmark, resolve_benchmark_names, resolve_sources
from .metrics import format_table
from .runner import evaluate_problems


class InputError(ValueError):
    """Bad command-line input, found before any model was loaded."""


def check_model_source(model: str) -> str:
    """A local checkpoint directory with config.json, or a Hub id; anything path-like that is missing is an error."""
    return check_model_path(model, label="Checkpoint path")


def _check_device(device: str | None) -> None:
    import torch

    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA GPU is visible (torch.cuda.is_available() is False); use cpu.")


def _key_values(pairs: list[str], option: str) -> dict[str, str]:
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{option} expects NAME=VALUE, got {pair!r}.")
        parsed[key.strip().lower()] = value.strip()
    return parsed


def _positive_int(text: str, option: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{option} must be a positive whole number of samples, got {text!r}.")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dhpo-evaluate",
        description="Score a model on AIME24/25, AMC23, OlympiadBench, MATH-500, Minerva Math and GSM8K with the "
        "DHPO paper's protocol (SimpleRL prompt, temperature 1.0, 16K new tokens, Avg@32/Avg@4/Pass@1).",
    )
    parser.add_argument("model", help="checkpoint directory or Hub model id")
    parser.add_argument("--tokenizer", help="tokenizer path or id (default: the model's)")
    parser.add_argument("--benchmarks", default="all", help=f"comma-separated from {list(BENCHMARKS)} or 'all'")
    parser.add_argument("--data-dir", help="directory holding <benchmark>/test.jsonl")
    parser.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="NAME=PATH_OR_HUB_ID",
        help="data for one benchmark: a JSONL file, a directory with test.jsonl, or a Hub dataset id",
    )
    parser.add_argument("--split", default="test", help="split to read from Hub datasets")
    parser.add_argument(
        "--samples",
        action="append",
        default=[],
        metavar="NAME=K",
        help="samples per problem for one benchmark (default: 32 AIME, 4 AMC23, 1 others)",
    )
    parser.add_argument("--limit", type=positive_int, help="evaluate only the first N problems of each benchmark")
    parser.add_argument("--max-new-tokens", type=positive_int, default=16384)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument(
        "--answer-fallback",
        choices=["none", "last_number"],
        default="none",
        help="a completion without \\boxed{}: scored 0 (none, as the training reward), or by its last number "
        "(last_number, as SimpleRL-Zoo's evaluation)",
    )
    parser.add_argument(
        "--backend",
        choices=["auto", "vllm", "transformers"],
        default="auto",
        help="auto: vLLM when installed with a CUDA GPU, else transformers",
    )
    parser.add_argument("--output", default="eval_results.json", help="JSON file for scores and per-problem results")
    parser.add_argument("--label", help="row label in the table (default: the model path)")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"], help="model weights"
    )
    vllm_group = parser.add_argument_group("vLLM backend")
    vllm_group.add_argument("--tensor-parallel-size", type=positive_int, default=1)
    vllm_group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    vllm_group.add_argument("--max-model-len", type=positive_int, help="default: the model's own limit")
    hf_group = parser.add_argument_group("transformers backend")
    hf_group.add_argument("--batch-size", type=positive_int, default=8, help="sequences per generate() call")
    hf_group.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    return parser


def check_flags_act(args, names: list[str], backend: str, parser: argparse.ArgumentParser) -> None:
    """A ValueError naming a per-benchmark flag for a benchmark `names` leaves out, or a flag of another backend's
    argument group set (away from its default) for `backend`."""
    for flag, pairs in (("--samples", args.samples), ("--data", args.data)):
        unselected = sorted(set(_key_values(pairs, flag)) - set(names))
        if unselected:
            raise ValueError(f"{flag} names {unselected}, which --benchmarks leaves out ({','.join(names)}): add them "
                             f"to --benchmarks or drop them from {flag}.")  # fmt: skip
    groups = {group.title.split()[0].lower(): [action.dest for action in group._group_actions]
              for group in parser._action_groups if str(group.title).endswith(" backend")}  # "vLLM backend": vllm
    for other, fields in groups.items():
        for field in fields if other != backend else ():
            if getattr(args, field) != parser.get_default(field):
                flag = "--" + field.replace("_", "-")
                raise ValueError(f"{flag} acts with the {other} backend only, and this run uses {backend}: pass "
                                 f"--backend {other}, or drop {flag}.")  # fmt: skip


def _load_transformers_backend(args) -> TransformersBackend:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    return TransformersBackend(model, tokenizer, batch_size=args.batch_size)


def prepare(argv: list[str] | None = None) -> dict:
    """Parse and check every input (benchmarks, data, samples, checkpoint path, output folder), then load the
    backend: what `main` reports as input errors. Raises InputError before any model is loaded."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # validate everything before touching a model
        names = resolve_benchmark_names(args.benchmarks)
        samples = {
            name: _positive_int(k, f"--samples {name}") for name, k in _key_values(args.samples, "--samples").items()
        }
        check_benchmark_keys(samples, "--samples")
        settings = SamplingSettings(args.max_new_tokens, args.temperature, args.top_p, args.seed)
        sources = resolve_sources(names, data_dir=args.data_dir, data=_key_values(args.data, "--data"))
        problems = {name: load_benchmark(name, sources[name], split=args.split, limit=args.limit) for name in names}
        check_model_source(args.model)
        _check_device(args.device)
        backend_name = args.backend
        if backend_name == "auto":
            backend_name = "vllm" if vllm_available() else "transformers"
        check_flags_act(args, names, backend_name, parser)
    except ValueError as error:
        raise InputError(str(error)) from error
    output_path = Path(args.output)
    make_folder(output_path.parent, "--output")

    started = time.time()
    if backend_name == "vllm":
        from transformers import AutoTokenizer

        backend = VLLMBackend(
            args.model,
            tokenizer=args.tokenizer,
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            dtype=args.dtype,
            seed=args.seed,
        )
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    else:
        backend = _load_transformers_backend(args)
        tokenizer = backend.tokenizer
    return {
        "args": args, "backend": backend, "backend_name": backend_name, "tokenizer": tokenizer, "problems": problems,
        "settings": settings, "samples": samples, "sources": sources, "output_path": output_path, "started": started,
    }  # fmt: skip


def evaluate(prepared: dict) -> dict:
    """Sample and score the prepared problems; write the JSON report and print the table."""
    args, settings, output_path = prepared["args"], prepared["settings"], prepared["output_path"]
    results = evaluate_problems(
        prepared["backend"], prepared["tokenizer"], prepared["problems"], settings, prepared["samples"],
        fallback=args.answer_fallback,
        log=lambda message: print(message, file=sys.stderr),
    )  # fmt: skip
    label = args.label or args.model
    scores = {name: result["score"] for name, result in results["benchmarks"].items()}
    used_samples = {name: result["samples_per_problem"] for name, result in results["benchmarks"].items()}
    table = format_table({label: scores}, used_samples)
    report = {
        "model": args.model,
        "label": label,
        "scores": scores,
        "average": results["average"],
        "average_over": results["average_over"],
        "table": table,
        "settings": {
            "backend": prepared["backend_name"],
            "prompt": "simplerl",
            "max_new_tokens": settings.max_new_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "seed": settings.seed,
            "answer_fallback": args.answer_fallback,
            "limit": args.limit,
            "samples_per_problem": used_samples,
            "data": {name: str(source) for name, source in prepared["sources"].items()},
            "wall_seconds": round(time.time() - prepared["started"], 2),
        },
        "benchmarks": results["benchmarks"],
    }
    output_path.write_text(json.dumps(report, indent=2, ensure_ascii=False), encoding="utf-8")
    print(table)
    print(f"\nWrote {output_path}", file=sys.stderr)
    return report


def run(argv: list[str] | None = None) -> dict:
    """Check the input, load the model, evaluate; return the report (what `dhpo-evaluate` writes)."""
    return evaluate(prepare(argv))


def main(argv: list[str] | None = None) -> int:
    """`dhpo-evaluate`: 0, or 2 after a one-line error for bad input (see `dhpo_trl.user_errors`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command("dhpo-evaluate", lambda: prepare(argv), evaluate, debug=debug_given(argv))
