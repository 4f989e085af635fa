#!/usr/bin/env bash
# Build the arm64 (Raspberry Pi) trainer image on this amd64 machine under qemu emulation:
#   1. qemu-user-static + binfmt-support (apt, if missing) and a binfmt entry for aarch64 with the
#      F flag (interpreter opened at registration, so it works inside chroots and containers);
#   2. an arm64 Debian base: scripts/build-base-image.sh runner-base:bookworm-arm64 arm64;
#   3. docker build -f Dockerfile.arm64 (--platform linux/arm64 where the engine takes it).
# Idempotent; slow the first time (pip under emulation).   usage: scripts/build-image-arm64.sh [TAG]
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-runner-trainer:arm64}
BASE=${BASE_IMAGE_ARM64:-runner-base:bookworm-arm64}
export DOCKER_HOST=${DOCKER_HOST:-unix:///var/run/docker.sock}
say() { echo "[image-arm64] $*" >&2; }

if ! command -v qemu-aarch64-static >/dev/null || ! command -v update-binfmts >/dev/null; then
  say "installing qemu-user-static binfmt-support"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user-static binfmt-support >/dev/null
fi

BINFMT=/proc/sys/fs/binfmt_misc
[[ -e $BINFMT/register ]] || mount -t binfmt_misc binfmt_misc "$BINFMT"
entry=$BINFMT/qemu-aarch64
# Debian registers aarch64 through a wrapper path (flags PF) that does not exist inside a chroot or
# a container; replace it with the static binary, opened now (F), so any root filesystem can use it.
if ! { [[ -e $entry ]] && grep -q '^enabled' "$entry" && grep -q '^flags: .*F' "$entry"; }; then
  say "registering qemu-aarch64-static for aarch64 ELF binaries (flags F)"
  [[ -e $entry ]] && echo -1 >"$entry"
  echo ':qemu-aarch64:M:0:\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:F' \
    >"$BINFMT/register"
fi

scripts/build-base-image.sh "$BASE" arm64
# `docker import` on a 20.10 engine records the engine's own architecture whatever --platform
# says; rewrite the image config's architecture (save -> edit config -> load) so that builds and
# `docker run --platform linux/arm64` see an arm64 image.
if [[ $(docker image inspect -f '{{.Architecture}}' "$BASE") != arm64 ]]; then
  say "marking $BASE as linux/arm64"
  rm -rf .build/base-arm64-save; mkdir -p .build/base-arm64-save
  docker save "$BASE" | tar -x -C .build/base-arm64-save
  "${PYTHON:-.venv/bin/python}" - .build/base-arm64-save <<'PY'
import hashlib, json, pathlib, sys
d = pathlib.Path(sys.argv[1])
manifest = json.loads((d / "manifest.json").read_text())
old = manifest[0]["Config"]
cfg = json.loads((d / old).read_text())
cfg["architecture"], cfg["variant"] = "arm64", "v8"
raw = json.dumps(cfg, separators=(",", ":")).encode()
new = hashlib.sha256(raw).hexdigest() + ".json"
(d / old).unlink()
(d / new).write_bytes(raw)
manifest[0]["Config"] = new
(d / "manifest.json").write_text(json.dumps(manifest))
PY
  tar -C .build/base-arm64-save -c . | docker load >/dev/null
  rm -rf .build/base-arm64-save
fi
arch=$(docker image inspect -f '{{.Architecture}}' "$BASE")
[[ $arch == arm64 ]] || { say "error: $BASE is $arch, not arm64; docker rmi $BASE and re-run"; exit 1; }

CA=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
[[ -f $CA ]] && cp "$CA" docker/certs/ca.crt
mkdir -p .build
PLATFORM=(--platform linux/arm64)
# The classic builder takes --platform only on engines with experimental features before 23.0;
# without it the FROM image's own architecture (arm64) is what runs, through binfmt, all the same.
if ! docker build --help 2>/dev/null | grep -q -- '--platform' \
   || [[ $(docker version -f '{{.Server.Experimental}}' 2>/dev/null) != true && \
         $(docker version -f '{{.Server.Version}}' | cut -d. -f1) -lt 23 ]]; then
  PLATFORM=()
fi
say "building $TAG from $BASE (emulated: slow the first time)"
# torch from PyTorch's CPU index by default: the small image a Pi should get. PyPI's aarch64 wheel
# brings CUDA libraries along (built for Grace/Jetson); where only PyPI is reachable (this project's
# CI machine), TORCH_INDEX_URL= (set and empty) takes it, harmless for an emulated `trainer --help`.
TORCH_INDEX_URL=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
say "torch from ${TORCH_INDEX_URL:-PyPI (CUDA libraries included)}"
DOCKER_BUILDKIT=0 docker build --network host "${PLATFORM[@]}" --build-arg BASE_IMAGE="$BASE" \
  --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" \
  -f Dockerfile.arm64 -t "$TAG" . >.build/image-build-arm64.log 2>&1 || { tail -n 30 .build/image-build-arm64.log >&2; exit 1; }
# OMP_NUM_THREADS=1: under qemu-user (Debian bookworm's 7.2) torch's OpenMP pool start-up deadlocks
# (main thread in sigsuspend, the other on a futex, no CPU used); with one thread it imports in ~15 s.
docker run --rm --network host -e OMP_NUM_THREADS=1 "$TAG" python -c \
  "import platform, torch, trainer; print('[image-arm64] ok:', platform.machine(), 'torch', torch.__version__)"
