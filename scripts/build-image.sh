#!/usr/bin/env bash
# Build the amd64 trainer image on the host engine from the local base (no registry) and the
# CPU torch wheel (no CUDA download).  usage: scripts/build-image.sh [TAG]
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-runner-trainer:latest}
BASE=${BASE_IMAGE:-runner-base:bookworm}
PY=${PYTHON:-.venv/bin/python}
export DOCKER_HOST=${DOCKER_HOST:-unix:///var/run/docker.sock}

scripts/build-base-image.sh "$BASE" amd64
# The CPU wheel pip resolves torch==2.13.0 to on this machine; never a CUDA build.
if ! ls docker/wheels/torch-2.13.0*.whl >/dev/null 2>&1; then
  "$PY" -m pip download -q torch==2.13.0 --no-deps -d docker/wheels
fi
case "$(ls docker/wheels/torch-2.13.0*.whl)" in
  *+cpu*) ;;
  *) echo "[image] error: docker/wheels holds a non-CPU torch wheel; remove it and re-run" >&2; exit 1 ;;
esac
# pip inside the build reaches the index with the host's CA bundle.
CA=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
[[ -f $CA ]] && cp "$CA" docker/certs/ca.crt
# Serve the wheel on loopback for the build (host network) instead of copying it into a layer.
mkdir -p .build
# A fixed port keeps the build argument, and so the layer cache, stable between builds.
PORT=${WHEEL_PORT:-38517}
"$PY" -m http.server "$PORT" --bind 127.0.0.1 --directory docker/wheels >.build/wheel-server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
echo "[image] building $TAG from $BASE" >&2
old_id=$(docker image inspect --format '{{.Id}}' "$TAG" 2>/dev/null || true)
DOCKER_BUILDKIT=0 docker build --network host --build-arg BASE_IMAGE="$BASE" \
  --build-arg TORCH_FIND_LINKS="http://127.0.0.1:$PORT/" -t "$TAG" . \
  >.build/image-build.log 2>&1 || { tail -n 30 .build/image-build.log >&2; exit 1; }
# The image this build replaced is left untagged; remove it unless a container or tag still uses it
# (only its code layer is its own, but a rebuild per code change should not pile them up).
new_id=$(docker image inspect --format '{{.Id}}' "$TAG")
if [[ -n $old_id && $old_id != "$new_id" ]]; then docker rmi "$old_id" >/dev/null 2>&1 || true; fi
docker run --rm --network host "$TAG" python -c "import torch, trainer; print('[image] ok: torch', torch.__version__)"
