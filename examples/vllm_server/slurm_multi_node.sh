#!/usr/bin/env bash
# DHPO on several nodes with SLURM: the first node serves vLLM, the others train with ZeRO-3.
# Default: 5 nodes = 1 vLLM node + 4 x 8 training GPUs (the paper's 4 x 8 H100), Qwen3-30B-A3B-Base.
#
#   sbatch examples/vllm_server/slurm_multi_node.sh                 # or: sbatch --nodes 3 ... (1 vLLM + 2 training)
#   MODEL=... RECIPE=... sbatch examples/vllm_server/slurm_multi_node.sh --per_device_train_batch_size 8
#
# Extra arguments go to examples/train_dhpo.py. accelerate's YAML cannot read environment variables, so each
# training node gets its rank and the rendezvous address on the command line (--machine_rank $SLURM_PROCID ...).
#SBATCH --job-name=dhpo
#SBATCH --nodes=5
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --time=72:00:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}"

export MODEL=${MODEL:-Qwen/Qwen3-30B-A3B-Base}
export RECIPE=${RECIPE:-examples/recipes/dhpo_e_qwen3_30b_a3b_base.yaml}
export ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-accelerate_configs/multi_node_zero3.yaml}
export GPUS_PER_NODE=${GPUS_PER_NODE:-8}
VLLM_TP=${VLLM_TP:-1}                  # 30B-A3B in bf16 (61 GB) fits one 80 GB GPU, with a small KV cache;
VLLM_DP=${VLLM_DP:-$GPUS_PER_NODE}     # TP=2, DP=4 gives each replica more KV cache. TP x DP = GPUs of the node.
export VLLM_PORT=${VLLM_PORT:-8000}

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
(( ${#NODES[@]} >= 2 )) || { echo "need at least 2 nodes: 1 for vLLM, 1+ for training" >&2; exit 1; }
export VLLM_NODE=${NODES[0]}
TRAIN_NODES=("${NODES[@]:1}")
export NUM_TRAIN_NODES=${#TRAIN_NODES[@]}
export MASTER_ADDR=${TRAIN_NODES[0]}
export MASTER_PORT=${MASTER_PORT:-29500}
export EXTRA_ARGS="$*"
mkdir -p logs

srun --nodes=1 --ntasks=1 --nodelist="$VLLM_NODE" \
  trl vllm-serve --model "$MODEL" --tensor-parallel-size "$VLLM_TP" --data-parallel-size "$VLLM_DP" \
  --host 0.0.0.0 --port "$VLLM_PORT" > "logs/vllm-${SLURM_JOB_ID}.log" 2>&1 &

# One task per training node; SLURM_PROCID (0..NUM_TRAIN_NODES-1) is the node's machine rank.
srun --nodes="$NUM_TRAIN_NODES" --ntasks="$NUM_TRAIN_NODES" --ntasks-per-node=1 \
  --nodelist="$(IFS=,; echo "${TRAIN_NODES[*]}")" bash -c '
  accelerate launch --config_file "$ACCELERATE_CONFIG" \
    --num_machines "$NUM_TRAIN_NODES" --num_processes $((NUM_TRAIN_NODES * GPUS_PER_NODE)) \
    --machine_rank "$SLURM_PROCID" --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" \
    examples/train_dhpo.py --config "$RECIPE" --model_name_or_path "$MODEL" \
    --use_vllm true --vllm_mode server \
    --vllm_server_host "$VLLM_NODE" --vllm_server_port "$VLLM_PORT" --vllm_server_timeout 1800 \
    $EXTRA_ARGS'
