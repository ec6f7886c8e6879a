#!/usr/bin/env bash
# Sourced by long_study.sh and power_study.sh: one study of benchmarks/staleness.py in the background, from a pinned
# copy of the code, so that later edits of the checkout never change a running study.
#
#   pinned_study NAME NICENESS OUT_DIR [COMMIT | --report] -- STALENESS_ARGS...
#
# COMMIT (default HEAD) is checked out detached in OUT_DIR/code; a resumed study keeps the commit it started with and
# reuses the finished cells in OUT_DIR. --report writes the page from the finished cells into this checkout's
# docs/study instead. The run is niced, detached from the shell (setsid nohup), logs to OUT_DIR/log.txt and its pid
# is OUT_DIR/pid. Python: $PYTHON, else this checkout's .venv.

pinned_study() {
    local name=$1 niceness=$2 out=$3 second=$4 repo python
    shift 5  # NAME NICENESS OUT_DIR SECOND --
    repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    out=$(mkdir -p "$out" && cd "$out" && pwd)
    python=${PYTHON:-$repo/.venv/bin/python}
    local study_args=("$@" --out-dir "$out")
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

    if [[ $second == --report ]]; then
        cd "$repo" && exec "$python" benchmarks/staleness.py "${study_args[@]}" --report-only
    fi
    if [[ -f $out/pid ]] && kill -0 "$(cat "$out/pid")" 2>/dev/null; then
        echo "$name: already running as pid $(cat "$out/pid") (log: $out/log.txt)" >&2
        exit 1
    fi
    if [[ ! -d $out/code ]]; then
        git -C "$repo" worktree add --detach "$out/code" "${second:-HEAD}"
    elif [[ -n $second && $(git -C "$out/code" rev-parse HEAD) != $(git -C "$repo" rev-parse "$second") ]]; then
        echo "$name: $out/code is at $(git -C "$out/code" rev-parse --short HEAD), not $second: a study resumes" \
             "with the code it started with (use another OUT_DIR for other code)" >&2
        exit 1
    fi
    cd "$out/code" || exit 1
    PYTHONPATH="$out/code" setsid nohup nice -n "$niceness" "$python" benchmarks/staleness.py "${study_args[@]}" \
        --docs-dir "$out/docs" >> "$out/log.txt" 2>&1 < /dev/null &
    echo $! > "$out/pid"
    echo "$name: pid $(cat "$out/pid"), code $(git rev-parse --short HEAD) in $out/code, log $out/log.txt"
}
