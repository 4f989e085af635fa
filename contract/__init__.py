"""The contract between the runner (host) and the trainer (container): the formats of the files a
run leaves in OUTPUT_DIR that both read, and the plots drawn from them. Torch-free, and imports
neither wing: the only code the two share (docs/contract.md).

- `contract.timeline`: the Chrome-trace timeline, the Pi guide's seed format, their file names.
- `contract.metrics`: metrics.jsonl records, a run's progress and summary.
- `contract.plots`: the pipeline Gantt chart and the loss / tokens-per-second plot (matplotlib).
- `contract.partition`: the uniform pipeline split (the runner prints it, the trainer runs it).
- `contract.presets`: the named models (the trainer builds them, the runner sizes them).
- `contract.memory`, `contract.model_size`: a stage's memory before launch (`trainer --dry-run`,
  `runner up --dry-run`).
- `contract.suggest`, `contract.version`: what both CLIs answer alike (did-you-mean, --version).
- `contract.bounded_json`: JSON another machine wrote (a node's timelines and metrics), read within bounds.
- `contract.heartbeat`, `contract.hang`, `contract.stacks`: each rank's progress file, the hang
  budgets, the reader's verdict and blame, stragglers, and the stacks' names and commands.
"""
