#!/bin/sh
# What the trainer never runs, left out of the image's layers (every node is pushed them):
# torch's C++ test binaries and every package's own test suite: 208 MB of a 1.72 GB CPU image.
#   slim.sh torch      in torch's layer: torch/test and torch/bin, torch_shm_manager kept (the
#                      DataLoader's file_system sharing starts it)
#   slim.sh packages   in the dependencies' layer: each package's `tests` directories (torch's
#                      are its own layer's)
set -eu
sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
case "${1:-}" in
  torch)
    rm -rf "$sp/torch/test"
    # A wheel without torch/bin (another platform's build) has nothing to leave out there.
    if [ -d "$sp/torch/bin" ]; then
      find "$sp/torch/bin" -mindepth 1 -maxdepth 1 ! -name torch_shm_manager -exec rm -rf {} +
    fi ;;
  packages)
    find "$sp" -path "$sp/torch" -prune -o -type d -name tests -prune -exec rm -rf {} + ;;
  *) echo "usage: slim.sh torch|packages" >&2; exit 2 ;;
esac
