"""The parallel engine: one module per parallelism, composed in one place.

- compose: builds a `Parallelized` model from the config and the mesh (the one place layouts meet)
- parallelized: the model as the loop sees it (step over microbatches, evaluation, clipping)
- mesh: the device mesh and its dims; data_parallel (DDP, FSDP2 ZeRO-2/3, hybrid); tensor_parallel
  (DTensor); pipeline, stages, partition, schedule_table (pipeline schedules and splits)
- compile, activation_checkpoint, materialize (meta-device init), grad_norm, ordered_reduce,
  running_stats: what every layout shares

May import: torch, transformers, trainer.config, trainer.models, trainer.runtime.dist_env; never the
training loop (trainer.train) or the CLI.
"""
