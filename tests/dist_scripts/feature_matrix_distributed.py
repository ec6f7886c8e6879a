"""Run under `torchrun --nproc_per_node 2` on CPU (gloo): feature-matrix cells, one after the other in one launch,
recorded on every process.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/feature_matrix_distributed.py OUT_DIR CELLS_JSON

CELLS_JSON is a list of [cell, config overrides]. Rank 0 gets long completions, rank 1 short ones. For cell k, each
rank trains its optimizer steps and saves its recording (micro-steps, step-start parameters, gradients, forward
count) and its log history to OUT_DIR/cell{k}_rank{r}.pt; tests/test_feature_matrix.py rebuilds the gradient from
both recordings. One launch for every cell: the launcher and the imports cost ~15 s each time.
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

from dhpo_trl.training.teardown import release_process_groups  # noqa: E402
from dhpo_trl.demo.tiny import build_char_tokenizer  # noqa: E402


def main():
    out, cells = Path(sys.argv[1]), json.loads(sys.argv[2])
    tok = build_char_tokenizer()
    for index, (cell, overrides) in enumerate(cells):
        cell = tuple(cell)
        config, _ = matrix.configure(out / f"run{index}", cell, **overrides)
        trainer, recording, _ = matrix.train(tok, config, cell, long_rank=0)
        torch.save({"recording": recording, "log_history": trainer.state.log_history,
                    "world_size": torch.distributed.get_world_size()},
                   out / f"cell{index}_rank{torch.distributed.get_rank()}.pt")  # fmt: skip


if __name__ == "__main__":
    main()
    release_process_groups()
