#!/usr/bin/env bash
# The powered long-completion study (docs/study/long_completions_power.md): each cell's final accuracy also measured
# on a large held-out set, in the background, from a pinned copy of the code, like benchmarks/long_study.sh.
#
#   bash benchmarks/power_study.sh OUT_DIR [COMMIT]      # start, or resume: finished cells in OUT_DIR are reused
#   bash benchmarks/power_study.sh OUT_DIR --report      # write docs/study/long_completions_power.{md,json} here
#
# COMMIT (default HEAD) is checked out detached in OUT_DIR/code; a resumed study keeps the commit it started with.
# The run is niced to 19 (it shares the machine), detached (setsid nohup), logs to OUT_DIR/log.txt, pid in
# OUT_DIR/pid. Python: $PYTHON, else this checkout's .venv. One worker, one torch thread. Cells run k = 4 first, then
# k = 16, seed-major (every objective of seed 0, then seed 1, ...), so a study stopped early has whole seeds.
# Each cell is about 2.5 CPU minutes of training plus the final evaluation (about 0.15 CPU s per problem).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: bash benchmarks/power_study.sh OUT_DIR [COMMIT | --report]}
out=$(mkdir -p "$out" && cd "$out" && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
study_args=(--task long --objectives GRPO GSPO SAPO DHPO-A DHPO-E --ks 4 16 --seeds 0 1 2 --final-heldout 2000
            --generation-batches 8 --eval-every 4 --workers 1 --out-dir "$out")
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [[ ${2:-} == --report ]]; then  # the page from the finished cells, in this checkout's docs/study
    cd "$repo" && exec "$python" benchmarks/staleness.py "${study_args[@]}" --report-only
fi
if [[ -f $out/pid ]] && kill -0 "$(cat "$out/pid")" 2>/dev/null; then
    echo "power_study: already running as pid $(cat "$out/pid") (log: $out/log.txt)" >&2
    exit 1
fi
if [[ ! -d $out/code ]]; then
    git -C "$repo" worktree add --detach "$out/code" "${2:-HEAD}"
elif [[ -n ${2:-} && $(git -C "$out/code" rev-parse HEAD) != $(git -C "$repo" rev-parse "$2") ]]; then
    echo "power_study: $out/code is at $(git -C "$out/code" rev-parse --short HEAD), not $2: a study resumes with" \
         "the code it started with (use another OUT_DIR for other code)" >&2
    exit 1
fi
cd "$out/code"
PYTHONPATH="$out/code" setsid nohup nice -n 19 "$python" benchmarks/staleness.py "${study_args[@]}" \
    --docs-dir "$out/docs" >> "$out/log.txt" 2>&1 < /dev/null &
echo $! > "$out/pid"
echo "power_study: pid $(cat "$out/pid"), code $(git rev-parse --short HEAD) in $out/code, log $out/log.txt"
