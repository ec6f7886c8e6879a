#!/usr/bin/env bash
# DHPO on several nodes with SLURM: the first node serves vLLM on its GPUs, the others train with ZeRO-3.
# Default: 5 nodes = 1 vLLM node + 4 x 8 training GPUs (the paper's 4 x 8 H100), Qwen3-30B-A3B-Base.
# Submit from the repository root, with the environment that has dhpo-trl, vLLM and DeepSpeed active:
#
#   sbatch examples/vllm_server/slurm_multi_node.sh
#   sbatch --nodes 3 examples/vllm_server/slurm_multi_node.sh --per_device_train_batch_size 8  # 1 vLLM + 2 x 8 GPUs
#   RECIPE=examples/recipes/dhpo_e_qwen3_4b_base.yaml SERVER_TP=8 \
#     sbatch --nodes 2 examples/vllm_server/slurm_multi_node.sh    # a dense model: tensor parallel, DP 1
#
# Extra arguments go to examples/train_dhpo.py. Settings (environment): RECIPE, MODEL (default: the recipe's),
# ACCELERATE_CONFIG, GPUS_PER_NODE, SERVER_TP (default 1) and SERVER_DP (default GPUS_PER_NODE / SERVER_TP),
# SERVER_PORT, SERVER_TIMEOUT, SERVER_ARGS, MASTER_PORT, DDP_TIMEOUT, LOG_DIR, and SERVER_ADDR / TRAINER_ADDR to
# override the addresses resolved from the node names. See docs/scale_out.md.
#SBATCH --job-name=dhpo
#SBATCH --nodes=5
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=32
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=72:00:00
#SBATCH --output=%x-%j.out
#SBATCH --requeue
#SBATCH --signal=B:USR1@900
# --output: Slurm opens it before the script runs and creates no folder, so it goes to the submit directory.
# --cpus-per-task: cores for the 8 training processes, their data loading and the math-verify reward (raise it to
# your nodes' core count). --mem=0: all of each node's RAM (CPU optimizer offload of 30B-A3B needs ~490 GB).
# --signal/--requeue: 15 minutes before the time limit Slurm sends SIGUSR1 to this script, which passes it to the
# training processes: they finish the optimizer step in progress, write a checkpoint and exit 0; the script then
# requeues the job, and the requeued job resumes from the newest complete checkpoint (--resume_from_checkpoint
# latest, which starts from step 0 when there is none). Leave one optimizer step plus one checkpoint write.
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
[[ -f examples/train_dhpo.py ]] || { echo "Submit from the repository root." >&2; exit 1; }
# shellcheck source=examples/vllm_server/wait_for_server.sh
source examples/vllm_server/wait_for_server.sh

export RECIPE=${RECIPE:-examples/recipes/dhpo_e_qwen3_30b_a3b_base.yaml}
[[ -f $RECIPE ]] || die "RECIPE=$RECIPE: no such file."
MODEL=${MODEL:-$(awk '$1 == "model_name_or_path:" { print $2 }' "$RECIPE")}  # server and trainer: the same model
[[ -n $MODEL ]] || die "Set MODEL: $RECIPE has no model_name_or_path."
export MODEL
export ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-accelerate_configs/multi_node_zero3.yaml}
export GPUS_PER_NODE=${GPUS_PER_NODE:-8}
SERVER_TP=${SERVER_TP:-1}   # 30B-A3B: with DP 8 its experts are sharded over all 8 GPUs (vLLM: TP x DP group)
SERVER_DP=${SERVER_DP:-$((GPUS_PER_NODE / SERVER_TP))}
export SERVER_PORT=${SERVER_PORT:-8000}
SERVER_TIMEOUT=${SERVER_TIMEOUT:-3600}  # seconds; a first start downloads the model (61 GB for 30B-A3B)
SERVER_ARGS=${SERVER_ARGS:-}
export MASTER_PORT=${MASTER_PORT:-29500}
export DDP_TIMEOUT=${DDP_TIMEOUT:-7200}
LOG_DIR=${LOG_DIR:-logs}
read -ra server_args <<<"$SERVER_ARGS"
# routing_replay: rollout (R3) replays the routing the server returns with each completion: ask the server for it.
routed_flag=$(routed_experts_flag "$RECIPE" "$@")
[[ -z $routed_flag ]] || server_args+=("$routed_flag")
(( SERVER_DP >= 1 && SERVER_TP * SERVER_DP <= GPUS_PER_NODE )) \
  || die "SERVER_TP=$SERVER_TP x SERVER_DP=$SERVER_DP must use 1 to $GPUS_PER_NODE GPUs of the vLLM node."
