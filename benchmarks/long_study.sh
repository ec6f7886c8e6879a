#!/usr/bin/env bash
# The long-completion study (docs/study/long_completions.md), in the background from a pinned copy of the code
# (benchmarks/pinned_study.sh).
#
#   bash benchmarks/long_study.sh OUT_DIR [COMMIT]      # start, or resume: finished cells in OUT_DIR are reused
#   bash benchmarks/long_study.sh OUT_DIR --report      # write docs/study/long_completions.{md,json} + plots here
#
# Every cell is one `run_embedded` on one torch thread; 7 objectives x k = 4, 16 x 3 seeds, GRPO and DHPO-E at
# k = 1 x 3 seeds, and the two-digit reference cells (seed 0) for the spread comparison: 48 long cells of about
# 3 CPU minutes each (5-7 minutes of wall time each on a loaded 2-core machine; the log gives every cell's time and
# what is left).
set -euo pipefail
# shellcheck source=benchmarks/pinned_study.sh
. "$(dirname "${BASH_SOURCE[0]}")/pinned_study.sh"
pinned_study long_study 10 "${1:?usage: bash benchmarks/long_study.sh OUT_DIR [COMMIT | --report]}" "${2:-}" -- \
    --task long --objectives GRPO GSPO SAPO CISPO DHPO-A DHPO-E DHPO-E+GSPO-seq-clip --ks 4 16 1 \
    --on-policy-objectives GRPO DHPO-E --seeds 0 1 2 --reference-seeds 0 --generation-batches 8 --eval-every 4 \
    --workers 1
