#!/usr/bin/env bash
# DHPO with a vLLM server on one 8-GPU node: GPUs 0-3 generate (`trl vllm-serve`), GPUs 4-7 train (ZeRO-3).
# The paper's generation batch (512 prompts x 16 = 8192 completions) splits only over a power-of-two number of
# training processes, hence 4 + 4 rather than 1 + 7.
#
#   bash examples/vllm_server/serve_and_train_single_node.sh                     # the Qwen3-1.7B-Base recipe
#   RECIPE=examples/recipes/dhpo_e_qwen3_4b_base.yaml \
#     bash examples/vllm_server/serve_and_train_single_node.sh --output_dir outputs/dhpo_e_4b
#   # Qwen3-30B-A3B on one node: 4 training GPUs hold it only with the optimizer in CPU RAM (~490 GB, see
#   # docs/scale_out.md); the MoE server runs 4 data-parallel engines (its experts are sharded over all 4 GPUs).
#   RECIPE=examples/recipes/dhpo_e_qwen3_30b_a3b_base.yaml ACCELERATE_CONFIG=accelerate_configs/zero3_offload.yaml \
#     SERVER_TP=1 SERVER_DP=4 bash examples/vllm_server/serve_and_train_single_node.sh
#
# The script starts the server, waits until it answers (or stops at once, printing the server log, if it dies),
# trains, and stops the server at the end. Extra arguments go to examples/train_dhpo.py and override the recipe.
# Settings (environment): RECIPE, MODEL (default: the recipe's model_name_or_path), ACCELERATE_CONFIG, SERVER_GPUS,
# TRAIN_GPUS, SERVER_TP x SERVER_DP = number of SERVER_GPUS, SERVER_PORT, SERVER_TIMEOUT (seconds), SERVER_ARGS (more
# flags for `trl vllm-serve`), DDP_TIMEOUT, LOG_DIR; docs/scale_out.md explains them. No VLLM_* names: vLLM reads
# that prefix itself (VLLM_PORT, for one, is the base of its internal ports, not the API port).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/vllm_server/wait_for_server.sh
source examples/vllm_server/wait_for_server.sh

RECIPE=${RECIPE:-examples/recipes/dhpo_e_qwen3_1.7b_base.yaml}
[[ -f $RECIPE ]] || die "RECIPE=$RECIPE: no such file."
MODEL=${MODEL:-$(awk '$1 == "model_name_or_path:" { print $2 }' "$RECIPE")}  # server and trainer: the same model
[[ -n $MODEL ]] || die "Set MODEL: $RECIPE has no model_name_or_path."
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-accelerate_configs/zero3.yaml}
SERVER_GPUS=${SERVER_GPUS:-0,1,2,3}
TRAIN_GPUS=${TRAIN_GPUS:-4,5,6,7}
SERVER_TP=${SERVER_TP:-4}              # tensor parallel: each layer split over TP GPUs (the way for dense models)
SERVER_DP=${SERVER_DP:-1}              # data parallel engines: MoE models only in TRL 1.16 (dense models: 1)
SERVER_PORT=${SERVER_PORT:-8000}
SERVER_TIMEOUT=${SERVER_TIMEOUT:-1800} # seconds; a first start downloads the model
SERVER_ARGS=${SERVER_ARGS:-}           # e.g. "--max-model-len 5120 --enable-expert-parallel"
DDP_TIMEOUT=${DDP_TIMEOUT:-7200}       # seconds ranks wait in a collective while rank 0 talks to the server
LOG_DIR=${LOG_DIR:-logs}
read -ra server_args <<<"$SERVER_ARGS"
# routing_replay: rollout (R3) replays the routing the server returns with each completion: ask the server for it.
routed_flag=$(routed_experts_flag "$RECIPE" "$@")
[[ -z $routed_flag ]] || server_args+=("$routed_flag")
num_server_gpus=$(tr ',' '\n' <<<"$SERVER_GPUS" | wc -l)
num_train_gpus=$(tr ',' '\n' <<<"$TRAIN_GPUS" | wc -l)
(( num_server_gpus == SERVER_TP * SERVER_DP )) \
  || die "SERVER_GPUS=$SERVER_GPUS lists $num_server_gpus GPU(s); SERVER_TP x SERVER_DP = $((SERVER_TP * SERVER_DP))."

url=http://127.0.0.1:$SERVER_PORT
! curl --noproxy '*' -sf -o /dev/null "$url/health" \
  || die "A server already answers at $url: stop it, or choose another SERVER_PORT."
mkdir -p "$LOG_DIR"
log=$LOG_DIR/vllm_server.log
# 127.0.0.1: `trl vllm-serve` runs vLLM in dev mode, whose endpoints can overwrite weights: keep it off the network.
# setsid: the server and the engine processes it spawns form one process group, stopped together on exit.
CUDA_VISIBLE_DEVICES=$SERVER_GPUS setsid trl vllm-serve --model "$MODEL" --host 127.0.0.1 --port "$SERVER_PORT" \
  --tensor-parallel-size "$SERVER_TP" --data-parallel-size "$SERVER_DP" "${server_args[@]}" >"$log" 2>&1 &
server_pid=$!
trap 'kill -- -"$server_pid" 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM
echo "vLLM server (pid $server_pid) loading $MODEL on GPU(s) $SERVER_GPUS; log: $log"
wait_for_vllm_server "$url" "$server_pid" "$SERVER_TIMEOUT" "$log" $((SERVER_TP * SERVER_DP))

# VLLM_HOST_IP: the address training rank 0 gives the server's workers for its weight-sync group (vLLM's get_ip()).
CUDA_VISIBLE_DEVICES=$TRAIN_GPUS VLLM_HOST_IP=127.0.0.1 accelerate launch --config_file "$ACCELERATE_CONFIG" \
  --num_processes "$num_train_gpus" examples/train_dhpo.py --config "$RECIPE" --model_name_or_path "$MODEL" \
  --use_vllm true --vllm_mode server --vllm_server_host 127.0.0.1 --vllm_server_port "$SERVER_PORT" \
  --vllm_server_timeout 600 --ddp_timeout "$DDP_TIMEOUT" "$@"
