# shellcheck shell=bash
# Helpers sourced by the launch scripts in this folder.

die() {
  echo "$*" >&2
  exit 1
}

# wait_for_vllm_server URL PID TIMEOUT_S LOG WORLD_SIZE
# Polls URL/health every SERVER_POLL_S seconds while process PID (the server, or the srun running it) lives.
# Returns once the server answers and reports WORLD_SIZE = TP x DP workers on /get_world_size (an endpoint of vLLM's
# dev mode, which TRL's weight sync needs). Exits the script, with the end of LOG, if PID dies or TIMEOUT_S passes:
# a server that crashes at start costs seconds, not the trainer's full wait and a collective timeout.
wait_for_vllm_server() {
  local url=$1 pid=$2 timeout=$3 log=$4 world_size=$5 start=$SECONDS status=0 answer
  command -v curl >/dev/null || die "curl is needed to probe the vLLM server"
  # --noproxy '*': cluster nodes often set http_proxy, which must not see requests to the server.
  until curl --noproxy '*' -sf -o /dev/null "$url/health"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid" || status=$?
      echo "The vLLM server exited (status $status) before answering $url/health. End of $log:" >&2
      tail -n 30 "$log" >&2
      exit 1
    fi
    if (( SECONDS - start >= timeout )); then
      die "The vLLM server did not answer $url/health within SERVER_TIMEOUT=$timeout s (still loading? see $log)."
    fi
    sleep "${SERVER_POLL_S:-3}"
  done
  answer=$(curl --noproxy '*' -sf "$url/get_world_size") \
    || die "$url/get_world_size does not answer: start the server with \`trl vllm-serve\` (vLLM's dev mode)."
  [[ $answer =~ \"world_size\":\ *${world_size}[^0-9] ]] \
    || die "The vLLM server at $url reports $answer, expected world_size $world_size (TP x DP): another server?"
  echo "vLLM server up at $url after $((SECONDS - start)) s ($answer)"
}

# The first IPv4 address of a host name, as the cluster's resolver gives it.
resolve() {
  getent ahostsv4 "$1" | awk 'NR == 1 { print $1 }'
}

# routed_experts_flag RECIPE ARGS...
# Prints --enable-return-routed-experts when the run replays the server's routing (routing_replay: rollout, R3): the
# last --routing_replay among the training ARGS, else the last overlay's or the recipe's `routing_replay:` line.
routed_experts_flag() {
  local mode file
  mode=$(awk '$1 == "routing_replay:" { print $2 }' "$1")
  shift
  while (( $# )); do
    case $1 in
      --overlay)
        file=${2:-}
        if [[ -f $file ]]; then mode=$(awk -v m="$mode" '$1 == "routing_replay:" { m = $2 } END { print m }' "$file"); fi
        shift ;;
      --routing_replay) mode=${2:-}; shift ;;
      --routing_replay=*) mode=${1#*=} ;;
    esac
    shift
  done
  if [[ $mode == rollout ]]; then echo --enable-return-routed-experts; fi
}
