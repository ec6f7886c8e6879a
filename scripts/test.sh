#!/usr/bin/env bash
# The test command: sets up the environment (first run only), then runs the whole suite offline on CPU.
# Two pytest workers (one per core of the reference 2-core machine), each test file kept on one worker so its
# module-scoped fixtures are built once, the files in the order tests/conftest.py gives them (the slowest tier
# first); DHPO_TEST_WORKERS=0 runs everything in this process. Arguments go to pytest. An argument that is an existing
# path (`tests/test_losses.py`, `tests/test_losses.py::test_x`) replaces `tests`, so what it names runs alone; an
# option's value that is a path (`--basetemp DIR`, `-k tests`) drops `tests` too, and pytest then runs
# pyproject.toml's testpaths, the same suite.
set -euo pipefail
# shellcheck disable=SC1091
. "$(dirname "$0")/setup_env.sh"
targets=(tests)
for arg in "$@"; do
  if [[ $arg != -* && -e ${arg%%::*} ]]; then
    targets=()
    break
  fi
done
python -m pytest -q --durations=15 -n "${DHPO_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  ${targets[@]+"${targets[@]}"} "$@"
