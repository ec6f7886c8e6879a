#!/usr/bin/env bash
# GPU smoke test for issue 4: DHPO + DeepSpeed ZeRO-3 on ONE GPU with a tiny random Qwen3-MoE, a few off-policy
# steps. Prints the aux loss, the dhpo/ metrics, peak GPU memory and SMOKE OK/FAILED; writes $OUT/summary.json.
#   bash scripts/gpu_zero3_moe_smoke.sh            # needs a CUDA GPU and `pip install "deepspeed>=0.18.6,<0.20"`
#   OUT=/tmp/smoke STEPS=10 bash scripts/gpu_zero3_moe_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dhpo_zero3_moe_smoke}
STEPS=${STEPS:-6}
mkdir -p "$OUT"
python -c "import deepspeed, torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print('deepspeed', deepspeed.__version__, torch.cuda.get_device_name())"
accelerate launch --config_file accelerate_configs/zero3_moe.yaml --num_processes 1 \
  scripts/gpu_zero3_moe_smoke.py --output_dir "$OUT" --steps "$STEPS" "$@"
