#!/usr/bin/env bash
# One-time, idempotent set-up of this machine for the runner, the trainer and the tests:
# Debian packages, the project's virtualenv, and a running host Docker engine.
# Safe to re-run: every step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-$ROOT/.venv}
log() { printf '[setup] %s\n' "$*" >&2; }

# --- Debian packages -------------------------------------------------------------------
PKGS=(docker.io openssh-server openssh-client debootstrap docker-compose iproute2 ca-certificates
      rsync procps
      # strace: the tests record every execve of a push (no credential in any argv, however short-lived)
      strace
      # a real registry for job.registry's tests (docker-registry), and htpasswd for its logins
      docker-registry apache2-utils
      # the Slurm sandbox cluster (runner sandbox up --slurm): slurmctld/slurmd/clients, munge,
      # runc for Slurm's native OCI containers
      slurm-wlm munge runc
      # Go's archive/tar (the reader inside `docker load`) for the relay header fuzz test
      # (tests/unit/test_relay_headers.py builds tests/tarlist/main.go with it)
      golang-go
      # bsdtar (libarchive), the tar of a macOS laptop: tests/unit/test_laptop_tar.py runs sync's and
      # push's local tar commands with it
      libarchive-tools
      # a headless browser: the docs site's pages rendered, screenshotted and read back
      # (tests/unit/test_docs_site.py)
      chromium)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Packages with daemons (munge, slurmctld, slurmd) must not start system-wide services: the
  # sandboxes start their own. Deny service starts during the install unless a policy exists.
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- virtualenv with the project (torch pinned: pip takes the local CPU wheel) ---------
if [[ ! -x $VENV/bin/python ]]; then
  log "creating virtualenv $VENV"
  python3 -m venv "$VENV"
fi
stamp=$VENV/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [[ ! -f $stamp ]]; then
  log "installing the project into $VENV (torch==2.13.0 CPU, transformers, docker SDK, paramiko, ...)"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null
  "$VENV/bin/pip" install -q -e ".[trainer,dev,docs]"
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi
# matplotlib's font cache (~/.cache/matplotlib) built here, once, not in the first `runner collect`
# of a demo ("Matplotlib is building the font cache" in its output).
"$VENV/bin/python" -c "import contract.plots as p; p._pyplot()" >/dev/null 2>&1 || true

# --- the Perseus server's own virtualenv (zeus 0.16, pydantic<2): .venv-perseus ------------
"$ROOT/scripts/perseus-env.sh"

# --- host Docker engine (the "laptop's" engine, where images are built) ------------------
# No bridge: starting sandbox engines with --bridge none would delete a default bridge anyway,
# so everything builds and runs with host networking.
"$ROOT/scripts/host-dockerd.sh" start
log "ready: $("$VENV/bin/python" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)')"
