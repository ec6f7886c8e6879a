"""Run under `torchrun --nproc_per_node 2` on CPU (gloo): exact resume and graceful stop across processes.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/resume_distributed.py OUT_DIR [--zero3]

Four short DHPO-E runs (k = 4 optimizer steps per generation batch, save_steps=1), in one launch:
  full     uninterrupted, 6 steps;
  resumed  from full's checkpoint-3 (mid generation batch) to step 6;
  stopped  rank 0 sends itself SIGTERM at the end of step 2: only rank 0 is signalled, both must stop after step 2;
  after    from stopped's newest complete checkpoint (`latest`) to step 6;
  budget_full, budget_resumed  a token budget (max_tokens_per_micro_batch=24) splitting micro-steps into passes
           whose count the ranks agree on, 2 accumulation steps, k = 4; resumed from checkpoint-1;
  epoch_full, epoch_resumed  8 prompts, k = 2, logging every 3 steps: 4 steps per epoch, 8 steps; resumed from
           checkpoint-5 (epoch 2, mid generation batch; the next generation batch comes from epoch 2's order).
Every rank dumps OUT_DIR/<run>_rank{r}.json: final parameters, per-step logs, the data of every step, the step it
stopped at and the signal handlers after train() (they must be the previous ones again).

--zero3: instead, under DeepSpeed ZeRO-3 on CPU (gloo), with real generation (TRL's model.generate) and 2
accumulation steps per optimizer step, k = 2 optimizer steps per generation batch (steps_per_generation=4), 4 steps:
  z3_moe_full, z3_moe_resumed  the tiny Qwen3-MoE (its experts written one by one in model.safetensors, fused in the
              model and in DeepSpeed's own states, which the resume loads): uninterrupted; resumed from z3_moe_full's
              checkpoint-1 (mid generation batch). First, so that its models are built outside any ZeRO-3 context;
  z3_full     uninterrupted;
  z3_resumed  from z3_full's checkpoint-1 (mid generation batch) to step 4;
  z3_stopped  rank 0 sends itself SIGTERM at the end of step 1 (mid generation batch); no scheduled checkpoint;
  z3_after    from z3_stopped's newest complete checkpoint (`latest`) to step 4;
  z3_sync_full, z3_sync_resumed  beta 0.1 with `sync_ref_model` (the reference model mixed into the policy every
              step, partitioned like the policy), resumed from checkpoint-1; they also dump the reference model.
Each run writes only the checkpoints that a resume or a test reads (`SaveOnlyAt`). The parameters dumped are the
full ones, gathered from both ranks' partitions; every checkpoint also holds them whole in model.safetensors
(`stage3_gather_16bit_weights_on_model_save`; the model's dtype, float32 here).
"""

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

if "--zero3" in sys.argv:
    from dhpo_trl.demo.tiny import use_deepspeed_on_cpu

    use_deepspeed_on_cpu()  # before deepspeed is first imported

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from dhpo_trl.training.teardown import release_process_groups  # noqa: E402
from dhpo_trl import DHPOTrainer  # noqa: E402
from dhpo_trl.core.presets import config_for  # noqa: E402
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from zero3_config import residency, zero3  # noqa: E402

CPU = dict(use_cpu=True, bf16=False, report_to="none", seed=0, data_seed=0)
SETTINGS = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, logging_steps=1,
                learning_rate=3e-2, save_strategy="steps", save_steps=1, gradient_accumulation_steps=1,
                steps_per_generation=4, max_steps=6)  # fmt: skip
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


class RecordingTrainer(DHPOTrainer):
    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training:
            parts = inputs if isinstance(inputs, list) else [inputs]
            rows = [[p["prompt_ids"][i][p["prompt_mask"][i].bool()].tolist(),
                     p["completion_ids"][i][p["completion_mask"][i].bool()].tolist()]
                    for p in parts for i in range(p["prompt_ids"].size(0))]  # fmt: skip
            self.seen.setdefault(str(self.state.global_step + 1), []).extend(rows)
        return inputs


class SignalRankZeroAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and args.process_index == 0:
            os.kill(os.getpid(), signal.SIGTERM)


class SaveOnlyAt(TrainerCallback):
    """Of a run that saves every step, only the checkpoints of `steps`, those a run resumes from or a test reads: a
    ZeRO-3 checkpoint gathers the whole weights and writes every rank's partitions of the model and optimizer."""

    def __init__(self, *steps):
        self.steps = set(steps)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step not in self.steps:
            control.should_save = False


