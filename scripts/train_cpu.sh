#!/usr/bin/env bash
# The main job: sets up the environment (first run only), then trains DHPO-E on the embedded CPU task.
# Extra arguments go to `python -m dhpo_trl` (see `python -m dhpo_trl --help`).
set -euo pipefail
# shellcheck disable=SC1091
. "$(dirname "$0")/setup_env.sh"
python -m dhpo_trl "$@"
