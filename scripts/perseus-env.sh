#!/usr/bin/env bash
# The Perseus server's own virtualenv (Zeus's pipeline frequency optimizer needs pydantic<2, which
# the project's environment cannot hold): created or refreshed only when docker/requirements-perseus.txt
# changes. Called by scripts/setup.sh; tests and `runner`'s local checks find it at .venv-perseus.
#   usage: scripts/perseus-env.sh [VENV]        (default: <repo>/.venv-perseus)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${1:-${PERSEUS_VENV:-$ROOT/.venv-perseus}}
REQ=docker/requirements-perseus.txt
# Same numpy and pandas as the trainer image (docker/requirements-trainer.txt; pandas from datasets).
HOST_PINS=(numpy==2.4.6 pandas==3.1.1 python-dateutil==4.0.0 tzdata==2026.6)
log() { printf '[perseus-env] %s\n' "$*" >&2; }

stamp=$VENV/.installed-$( (cat "$REQ"; printf '%s\n' "${HOST_PINS[@]}") | sha256sum | cut -c1-16)
if [[ -f $stamp ]]; then
  exit 0
fi
if [[ ! -x $VENV/bin/python ]]; then
  log "creating virtualenv $VENV"
  python3 -m venv "$VENV"
fi
log "installing the Perseus server (zeus 0.16.0, pydantic 1) into $VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -r "$REQ" "${HOST_PINS[@]}"
# The server imports and answers on this interpreter (no torch, no GPU needed).
PYTHONPATH=$ROOT "$VENV/bin/python" -m runner.agents.perseus_server --check >/dev/null
rm -f "$VENV"/.installed-*
touch "$stamp"
