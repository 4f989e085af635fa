"""Reaching a node: one verified SSH connection per node and everything carried on it.

- ssh: `Remote`, the connection (host key verified against known_hosts, bounded command output)
- hostkeys lives below (runner/inventory/hostkeys.py): the inventory reads host keys too
- jump: bastions (`proxy_jump`), one shared connection per bastion
- sftp: a node's files over the connection's SFTP session, every name checked
- docker_api: the node's Docker API over the same connection (`docker system dial-stdio`)
- stream: one byte stream between local processes and a command on a node (OpenSSH's speed)
- digest: sha256 here and on a node, the one way files are checked
- cluster: `Cluster`, the inventory's nodes connected and fanned out to (bounded, in parallel)
- probe: what a node is, asked in one SSH session before anything starts

May import: runner.core.errors, fanout, hostkeys, node_output, safe_path, paths, plan (the facts a
probe fills), inventory_arg, the inventory; never delivery, profile, the backends or the CLI.
"""
