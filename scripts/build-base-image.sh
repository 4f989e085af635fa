#!/usr/bin/env bash
# Build the local base image (Debian bookworm + Python 3.11) without any container registry:
# debootstrap a root filesystem, then `docker import` it. Cached: skipped when the image exists.
#   usage: scripts/build-base-image.sh [TAG] [ARCH]     (defaults: runner-base:bookworm, amd64)
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-runner-base:bookworm}
ARCH=${2:-amd64}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DOCKER=(docker -H "${DOCKER_HOST:-unix:///var/run/docker.sock}")

if "${DOCKER[@]}" image inspect "$TAG" >/dev/null 2>&1; then
  echo "[base] $TAG present, skipping" >&2; exit 0
fi
ROOTFS=.build/rootfs-$ARCH
rm -rf "$ROOTFS"; mkdir -p .build
echo "[base] debootstrap bookworm ($ARCH) into $ROOTFS" >&2
# minbase + what the trainer image needs at run time: python3.11 with venv/pip, CA certs,
# procps/iproute2 (ps, ip route get for socket ifname probing).
debootstrap --variant=minbase --arch="$ARCH" \
  --include=python3,python3-venv,python3-pip,ca-certificates,procps,iproute2 \
  bookworm "$ROOTFS" "$MIRROR" >.build/debootstrap-$ARCH.log 2>&1 || {
  echo "[base] error: debootstrap failed; see .build/debootstrap-$ARCH.log" >&2; tail -n 20 .build/debootstrap-$ARCH.log >&2; exit 1; }
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
echo "[base] importing as $TAG" >&2
tar -C "$ROOTFS" -c . | "${DOCKER[@]}" import \
  -c 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  -c 'CMD ["/bin/bash"]' - "$TAG" >/dev/null
rm -rf "$ROOTFS"
"${DOCKER[@]}" run --rm --network host "$TAG" python3 --version
