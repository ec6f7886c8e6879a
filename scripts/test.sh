#!/usr/bin/env bash
# The test command: sets up the environment (first run only), then runs the whole suite offline on CPU.
set -euo pipefail
# shellcheck disable=SC1091
. "$(dirname "$0")/setup_env.sh"
python -m pytest -q --durations=15 tests "$@"
