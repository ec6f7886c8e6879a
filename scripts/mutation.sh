#!/usr/bin/env bash
# Mutation testing of dhpo_trl/ with mutmut 3 (configured in pyproject.toml, [tool.mutmut]); see docs/testing.md.
#
#   scripts/mutation.sh                    # every module of dhpo_trl/
#   scripts/mutation.sh core/losses training/moe  # only these modules (paths under dhpo_trl/, with or without .py)
#   scripts/mutation.sh evaluation/metrics  # a module of a subpackage
#
# Each mutant runs, in one worker process, only the tests that call the mutated function (mutmut's per-function
# selection). mutmut keeps its results in mutants/ and only retests functions whose code changed since the last
# run; delete mutants/ to start from scratch. Prints the score of each module at the end; inspect a survivor with
# `mutmut show <name>` (run from the repository root with the same environment).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import mutmut" 2>/dev/null; then  # no active environment with the dev extra: make one
  # shellcheck disable=SC1091
  . scripts/setup_env.sh
  python -c "import mutmut" 2>/dev/null || python -m pip install -q -e ".[dev]"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
# The mutated copy first on the path, also for the subprocesses some tests start (they then see the mutant too).
# The folder must exist before Python starts: a path entry that is missing at start-up is never searched again,
# and an editable install of another checkout would then be tested instead of the mutants.
mkdir -p mutants
export PYTHONPATH="$PWD/mutants"

patterns=()
for module in "$@"; do
  module="${module#dhpo_trl/}"
  module="${module%.py}"
  if [ ! -f "dhpo_trl/$module.py" ]; then
    echo "scripts/mutation.sh: no module dhpo_trl/$module.py (pass names like 'losses' or 'evaluation/metrics')" >&2
    exit 2
  fi
  patterns+=("dhpo_trl.${module//\//.}.*")
done

# One worker: the machine is small and shared, and the tests use one torch thread each.
start=$(date +%s)
mutmut run --max-children 1 "${patterns[@]}" || status=$?
echo "mutation run: $(( $(date +%s) - start )) s wall" >&2
python - "${patterns[@]}" <<'EOF'
"""Per-module score from mutmut's result files: killed (incl. timeouts) / (all mutants that ran)."""
import fnmatch
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from mutmut.stats import status_by_exit_code

patterns = sys.argv[1:] or ["*"]
counts = defaultdict(Counter)
for meta in sorted(Path("mutants").rglob("*.py.meta")):
    module = str(meta.relative_to("mutants"))[: -len(".py.meta")].replace("/", ".")
    for name, exit_code in json.loads(meta.read_text())["exit_code_by_key"].items():
        if any(fnmatch.fnmatch(name, p) for p in patterns):
            counts[module][status_by_exit_code[exit_code]] += 1
print(f"{'module':40} {'mutants':>7} {'killed':>6} {'timeout':>7} {'survived':>8} {'no tests':>8} {'score':>6}")
for module, c in sorted(counts.items()):
    total = sum(c.values())
    caught = c["killed"] + c["timeout"]
    ran = total - c["no tests"] - c["not checked"] - c["skipped"]
    score = f"{100 * caught / total:.1f}%" if total else "-"
    print(f"{module:40} {total:7} {c['killed']:6} {c['timeout']:7} {c['survived']:8} {c['no tests']:8} {score:>6}")
    others = {k: v for k, v in c.items() if k not in ("killed", "timeout", "survived", "no tests")}
    if others or ran < total:
        print(f"{'':40} other: {dict(others)}")
EOF
exit "${status:-0}"
