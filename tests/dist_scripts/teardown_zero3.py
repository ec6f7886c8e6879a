"""A DHPO run under DeepSpeed ZeRO-3 on CPU (one optimizer step), then `release_process_groups()`; each rank writes
the gloo threads left after the release to OUT_DIR/rank{r}.json.

Usage: torchrun --nproc_per_node N tests/dist_scripts/teardown_zero3.py OUT_DIR [--keep-deepspeed-references]
(`--keep-deepspeed-references`: the release without dropping DeepSpeed's references to the destroyed groups).
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from dhpo_trl.demo.tiny import use_deepspeed_on_cpu  # noqa: E402

use_deepspeed_on_cpu()  # before deepspeed is first imported

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from dhpo_trl import DHPOTrainer  # noqa: E402
from dhpo_trl.core.presets import config_for  # noqa: E402
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3  # noqa: E402
from dhpo_trl.training import teardown  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from zero3_config import zero3  # noqa: E402

ZERO3 = {**zero3(), "gradient_clipping": "auto"}


def train(out_dir: Path) -> None:
    """One step; the trainer is out of reach once this returns, as `dhpo-train` leaves it before the release."""
    tok = build_char_tokenizer()
    args = config_for("DHPO-E", output_dir=str(out_dir / "run"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, gradient_accumulation_steps=2, steps_per_generation=4, max_steps=1,
                      save_strategy="no", use_cpu=True, bf16=False, report_to="none", deepspeed=ZERO3)  # fmt: skip
    trainer = DHPOTrainer(model=build_tiny_qwen3(tok, hidden_size=32, seed=0),
                          reward_funcs=lambda completions, **kwargs: [0.5] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(8)]}),
                          processing_class=tok)  # fmt: skip
    trainer.train()


def main() -> None:
    torch.set_num_threads(1)
    out_dir = Path(sys.argv[1])
    train(out_dir)
    if "--keep-deepspeed-references" in sys.argv:
        teardown.drop_deepspeed_group_references = lambda: 0
    rank = int(os.environ.get("RANK", "0"))
    left = teardown.release_process_groups()
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"threads": left}))


if __name__ == "__main__":
    main()
