#!/usr/bin/env bash
# The test command: sets up the environment (first run only), then runs the whole suite offline on CPU.
# Two pytest workers (one per core of the reference 2-core machine), each test file kept on one worker so its
# module-scoped fixtures are built once, the files in the order tests/conftest.py gives them (the slowest tier
# first); DHPO_TEST_WORKERS=0 runs everything in this process.
set -euo pipefail
# shellcheck disable=SC1091
. "$(dirname "$0")/setup_env.sh"
python -m pytest -q --durations=15 -n "${DHPO_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder tests "$@"