def digit_share(completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


EPOCH = dict(steps_per_generation=2, max_steps=8, logging_steps=3, prompts=8)
BUDGET = dict(gradient_accumulation_steps=2, steps_per_generation=8, max_steps=4, max_tokens_per_micro_batch=24)
ZERO3 = dict(gradient_accumulation_steps=2, steps_per_generation=4, max_steps=4,
             deepspeed={**zero3(stage3_gather_16bit_weights_on_model_save=True), "gradient_clipping": "auto"})


def full_parameters(model) -> dict:
    """Every parameter whole: under ZeRO-3 each rank holds a partition, gathered here (a collective: all ranks)."""
    gather = contextlib.nullcontext()
    if hasattr(next(model.parameters()), "ds_id"):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with gather:
        return {k: v.detach().flatten().tolist() for k, v in model.named_parameters()}


def run(out_dir: Path, name: str, output_dir: Path, tok, resume=None, callbacks=(), prompts=16, model=None,
        **overrides):  # fmt: skip
    args = config_for("DHPO-E", output_dir=str(output_dir), **{**SETTINGS, **overrides}, **CPU)
    dataset = Dataset.from_dict({"prompt": [f"{'x' * (a % 3)}{a}+{2 * a + 1}=" for a in range(prompts)]})
    trainer = RecordingTrainer(model=model or build_tiny_qwen3(tok, hidden_size=32, seed=0), reward_funcs=digit_share,
                               args=args, train_dataset=dataset, processing_class=tok, callbacks=list(callbacks))  # fmt: skip
    trainer.seen = {}
    before = signal.getsignal(signal.SIGTERM)
    trainer.train(resume_from_checkpoint=resume)
    dump = {
        "world_size": trainer.accelerator.num_processes,
        "global_step": trainer.state.global_step,
        "graceful_stop": trainer.graceful_stop,
        "handlers_restored": signal.getsignal(signal.SIGTERM) == before,
        "params": full_parameters(trainer.model),
        "logs": {str(e["step"]): {k: v for k, v in e.items() if k not in TIMINGS}
                 for e in trainer.state.log_history if "loss" in e},  # fmt: skip
        "train_loss": trainer.state.log_history[-1].get("train_loss"),
        "seen": trainer.seen,
        "checkpoints": sorted(p.name for p in output_dir.glob("checkpoint-*")),
        "zero3": residency(trainer.model),
    }
    if trainer.args.sync_ref_model:
        dump["ref_params"] = full_parameters(trainer.accelerator.unwrap_model(trainer.ref_model))
    rank = trainer.accelerator.process_index
    (out_dir / f"{name}_rank{rank}.json").write_text(json.dumps(dump))
    trainer.accelerator.wait_for_everyone()


def _cpu_map_location(load):
    """transformers loads the optimizer state with map_location=args.device when world_size > 1; on CPU that is
    `cpu:0`, which torch.load cannot restore to (a transformers 5.17 limitation of multi-process CPU runs only)."""

    def patched(*args, map_location=None, **kwargs):
        if isinstance(map_location, torch.device) and map_location.type == "cpu":
            map_location = "cpu"
        return load(*args, map_location=map_location, **kwargs)

    return patched


def main() -> None:
    torch.set_num_threads(1)
    torch.load = _cpu_map_location(torch.load)
    out_dir = Path(sys.argv[1])
    tok = build_char_tokenizer()
    if "--zero3" in sys.argv:
        # TRL builds the reference model from the policy's folder: one per rank, the same weights, saved before any
        # ZeRO-3 trainer exists (after one, a model built here is partitioned and saves no loadable folder)
        folder = out_dir / f"tiny_rank{os.environ.get('RANK', '0')}"
        build_tiny_qwen3(tok, hidden_size=32, seed=0).save_pretrained(folder)
        checkpoint = str(out_dir / "z3_moe_full" / "checkpoint-1")
        for name, resume in (("z3_moe_full", None), ("z3_moe_resumed", checkpoint)):
            model = build_tiny_qwen3(tok, hidden_size=32, seed=0, moe=True)
            run(out_dir, name, out_dir / name, tok, model=model, resume=resume, callbacks=[SaveOnlyAt(1)], **ZERO3)
        run(out_dir, "z3_full", out_dir / "z3_full", tok, callbacks=[SaveOnlyAt(1, 4)], **ZERO3)
        run(out_dir, "z3_resumed", out_dir / "z3_resumed", tok, resume=str(out_dir / "z3_full" / "checkpoint-1"),
            callbacks=[SaveOnlyAt(4)], **ZERO3)
        run(out_dir, "z3_stopped", out_dir / "z3_stopped", tok, callbacks=[SignalRankZeroAt(1)],
            **{**ZERO3, "save_steps": 10})  # its only checkpoint is the one the stop writes
        run(out_dir, "z3_after", out_dir / "z3_stopped", tok, resume="latest", callbacks=[SaveOnlyAt(4)], **ZERO3)
        sync = {**ZERO3, "beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5}
        run(out_dir, "z3_sync_full", out_dir / "z3_sync_full", tok, model=str(folder), callbacks=[SaveOnlyAt(1)],
            **sync)
        run(out_dir, "z3_sync_resumed", out_dir / "z3_sync_resumed", tok, model=str(folder),
            resume=str(out_dir / "z3_sync_full" / "checkpoint-1"), callbacks=[SaveOnlyAt()], **sync)
        release_process_groups()
        return
    run(out_dir, "full", out_dir / "full", tok, callbacks=[SaveOnlyAt(3)])
    run(out_dir, "resumed", out_dir / "resumed", tok, resume=str(out_dir / "full" / "checkpoint-3"),
        callbacks=[SaveOnlyAt()])
    run(out_dir, "stopped", out_dir / "stopped", tok, callbacks=[SignalRankZeroAt(2)])
    run(out_dir, "after", out_dir / "stopped", tok, resume="latest", callbacks=[SaveOnlyAt()])
    run(out_dir, "budget_full", out_dir / "budget_full", tok, callbacks=[SaveOnlyAt(1)], **BUDGET)
    run(out_dir, "budget_resumed", out_dir / "budget_resumed", tok, resume=str(out_dir / "budget_full" / "checkpoint-1"),
        callbacks=[SaveOnlyAt()], **BUDGET)
    run(out_dir, "epoch_full", out_dir / "epoch_full", tok, callbacks=[SaveOnlyAt(5)], **EPOCH)
    run(out_dir, "epoch_resumed", out_dir / "epoch_resumed", tok, resume=str(out_dir / "epoch_full" / "checkpoint-5"),
        callbacks=[SaveOnlyAt()], **EPOCH)
    release_process_groups()


if __name__ == "__main__":
    main()
