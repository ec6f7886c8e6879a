#!/usr/bin/env bash
# Creates .venv (once) and installs dhpo-trl with its test extras on a CPU-only machine.
# Sourced by scripts/test.sh and scripts/train_cpu.sh, so each of them works on a fresh machine.
# torch is installed first and pinned: 2.13.0 is the CPU build cached on these machines; an unpinned
# torch would pull several GB of CUDA wheels.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DHPO_VENV:-$repo_root/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
stamp="$venv/.dhpo-installed"
if [ ! -f "$stamp" ] || [ "$repo_root/pyproject.toml" -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e "${repo_root}[test]"
  # DeepSpeed ships as an sdist whose build imports torch: build it against the torch above (no isolated
  # build env, which would fetch a CUDA torch) and without compiling ops ahead of time.
  DS_BUILD_OPS=0 python -m pip install -q --no-build-isolation "deepspeed>=0.18.6,<0.20"
  touch "$stamp"
fi
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
export HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM=false
cd "$repo_root"
