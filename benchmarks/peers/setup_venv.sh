#!/usr/bin/env bash
# Builds .venv-peers: the virtualenv that holds the peers (verl, TRL) for `make bench-peers`.
# It reuses .venv's torch/numpy/transformers/ray through a .pth file that APPENDS .venv's site-packages to
# sys.path, so the few packages installed here (requirements.txt, all --no-deps) win over .venv's copies while
# nothing heavy is downloaded twice. --no-deps also means pip never tries to "upgrade" (uninstall) a package that
# lives in .venv. A stamp file keyed on requirements.txt makes a second run instant.
set -eo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MAIN_VENV="${MAIN_VENV:-$ROOT/.venv}"
PEERS_VENV="${PEERS_VENV:-$ROOT/.venv-peers}"
REQS="$ROOT/benchmarks/peers/requirements.txt"
STAMP="$PEERS_VENV/.installed-$(sha1sum "$REQS" | cut -c1-12)"

if [[ -f "$STAMP" ]]; then
    exit 0
fi

MAIN_PY="$MAIN_VENV/bin/python"
test -x "$MAIN_PY" || { echo "setup_venv.sh: $MAIN_PY missing; run 'make install' first" >&2; exit 1; }
# the same base interpreter as .venv, so .venv's compiled wheels (torch, numpy) load in the peers venv
BASE_PY="$("$MAIN_PY" -c 'import sys; print(sys._base_executable)')"
test -x "$PEERS_VENV/bin/python" || "$BASE_PY" -m venv "$PEERS_VENV"

PEERS_SITE="$("$PEERS_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
MAIN_SITE="$("$MAIN_PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
# a .pth line is appended to sys.path after the venv's own site-packages: the peers' pins win
echo "$MAIN_SITE" > "$PEERS_SITE/zz_scaletrain_main_venv.pth"

echo "installing the peers (benchmarks/peers/requirements.txt) into $PEERS_VENV ..."
"$PEERS_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$REQS" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }

# the check the TRL/verl scripts rely on; .ready tells other tools the venv is usable
"$PEERS_VENV/bin/python" -c "import verl.protocol, verl.trainer.ppo.core_algos, trl; from trl import GRPOTrainer"
rm -f "$PEERS_VENV"/.installed-*
touch "$STAMP" "$PEERS_VENV/.ready"
echo "peers venv ready: $PEERS_VENV"
