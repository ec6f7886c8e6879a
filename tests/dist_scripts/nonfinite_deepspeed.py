"""Run under `torchrun --nproc_per_node 2` on CPU (DeepSpeed's CPU accelerator, gloo): the non-finite check under
DeepSpeed, whose engine steps inside backward, before transformers reads the norm.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/nonfinite_deepspeed.py OUT_DIR

Two runs, rank 1's forwards returning NaN during optimizer step 2:
- "zero2" (ZeRO stage 2, fp32, `stop_on_nonfinite_gradients` automatic): the engine's overflow check skips the step
  and reports an inf norm; both ranks raise `NonFiniteGradientError` for step 2, the message saying DeepSpeed stepped,
  and the parameters are those after step 1.
- "zero0_true" (no ZeRO, fp32: the engine computes no norm) with the setting `True`: refused naming the setting.
Each rank dumps OUT_DIR/rank{r}.json (checked by tests/test_nonfinite.py).
"""

import json
import os
import sys

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from dhpo_trl.demo.tiny import use_deepspeed_on_cpu  # noqa: E402

use_deepspeed_on_cpu()  # before deepspeed is first imported

import torch  # noqa: E402
from nonfinite_distributed import nonfinite_trainer  # noqa: E402  (this script's folder is first on sys.path)

from dhpo_trl import NonFiniteGradientError  # noqa: E402
from dhpo_trl.training.teardown import release_process_groups  # noqa: E402


def run(out_dir, stage: int, setting) -> dict:
    deepspeed = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                 "bf16": {"enabled": False}}  # fmt: skip
    trainer, after = nonfinite_trainer(os.path.join(out_dir, f"zero{stage}"), max_steps=2, deepspeed=deepspeed,
                                       stop_on_nonfinite_gradients=setting)  # fmt: skip
    result = {"outcome": "finished", "step": None, "norm": None, "deepspeed_named": False, "refused_setting": None}
    try:
        trainer.train()
    except NonFiniteGradientError as error:
        result.update(outcome="stopped", step=error.step, norm=error.norm, deepspeed_named="DeepSpeed" in str(error))
    except ValueError as error:
        result.update(outcome="refused", refused_setting="stop_on_nonfinite_gradients" in str(error))
    result["unchanged"] = after.unchanged()
    result["finite"] = all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    results = {"zero2": run(out, 2, None), "zero0_true": run(out, 0, True)}
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as handle:
        json.dump(results, handle)
    release_process_groups(barrier=False)
