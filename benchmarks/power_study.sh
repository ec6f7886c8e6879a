#!/usr/bin/env bash
# The powered long-completion study (docs/study/long_completions_power.md): each cell's final accuracy also measured
# on a large held-out set, in the background from a pinned copy of the code (benchmarks/pinned_study.sh).
#
#   bash benchmarks/power_study.sh OUT_DIR [COMMIT]      # start, or resume: finished cells in OUT_DIR are reused
#   bash benchmarks/power_study.sh OUT_DIR --report      # write docs/study/long_completions_power.{md,json} here
#
# Niced to 19 (it shares the machine). Two workers, one torch thread each. Cells run k = 4 first, then k = 16,
# seed-major (every objective of seed 0, then seed 1, ...), so a study stopped early has whole seeds. Eight seeds:
# what the page's difference-of-means reading needs at k = 4 for a 3-point gap between any two rows. Each cell is about
# 2.5 CPU minutes of training plus the final evaluation (about 0.15 CPU s per problem).
set -euo pipefail
# shellcheck source=benchmarks/pinned_study.sh
. "$(dirname "${BASH_SOURCE[0]}")/pinned_study.sh"
pinned_study power_study 19 "${1:?usage: bash benchmarks/power_study.sh OUT_DIR [COMMIT | --report]}" "${2:-}" -- \
    --task long --objectives GRPO GSPO SAPO DHPO-A DHPO-E --ks 4 16 --seeds 0 1 2 3 4 5 6 7 --final-heldout 2000 \
    --generation-batches 8 --eval-every 4 --workers 2
