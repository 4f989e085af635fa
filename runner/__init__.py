"""The runner: the user's machine's half (no torch). `runner.api` is the Python API the command
line itself calls. Packages in layers, top to bottom (each imports only its own and those below;
tests/unit/test_layers.py checks it):

- cli/: the command line, parsers and rendering only; api: the typed Python API
- backends/: where a run goes (ssh/, slurm/), every verb behind one interface
- profile/ (per-node measurements, `partition: auto`), sandbox/ (local clusters for trying and
  testing)
- delivery/: images, push, relay, registry, sync, resume files, collect
- transport/: SSH, jump hosts, SFTP, the docker API over SSH, streams, probes, rendezvous port
- planning/: pure: inventory + job in, a plan out (plan, jobspec, sizing, elastic, kube_export,
  paths, profile_cache)
- inventory/: the YAML, its checks, host keys, which inventory a command uses
- core/ (errors, fanout, node_output, safe_path, runs, redact) and agents/ (the code that runs on
  nodes and in containers: standard library only, or torch in the image)
"""
