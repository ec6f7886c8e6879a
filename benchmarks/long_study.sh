#!/usr/bin/env bash
# The long-completion study (docs/study/long_completions.md) in the background, from a pinned copy of the code, so
# that later edits of the checkout never change a running study.
#
#   bash benchmarks/long_study.sh OUT_DIR [COMMIT]      # start, or resume: finished cells in OUT_DIR are reused
#   bash benchmarks/long_study.sh OUT_DIR --report      # write docs/study/long_completions.{md,json} + plots here
#
# COMMIT (default HEAD) is checked out detached in OUT_DIR/code; a resumed study keeps the commit it started with.
# The run is niced, detached from the shell (setsid nohup), logs to OUT_DIR/log.txt and its pid is OUT_DIR/pid.
# Python: $PYTHON, else this checkout's .venv. Every cell is one `run_embedded` on one torch thread; 7 objectives x
# k = 4, 16 x 3 seeds, GRPO and DHPO-E at k = 1 x 3 seeds, and the two-digit reference cells (seed 0) for the
# spread comparison: 48 long cells of about 3 CPU minutes each (5-7 minutes of wall time each on a loaded 2-core
# machine; the log gives every cell's time and what is left).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: bash benchmarks/long_study.sh OUT_DIR [COMMIT | --report]}
out=$(mkdir -p "$out" && cd "$out" && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
study_args=(--task long --objectives GRPO GSPO SAPO CISPO DHPO-A DHPO-E DHPO-E+GSPO-seq-clip --ks 4 16 1
            --on-policy-objectives GRPO DHPO-E --seeds 0 1 2 --reference-seeds 0 --generation-batches 8
            --eval-every 4 --workers 1 --out-dir "$out")
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [[ ${2:-} == --report ]]; then  # the page from the finished cells, in this checkout's docs/study
    cd "$repo" && exec "$python" benchmarks/staleness.py "${study_args[@]}" --report-only
fi
if [[ -f $out/pid ]] && kill -0 "$(cat "$out/pid")" 2>/dev/null; then
    echo "long_study: already running as pid $(cat "$out/pid") (log: $out/log.txt)" >&2
    exit 1
fi
if [[ ! -d $out/code ]]; then
    git -C "$repo" worktree add --detach "$out/code" "${2:-HEAD}"
elif [[ -n ${2:-} && $(git -C "$out/code" rev-parse HEAD) != $(git -C "$repo" rev-parse "$2") ]]; then
    echo "long_study: $out/code is at $(git -C "$out/code" rev-parse --short HEAD), not $2: a study resumes with" \
         "the code it started with (use another OUT_DIR for other code)" >&2
    exit 1
fi
cd "$out/code"
PYTHONPATH="$out/code" setsid nohup nice -n 10 "$python" benchmarks/staleness.py "${study_args[@]}" \
    --docs-dir "$out/docs" >> "$out/log.txt" 2>&1 < /dev/null &
echo $! > "$out/pid"
echo "long_study: pid $(cat "$out/pid"), code $(git rev-parse --short HEAD) in $out/code, log $out/log.txt"
