"""Train with DHPO (or one of the paper's baselines) on a math dataset, TRL style.

    # one 8-GPU node, vLLM colocated with training; --overlay switches to another row of Table 1
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 8 examples/train_dhpo.py \
        --config examples/recipes/dhpo_e_qwen3_1.7b_base.yaml --overlay examples/recipes/algorithms/gspo.yaml \
        --vllm_mode colocate
    # the recipes' own vllm_mode, server: examples/vllm_server/ start the server, wait for it, then run this script
    bash examples/vllm_server/serve_and_train_single_node.sh

Every flag of `DHPOScriptArguments`, `DHPOConfig` and TRL's `ModelConfig` is accepted; see `dhpo_trl/scale_out/cli.py`.
The same entry point is installed as the `dhpo-train` command.
"""

import os
import sys

# Python puts this folder first on sys.path; a sub-folder named like a package (examples/vllm_server/) would then
# shadow the real one (TRL would take it for an installed vLLM). Import from site-packages instead.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

from dhpo_trl.scale_out.cli import main

if __name__ == "__main__":
    sys.exit(main())
