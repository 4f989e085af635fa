# Trainer image for amd64 hosts: GPU servers (CUDA torch) and CPU boxes (CPU torch wheel).
#
#   GPU host:   docker build -t runner-trainer:latest .
#               (python:3.11 base, torch==2.13.0 from the index = the CUDA build)
#   Here/CI:    scripts/build-image.sh   (local debootstrap base, CPU wheel from docker/wheels)
#
# Layers are ordered by how often they change (base, torch, dependencies, code) so a code-only
# change re-pushes one small layer.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    OUTPUT_DIR=/out

COPY docker/certs/ /tmp/certs/
RUN python3 -m venv /opt/venv

# torch pinned. TORCH_FIND_LINKS points at a local wheel server (scripts/build-image.sh serves
# docker/wheels on loopback during the build) so the CPU wheel is installed without being copied
# into a layer; empty on a GPU host, where the index's CUDA build is the one wanted.
ARG TORCH_FIND_LINKS=
RUN set -e; [ -f /tmp/certs/ca.crt ] && export PIP_CERT=/tmp/certs/ca.crt; \
    if [ -n "$TORCH_FIND_LINKS" ]; then \
      pip install --no-deps --no-index --find-links "$TORCH_FIND_LINKS" torch==2.13.0; fi; \
    pip install torch==2.13.0

COPY docker/requirements-trainer.txt /tmp/requirements-trainer.txt
RUN set -e; [ -f /tmp/certs/ca.crt ] && export PIP_CERT=/tmp/certs/ca.crt; \
    pip install -r /tmp/requirements-trainer.txt

WORKDIR /workspace
COPY pyproject.toml README.md ./
COPY trainer ./trainer
COPY runner ./runner
COPY configs ./configs
RUN set -e; [ -f /tmp/certs/ca.crt ] && export PIP_CERT=/tmp/certs/ca.crt; \
    pip install --no-deps . && rm -rf build *.egg-info

CMD ["trainer", "--help"]
