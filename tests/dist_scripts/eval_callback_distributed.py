"""Run under `torchrun --nproc_per_node N` on CPU (gloo): BenchmarkEvalCallback inside a short DHPO run, dumped per rank.

Usage: torchrun --nproc_per_node N tests/dist_scripts/eval_callback_distributed.py OUT_DIR MODEL_DIR EVAL_JSON
       [--zero3] [--steps S] [--learning_rate LR]

The policy is loaded from MODEL_DIR; EVAL_JSON holds {"benchmarks": {name: [rows]}, "callback": {keyword arguments of
BenchmarkEvalCallback}}. The callback is attached,
evaluates at the start and after the last step. Each rank writes eval_rank{r}.json: the callback's history, per
evaluation the prompts this rank sampled, its generate() calls and the wall time, and under --zero3 the ZeRO-3 parameter fetches
made while evaluating (zero when the weights are gathered once) next to those of one plain generate() on the
partitioned model (the control: the counter does count). Rank 0 also saves the final weights (final.pt). A
collective that waits past COLLECTIVE_SECONDS for the other rank raises (`ddp_timeout`, which DHPOConfig hands to the CPU process group), and the launch
fails.
"""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "--zero3" in sys.argv:
    from dhpo_trl.demo.tiny import use_deepspeed_on_cpu

    use_deepspeed_on_cpu()  # before deepspeed is first imported

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationMixin  # noqa: E402

from dhpo_trl.training.teardown import release_process_groups  # noqa: E402
from dhpo_trl import DHPOConfig, DHPOTrainer  # noqa: E402
from dhpo_trl.evaluation import BenchmarkEvalCallback  # noqa: E402
from dhpo_trl.evaluation.backends import TransformersBackend  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from zero3_config import residency, zero3  # noqa: E402

CPU_ZERO3 = zero3()  # every forward, and the gather for generation, gathers from both ranks
# gloo's limit on one collective: a collective one rank runs alone (the weights gathered for generation on one rank
# only) fails the launch within about a minute instead of blocking it until the test's deadline.
COLLECTIVE_SECONDS = 60


def _reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


class Counters:
    """Prompts and generate() calls of the transformers backend, and ZeRO-3 parameter fetches, while `active`."""

    def __init__(self):
        self.active, self.prompts, self.calls, self.fetches = False, 0, 0, 0
        sample, generate = TransformersBackend.generate, GenerationMixin.generate

        def counting_sample(backend, prompt_ids, num_samples, settings):
            self.prompts += len(prompt_ids)
            return sample(backend, prompt_ids, num_samples, settings)

        def counting_generate(model, *args, **kwargs):
            self.calls += self.active
            return generate(model, *args, **kwargs)

        TransformersBackend.generate, GenerationMixin.generate = counting_sample, counting_generate
        if "--zero3" in sys.argv:
            from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

            fetch = PartitionedParameterCoordinator.fetch_sub_module

            def counting_fetch(coordinator, *args, **kwargs):
                self.fetches += self.active
                return fetch(coordinator, *args, **kwargs)

            PartitionedParameterCoordinator.fetch_sub_module = counting_fetch

    def measure(self, function, *args):
        self.active, self.prompts, self.calls, self.fetches = True, 0, 0, 0
        started = time.perf_counter()
        try:
            result = function(*args)
        finally:
            self.active = False
        counts = {"prompts": self.prompts, "generate_calls": self.calls, "zero3_fetches": self.fetches}
        return result, {**counts, "seconds": round(time.perf_counter() - started, 3)}


def deepspeed_gathered(model):
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


def collective_seconds() -> float:
    """The default process group's limit on one collective, as gloo holds it."""
    backend = torch.distributed.group.WORLD._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


def main():
    out_dir, model_dir, eval_json = sys.argv[1:4]
    zero3 = "--zero3" in sys.argv
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 2
    learning_rate = float(sys.argv[sys.argv.index("--learning_rate") + 1]) if "--learning_rate" in sys.argv else 5e-4
    counters = Counters()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = DHPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0, logging_steps=1,
        per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=1, steps_per_generation=2,
        max_completion_length=6, max_steps=steps, learning_rate=learning_rate, deepspeed=CPU_ZERO3 if zero3 else None,
        ddp_timeout=COLLECTIVE_SECONDS,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [f"What is {a} plus {a}?" for a in range(16)]})
    trainer = DHPOTrainer(model, _reward, args=config, train_dataset=dataset, processing_class=tokenizer)
    with open(eval_json) as handle:
        spec = json.load(handle)
    callback = BenchmarkEvalCallback(
        spec["benchmarks"], every_n_steps=steps, eval_on_start=True, **spec["callback"]
    ).attach(trainer)
    measured = []
    evaluate = callback.evaluate

    def measured_evaluate(*args):
        metrics, counts = counters.measure(evaluate, *args)
        measured.append(counts)
        return metrics

    callback.evaluate = measured_evaluate
    trainer.train()

    rank = trainer.accelerator.process_index
    dump = {"world_size": trainer.accelerator.num_processes, "history": callback.history, "evaluations": measured,
            "deepspeed": trainer.is_deepspeed_enabled, "zero3": residency(model),
            "collective_seconds": collective_seconds()}  # fmt: skip
    if zero3:
        # Control: one generate() on the partitioned model, as an un-gathered evaluation would run it.
        prompt = tokenizer(["What is 1 plus 1?"], return_tensors="pt")
        _, control = counters.measure(lambda: trainer.model.generate(**prompt, max_new_tokens=4, do_sample=False))
        dump["control"] = control
    with deepspeed_gathered(trainer.model) if zero3 else contextlib.nullcontext():
        weights = {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}
    with open(os.path.join(out_dir, f"eval_rank{rank}.json"), "w") as handle:
        json.dump(dump, handle)
    if rank == 0:
        torch.save(weights, os.path.join(out_dir, "final.pt"))


if __name__ == "__main__":
    main()
    release_process_groups()
