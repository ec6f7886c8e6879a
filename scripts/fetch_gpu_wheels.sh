#!/usr/bin/env bash
# Fills .gpu_wheels (ignored by git) with the wheels scripts/gpu_check.sh installs on a GPU machine that has no
# network: trl, datasets, math-verify and their pure-Python needs that the GPU image lacks, plus transformers,
# accelerate and peft (installed there only where the image has another version). The versions are the ones
# installed in this checkout's .venv, the tested stack within pyproject.toml's pins; the wheels are for CPython 3.12
# on x86-64 Linux, the GPU image's Python. About 15 MiB; they travel with the working tree (64 MiB at most in all).
#   bash scripts/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
destination=.gpu_wheels
packages=(trl datasets math-verify latex2sympy2_extended antlr4-python3-runtime dill multiprocess fsspec
  transformers accelerate peft)
mkdir -p "$destination"
rm -f "$destination"/*.whl  # one version of each: two would be installed over each other
for package in "${packages[@]}"; do
  version=$("$python" -c 'import importlib.metadata, sys; print(importlib.metadata.version(sys.argv[1]))' "$package")
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$destination" "$package==$version"
done
ls "$destination"
du -sh "$destination"