# Slurm >= 22.05: job steps no longer inherit --cpus-per-task; without this each srun task would get one core.
if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi

mapfile -t nodes < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?submit this script with sbatch}")
(( ${#nodes[@]} >= 2 )) || die "Need at least 2 nodes: 1 for vLLM, 1 or more for training."
train_nodes=("${nodes[@]:1}")
export NUM_TRAIN_NODES=${#train_nodes[@]}
# The server binds to its cluster address, not 0.0.0.0 (vLLM's dev mode has endpoints that overwrite weights), and
# training rank 0, on the first training node, tells the server's workers to join the weight sync at TRAINER_ADDR.
export SERVER_ADDR=${SERVER_ADDR:-$(resolve "${nodes[0]}")}
export TRAINER_ADDR=${TRAINER_ADDR:-$(resolve "${train_nodes[0]}")}
[[ -n $SERVER_ADDR && -n $TRAINER_ADDR ]] \
  || die "Cannot resolve ${nodes[0]} or ${train_nodes[0]}: set SERVER_ADDR and TRAINER_ADDR."
# The health probe and TRL's client (requests) must reach the server directly, not through a cluster HTTP proxy.
export no_proxy=$SERVER_ADDR,$TRAINER_ADDR${no_proxy:+,$no_proxy}
export NO_PROXY=$no_proxy

mkdir -p "$LOG_DIR"
log=$LOG_DIR/vllm-${SLURM_JOB_ID}.log
srun --nodes=1 --ntasks=1 --nodelist="${nodes[0]}" \
  trl vllm-serve --model "$MODEL" --host "$SERVER_ADDR" --port "$SERVER_PORT" \
  --tensor-parallel-size "$SERVER_TP" --data-parallel-size "$SERVER_DP" "${server_args[@]}" >"$log" 2>&1 &
server_pid=$!
trap 'kill "$server_pid" 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM
url=http://$SERVER_ADDR:$SERVER_PORT
wait_for_vllm_server "$url" "$server_pid" "$SERVER_TIMEOUT" "$log" $((SERVER_TP * SERVER_DP))

# One task per training node; SLURM_PROCID (0 .. NUM_TRAIN_NODES-1) is its machine rank. The single-quoted command
# is expanded on each node; the extra arguments reach train_dhpo.py unchanged as "$@" (bash -c '...' bash "$@").
# VLLM_HOST_IP is vLLM's variable, read by TRL on training rank 0 only, and set for the training nodes only.
# SIGUSR1 is ignored by the launcher (`trap "" USR1` before exec: its workers start ignoring it too, and dhpo-train
# handles it inside train() only), so the launcher does not die and kill its workers mid-checkpoint.
stop_requested=0
train_pid=
trap 'stop_requested=1; echo "SIGUSR1: training checkpoints and stops" >&2; [[ -z $train_pid ]] || kill -USR1 "$train_pid" 2>/dev/null || true' USR1
# shellcheck disable=SC2016
srun --nodes="$NUM_TRAIN_NODES" --ntasks="$NUM_TRAIN_NODES" --ntasks-per-node=1 \
  --nodelist="$(IFS=,; echo "${train_nodes[*]}")" bash -c '
  trap "" USR1
  VLLM_HOST_IP=$TRAINER_ADDR exec accelerate launch --config_file "$ACCELERATE_CONFIG" \
    --num_machines "$NUM_TRAIN_NODES" --num_processes $((NUM_TRAIN_NODES * GPUS_PER_NODE)) \
    --machine_rank "$SLURM_PROCID" --main_process_ip "$TRAINER_ADDR" --main_process_port "$MASTER_PORT" \
    examples/train_dhpo.py --config "$RECIPE" --model_name_or_path "$MODEL" \
    --use_vllm true --vllm_mode server --vllm_server_host "$SERVER_ADDR" --vllm_server_port "$SERVER_PORT" \
    --vllm_server_timeout 600 --ddp_timeout "$DDP_TIMEOUT" --resume_from_checkpoint latest "$@"' bash "$@" &
train_pid=$!
# srun passes the signal on to the training processes. `wait` returns early when a trapped signal arrives: wait again.
status=0
while :; do
  wait "$train_pid" && status=0 || status=$?
  if (( status > 128 )) && kill -0 "$train_pid" 2>/dev/null; then continue; fi
  break
done
if (( stop_requested && status == 0 )); then
  echo "Training stopped at a checkpoint: requeueing job $SLURM_JOB_ID, which resumes from it." >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
