#!/usr/bin/env bash
# `make test-gpu` on a GPU machine with CUDA torch and no network (an air-gapped node): installs a bundle made by
# launch/testing/gpu_bundle.py into a private directory (the machine's own site-packages untouched), puts it first on
# PYTHONPATH and runs `make test-gpu` with the machine's Python and torch.
#
#   launch/testing/gpu_offline.sh BUNDLE [make variables, e.g. ARGS="-k grpo" GPU_REPORT=/tmp/report.json]
#
# From the environment: PYTHON (default python3), SITE (where the bundle goes; default BUNDLE/site).
set -euo pipefail
cd "$(dirname "$0")/../.."

BUNDLE=$(realpath "$1")
shift
PYTHON=${PYTHON:-python3}
SITE=${SITE:-$BUNDLE/site}
PIP=("$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --upgrade --target "$SITE")

for first in "$BUNDLE"/wheels/*.whl.part00; do # wheels split to fit a transfer limit, joined in order
  [[ -e "$first" ]] || continue
  wheel=${first%.part00}
  cat "$wheel".part* >"$wheel.tmp" && mv "$wheel.tmp" "$wheel" && rm -f "$wheel".part*
done
"${PIP[@]}" "$BUNDLE"/wheels/*.whl
for sdist in "$BUNDLE"/sdists/*; do # C extensions, built against this machine's Python
  [[ -e "$sdist" ]] && "${PIP[@]}" --no-build-isolation "$sdist"
done
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
"$PYTHON" -c "import torch, transformers, ray; print(f'torch {torch.__version__}, transformers {transformers.__version__},'
  f' ray {ray.__version__}, CUDA devices: {torch.cuda.device_count()}')"
exec make test-gpu PY="$PYTHON" INSTALL= "$@"
