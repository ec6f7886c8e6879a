"""Smoke run: DHPO under DeepSpeed ZeRO-3 with a tiny random Qwen3-MoE; prints aux loss, dhpo/ metrics, peak memory.

On a GPU (what scripts/gpu_zero3_moe_smoke.sh runs):
    accelerate launch --config_file accelerate_configs/zero3_moe.yaml --num_processes 1 \
        scripts/gpu_zero3_moe_smoke.py --output_dir /tmp/smoke
On CPU, without DeepSpeed, or with DeepSpeed ZeRO-3 on CPU (gloo; 2 processes route tokens differently):
    python scripts/gpu_zero3_moe_smoke.py --cpu --steps 2 --output_dir /tmp/smoke
    torchrun --nproc_per_node 2 scripts/gpu_zero3_moe_smoke.py --cpu --cpu_zero3 --output_dir /tmp/smoke

Writes summary.json to --output_dir. Fails (exit 1) when the run did not do what it is meant to show: under
ZeRO-3 the MoE blocks must be marked as leaf modules and the policy wrapped by DeepSpeed; the aux loss must be
finite and positive; the steps must be off-policy (token ratios away from 1).
"""

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from dhpo_trl import DHPOConfig, DHPOTrainer  # noqa: E402
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3, use_deepspeed_on_cpu  # noqa: E402
from dhpo_trl.training.teardown import release_process_groups  # noqa: E402

# DeepSpeed config for the CPU check (on GPU, accelerate_configs/zero3_moe.yaml supplies the plugin instead).
CPU_ZERO3 = {
    "zero_optimization": {"stage": 3},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "bf16": {"enabled": False},
}


def _reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cpu", action="store_true", help="run on CPU (without DeepSpeed unless --cpu_zero3)")
    parser.add_argument(
        "--cpu_zero3", action="store_true", help="with --cpu: DeepSpeed ZeRO-3 on CPU (DS_ACCELERATOR=cpu, gloo)"
    )
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--max_completion_length", type=int, default=32)
    args = parser.parse_args(argv)
    if args.cpu and args.cpu_zero3:
        use_deepspeed_on_cpu()  # before deepspeed is first imported

    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer, moe=True, hidden_size=args.hidden_size, num_layers=4)
    # TRL requests router logits in its own forward; with the flag on in the config, transformers 5.17's generate()
    # breaks on the load-balancing loss (as in released Qwen3-MoE configs, it is off).
    model.config.output_router_logits = False
    config = DHPOConfig(
        output_dir=args.output_dir, report_to="none", save_strategy="no", seed=0, logging_steps=1,
        max_steps=args.steps, per_device_train_batch_size=8, num_generations=8, gradient_accumulation_steps=1,
        steps_per_generation=2, max_completion_length=args.max_completion_length, learning_rate=1e-3,
        use_cpu=args.cpu, bf16=not args.cpu, gradient_checkpointing=not args.cpu,
        deepspeed=CPU_ZERO3 if args.cpu and args.cpu_zero3 else None,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [f"{a}*{a + 1}=" for a in range(64)]})
    trainer = DHPOTrainer(model, _reward, args=config, train_dataset=dataset, processing_class=tokenizer)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start

    logs = [entry for entry in trainer.state.log_history if "aux_loss" in entry]
    deepspeed_on = trainer.is_deepspeed_enabled
    leaf_flagged = None
    if deepspeed_on:  # what the DeepSpeed engine itself sees as ZeRO-3 leaves
        from deepspeed.utils import z3_leaf_module

        leaf_flagged = sum(z3_leaf_module(m) for m in trainer.model_wrapped.module.modules())
    summary = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "deepspeed": deepspeed_on,
        "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage if deepspeed_on else None,
        "wrapped_model": type(trainer.model_wrapped).__name__,
        "zero3_leaf_modules": trainer.zero3_leaf_modules,
        "z3_leaf_flagged_modules": leaf_flagged,
        "processes": trainer.accelerator.num_processes,
        "steps": len(logs),
        "train_seconds": round(elapsed, 2),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "log": [
            {k: v for k, v in entry.items() if k in ("step", "loss", "aux_loss", "entropy") or k.startswith("dhpo/")}
            for entry in logs
        ],
    }
    print(json.dumps(summary, indent=2))
    if trainer.accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "summary.json"), "w") as handle:
            json.dump(summary, handle, indent=2)

    problems = []
    if deepspeed_on and summary["zero_stage"] == 3:
        if summary["zero3_leaf_modules"] != ["Qwen3MoeSparseMoeBlock"]:
            problems.append(f"leaf modules {summary['zero3_leaf_modules']}")
        if leaf_flagged != model.config.num_hidden_layers:
            problems.append(f"{leaf_flagged} modules flagged as ZeRO-3 leaves, expected one per layer")
        if summary["wrapped_model"] != "DeepSpeedEngine":
            problems.append(f"policy wrapped as {summary['wrapped_model']}")
    if len(logs) != args.steps:
        problems.append(f"{len(logs)} logged steps of {args.steps}")
    if not all(math.isfinite(e["aux_loss"]) and e["aux_loss"] > 0 for e in logs):
        problems.append("aux loss not finite and positive")
    if not any(e["dhpo/token_ratio/max"] - e["dhpo/token_ratio/min"] > 1e-4 for e in logs):
        problems.append("no off-policy step")
    if problems:
        print("SMOKE FAILED: " + "; ".join(problems), file=sys.stderr)
        sys.exit(1)
    print("SMOKE OK")
    return summary


if __name__ == "__main__":
    main()
    release_process_groups()  # the trainer is out of reach: its process groups go before the interpreter finalises
