"""The runner: the user's machine's half (no torch). Packages and layers, top to bottom (each
imports only its own and those below; tests/test_layers.py checks it):

- cli (and `exec`); then backends/: where a run goes (ssh/: launch, watch, elastic_loop, status,
  down, collect; slurm/); then the verbs' command lines (check_cli, push_cli, sync_cli,
  profile/command, kube_cli, notify, sandbox/)
- delivery/ (images, push, relay, registry, sync, resume_sync, collect_files), transport/ (ssh,
  jump, sftp, docker_api, stream, digest, cluster, probe), profile/ (measure, cache, split, auto),
  a node's runs (node_runs, plan, paths), planning (sizing, elastic), what the verbs do (check,
  kube_export)
- inventory/ (the YAML and its checks), jobspec (the launch contract), runs (run ids)
- base: errors, fanout, node_output, safe_path, hostkeys, perseus_server; and agents/, the code
  that runs on nodes and in containers (gate, torchrun, relay_agent: standard library only)
"""
