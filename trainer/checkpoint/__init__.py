"""Checkpoints: written while training, resumed exactly, exported for other tools. The training
loop reaches it only through the callback named in trainer/train.py (CALLBACKS) and `trainer
export` through trainer/cli.py's command table.

- checkpointer: sharded checkpoints (torch.distributed.checkpoint), resume, keep_last, `latest`
- on_disk: a checkpoint directory read and checked (trainer_state.json, `latest`, manifests)
- state: what a checkpoint holds (model and optimizer through DCP, the small per-run state)
- storage: which ranks share a checkpoint directory when nodes share no storage
- replicas: copies of each node's checkpoint files on other nodes (`checkpoint.replicas`)
- full: `checkpoint.format: full`, single-file state dicts beside the DCP shards
- preempt: SIGTERM / SIGUSR1 end the run after the current step with a checkpoint (exit 143)
- export: `trainer export CKPT DIR`, a checkpoint's model as a transformers directory

May import: trainer.config, trainer.models, trainer.optim, trainer.models.files, trainer.runtime.hold,
torch; never trainer.cli, trainer.train or runner.
"""
