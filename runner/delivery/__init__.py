"""What a node needs before a run and what comes back after: images, data, checkpoints, files.

- host_engine: this machine's Docker engine, where images are built and exported from
- images: export once (cached by image id), which layers a node lacks, `docker load` on a node
- push: every node gets the image for its arch, only the layers it lacks (`runner push`)
- relay: one `docker save` stream from here feeding a chain of nodes (the node's half is
  runner/agents/relay_agent.py)
- registry: `job.registry`, the nodes pull the job's tags instead
- push_result: one node's row of the push table
- sync: `job.sync`, local files mirrored to every node by content
- resume_sync: before `up --resume`, the checkpoint it resumes from made complete on every node
- collect_files: a run dir's files brought back, listed, checked and verified

May import: runner.transport, runner.agents, the inventory, errors, node_output, paths, redact,
safe_path, collect_report; never profile, the backends or the CLI.
"""
