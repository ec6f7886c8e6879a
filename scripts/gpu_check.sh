#!/usr/bin/env bash
# GPU evidence in one command: the carried wheels installed, the GPU tests (packed rows against padded rows with torch's
# varlen kernel, SDPA and eager; the tiny MoE), DHPO-E off-policy steps with generation on a random Qwen3-0.6B, the
# update benchmark at the Qwen3-1.7B shape (arms at 4 x 8 and 16 x 2, profiled micro-steps), the overhead of MoE
# routing replay (Qwen3-30B-A3B's layers) and R3 against vLLM's offline engine where vllm is installed. Each part is
# time-boxed (480 s in all on one H100); OUTPUT_DIR gets gpu_check.json (figures, and the error of any part that
# failed) and gpu_check.log.
#   bash scripts/fetch_gpu_wheels.sh             # first, on a machine with PyPI: fills .gpu_wheels (carried along)
#   bash scripts/gpu_check.sh /tmp/gpu_check     # on the GPU machine
#   bash scripts/gpu_check.sh --cpu /tmp/gpu_check_cpu    # the CPU dry run: the same parts at tiny shapes
#   python scripts/docs_gpu_section.py /tmp/gpu_check/gpu_check.json    # fills docs/performance_gpu.md
# PYTHON picks the interpreter (default python3: on the GPU image, the one that holds CUDA torch).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
