"""The runner: the user's machine's half (no torch). Layers, top to bottom (each imports only its
own and those below; tests/test_layers.py checks it):

- cli (and `exec`); then backends/: where a run goes (ssh/: launch, watch, elastic_loop, status,
  down, collect; slurm/); then the verbs' command lines (check_cli, push_cli, sync_cli,
  profile_cli, kube_cli, notify, sandbox/)
- delivery (relay, images, registry, collect_files), transport (ssh, cluster, node_probe, stream,
  docker_ssh), a node's runs (node_runs, plan, paths), profiling and planning (profile,
  profile_auto, sizing, elastic), what the verbs do (check, kube_export)
- inventory/ (the YAML and its checks), jobspec (the launch contract), runs (run ids)
- base: errors, fanout, node_output, safe_path, hostkeys; and the code that runs on nodes: gate,
  relay_agent (standard library only), perseus_server
"""
