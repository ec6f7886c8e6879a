"""Run under `torchrun --nproc_per_node 2` on CPU (gloo): one feature-matrix cell, recorded on every process.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/feature_matrix_distributed.py OUT_DIR CELL_JSON

Rank 0 gets long completions, rank 1 short ones. Each rank trains two optimizer steps and saves its recording
(micro-steps, step-start parameters, gradients, forward count) to OUT_DIR/rank{r}.pt; tests/test_feature_matrix.py
rebuilds the gradient from both recordings.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/

import torch  # noqa: E402

torch.set_num_threads(1)

import test_feature_matrix as matrix  # noqa: E402
from _teardown import destroy_process_group  # noqa: E402 - this folder is sys.path[0] under torchrun

from dhpo_trl.demo.tiny import build_char_tokenizer  # noqa: E402


def main():
    out, cell = Path(sys.argv[1]), tuple(json.loads(sys.argv[2]))
    config, _ = matrix.configure(out / "run", cell)
    _, recording, _ = matrix.train(build_char_tokenizer(), config, cell, long_rank=0)
    torch.save({"recording": recording, "world_size": torch.distributed.get_world_size()},
               out / f"rank{torch.distributed.get_rank()}.pt")  # fmt: skip


if __name__ == "__main__":
    try:
        main()
    finally:
        destroy_process_group()
