#!/usr/bin/env bash
# DHPO with vLLM in server mode on one 8-GPU node: GPUs 0-3 generate (trl vllm-serve, tensor parallel 4),
# GPUs 4-7 train (ZeRO-3). The paper's generation batch (512 prompts x 16 = 8192 completions) only splits evenly
# over a power-of-two number of training processes, hence 4 + 4 rather than 1 + 7.
#
#   bash examples/vllm_server/serve_and_train_single_node.sh                       # Qwen3-1.7B-Base recipe
#   MODEL=Qwen/Qwen3-30B-A3B-Base RECIPE=examples/recipes/dhpo_e_qwen3_30b_a3b_base.yaml \
#     ACCELERATE_CONFIG=accelerate_configs/zero3_moe.yaml VLLM_GPUS=0,1,2,3 VLLM_TP=2 VLLM_DP=2 \
#     bash examples/vllm_server/serve_and_train_single_node.sh --per_device_train_batch_size 2
#
# Extra arguments go to examples/train_dhpo.py (they override the recipe). The server needs VLLM_TP x VLLM_DP GPUs;
# the trainer's batch plan adapts to the number of TRAIN_GPUS. See docs/scale_out.md for the settings.
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-Qwen/Qwen3-1.7B-Base}
RECIPE=${RECIPE:-examples/recipes/dhpo_e_qwen3_1.7b_base.yaml}
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-accelerate_configs/zero3.yaml}
VLLM_GPUS=${VLLM_GPUS:-0,1,2,3}
TRAIN_GPUS=${TRAIN_GPUS:-4,5,6,7}
VLLM_TP=${VLLM_TP:-4}   # tensor parallel: split each layer over GPUs (for a model that does not fit on one)
VLLM_DP=${VLLM_DP:-1}   # data parallel: independent replicas (MoE models only in TRL 1.16; dense: keep 1)
VLLM_PORT=${VLLM_PORT:-8000}
VLLM_HOST=127.0.0.1
NUM_TRAIN_PROCESSES=$(tr ',' '\n' <<<"$TRAIN_GPUS" | wc -l)

if (( $(tr ',' '\n' <<<"$VLLM_GPUS" | wc -l) != VLLM_TP * VLLM_DP )); then
  echo "VLLM_GPUS=$VLLM_GPUS must list VLLM_TP x VLLM_DP = $((VLLM_TP * VLLM_DP)) GPUs" >&2
  exit 1
fi

mkdir -p logs
CUDA_VISIBLE_DEVICES=$VLLM_GPUS trl vllm-serve --model "$MODEL" \
  --tensor-parallel-size "$VLLM_TP" --data-parallel-size "$VLLM_DP" \
  --host 0.0.0.0 --port "$VLLM_PORT" > logs/vllm_server.log 2>&1 &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null || true' EXIT
echo "vLLM server (pid $SERVER_PID) loading $MODEL on GPU(s) $VLLM_GPUS; log: logs/vllm_server.log"

# The trainer waits up to --vllm_server_timeout seconds for the server's /health, before loading its own model.
CUDA_VISIBLE_DEVICES=$TRAIN_GPUS accelerate launch --config_file "$ACCELERATE_CONFIG" \
  --num_processes "$NUM_TRAIN_PROCESSES" \
  examples/train_dhpo.py --config "$RECIPE" --model_name_or_path "$MODEL" \
  --use_vllm true --vllm_mode server \
  --vllm_server_host "$VLLM_HOST" --vllm_server_port "$VLLM_PORT" --vllm_server_timeout 1800 \
  "$@"
