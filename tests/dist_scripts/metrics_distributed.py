"""Run under `torchrun --nproc_per_node 2` on CPU (gloo): the trainer's metrics on slices of the fixed batch.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/metrics_distributed.py OUT_DIR

Each scenario gives every rank some rows of tests/metric_batch.py's batch (or an all-padding slice), calls
`compute_loss` once and dumps the metrics it logged to OUT_DIR/metrics_rank{r}.json. The metrics are reduced over
both ranks, so each rank must log those of the whole batch (checked by tests/test_metrics_distributed.py).
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for metric_batch

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from metric_batch import GMPO_EPSILONS, WIDTH, build_policy, clip_info, epsilons_for, inputs_for  # noqa: E402
from transformers import Qwen3ForCausalLM  # noqa: E402

from dhpo_trl.training.teardown import release_process_groups  # noqa: E402
from dhpo_trl import DHPOConfig, DHPOTrainer  # noqa: E402
from dhpo_trl.core import metrics  # noqa: E402
from dhpo_trl.demo.tiny import build_char_tokenizer  # noqa: E402

# name: (config overrides, rows of rank 0, rows of rank 1, whether rank 1's slice is all padding)
SCENARIOS = {
    "dhpo_split": ({"entropy_norm_scope": "global"}, [0, 1, 2], [3, 4], False),
    "dhpo_padding_rank": ({"entropy_norm_scope": "global"}, [0, 1, 2, 3, 4], [0, 1], True),
    "gmpo_split": ({"algorithm": "gmpo", **GMPO_EPSILONS}, [3, 4], [0, 1, 2], False),
}


def main(out_dir):
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    policy_dir = Path(out_dir) / f"policy_rank{rank}"  # a path, so that TRL can load the reference model (beta > 0)
    build_policy(tokenizer).save_pretrained(policy_dir)
    dumps = {}
    for name, (overrides, rows0, rows1, padding) in SCENARIOS.items():
        args = DHPOConfig(
            output_dir=str(Path(out_dir) / name), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
            per_device_train_batch_size=5, num_generations=5, max_completion_length=WIDTH, beta=0.04,
            **{**epsilons_for(overrides), **overrides},
        )  # fmt: skip
        trainer = DHPOTrainer(
            Qwen3ForCausalLM.from_pretrained(policy_dir), lambda completions, **kw: [0.0] * len(completions),
            args=args, train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 10}), processing_class=tokenizer,
        )  # fmt: skip
        assert trainer.accelerator.num_processes == 2
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        inputs = inputs_for(trainer.model, rows0 if rank == 0 else rows1, all_padding=padding and rank == 1)
        trainer.compute_loss(trainer.model, inputs)
        dumps[name] = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    # TRL's clip metrics: rank 0 holds rows 0-1 of the CLIP_ tables, rank 1 rows 2-3 (the all-padding row and the
    # row that alone holds neither extreme); each rank must log those of all four rows.
    sums, maxima = metrics.clip_sums("clip_ratio", *clip_info([0, 1] if rank == 0 else [2, 3]))
    dumps["trl_clip"] = metrics.clip_metrics("clip_ratio", *metrics.reduce_across(sums, maxima, trainer._all_reduce))
    (Path(out_dir) / f"metrics_rank{rank}.json").write_text(json.dumps(dumps))


if __name__ == "__main__":
    main(sys.argv[1])
    release_process_groups()
