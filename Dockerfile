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
COPY docker/slim.sh /tmp/slim.sh
RUN python3 -m venv /opt/venv

# torch pinned. TORCH_FIND_LINKS points at a local wheel server (scripts/build-image.sh serves
# docker/wheels on loopback during the build) so the CPU wheel is installed without being copied
# into a layer; empty on a GPU host, where the index's CUDA build is the one wanted.
ARG TORCH_FIND_LINKS=
RUN set -e; [ -f /tmp/certs/ca.crt ] && export PIP_CERT=/tmp/certs/ca.crt; \
    if [ -n "$TORCH_FIND_LINKS" ]; then \
      pip install --no-deps --no-index --find-links "$TORCH_FIND_LINKS" torch==2.13.0; fi; \
    pip install torch==2.13.0; \
    sh /tmp/slim.sh torch

COPY docker/requirements-trainer.txt /tmp/requirements-trainer.txt
RUN set -e; [ -f /tmp/certs/ca.crt ] && export PIP_CERT=/tmp/certs/ca.crt; \
    pip install -r /tmp/requirements-trainer.txt; \
    sh /tmp/slim.sh packages

# The Perseus server's own environment (job.perseus, runner/perseus.py): Zeus's pipeline frequency
# optimizer needs pydantic<2, so its packages go to /opt/perseus, put on PYTHONPATH only in the
# server's container (numpy and pandas come from /opt/venv). Pure-Python wheels, ~13 MB.
COPY docker/requirements-perseus.txt /tmp/requirements-perseus.txt
RUN set -e; [ -f /tmp/certs/ca.crt ] && export PIP_CERT=/tmp/certs/ca.crt; \
    pip install --no-deps --target /opt/perseus --only-binary=:all: --platform any --implementation py \
      --python-version "$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
      -r /tmp/requirements-perseus.txt

# torchrun forwards only the signals it is told to handle and dies of any other: Slurm's
# `--signal=USR1@60` or `docker kill -s USR1` would kill it and orphan the workers without a
# checkpoint. torch's process layer reads TORCHELASTIC_SIGNALS_TO_HANDLE, but torch 2.13's torchrun
# CLI overwrites it from --signals-to-handle (env PET_SIGNALS_TO_HANDLE, default without SIGUSR1):
# setting only the former was verified not to work. Both are set (docs/checkpoints.md).
# After a forwarded signal torchrun waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s) before SIGKILL.
# Set here, after the heavy layers, so changing it keeps torch and requirements cached.
ENV PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1

# `runner up` may start this image's workers together with the master: runner/agents/gate.py holds
# their torchrun until the master's rendezvous port listens (metadata only, set before the
# code so that the project install stays the newest layer). "3": the gate is runner.agents.gate
# and the master runs runner.agents.torchrun, torchrun with its exit barrier mended (runner/planning/plan.py
# GATE_MODULES, TORCHRUN_MODULES; "2" had only the gate, "1" was runner.gate).
LABEL io.runner.gate="3"

WORKDIR /workspace
COPY pyproject.toml README.md ./
COPY trainer ./trainer
COPY runner ./runner
COPY contract ./contract
COPY configs ./configs
RUN set -e; [ -f /tmp/certs/ca.crt ] && export PIP_CERT=/tmp/certs/ca.crt; \
    pip install --no-deps . && rm -rf build *.egg-info && \
    python -m compileall -q trainer runner contract
# ^ the bytecode of /workspace's copy (the one `python -m trainer` imports: the working directory
# comes first on sys.path) in the image: else every container compiles it again at start, and a
# container run as a non-root SSH user cannot even keep it (0.34 s of each start, idle).

CMD ["trainer", "--help"]
