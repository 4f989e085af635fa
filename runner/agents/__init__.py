"""Code that runs on a node or in a container, not on the user's machine.

- gate: in a worker's container, imports torchrun while the master comes up and starts it the
  moment the runner writes the go-file (`python -m runner.agents.gate`; the image's label
  io.runner.gate="2" or later says it is here)
- torchrun: torchrun with its exit barrier mended (`python -m runner.agents.torchrun`, the
  master's command, and the gate's torchrun; label io.runner.gate="3")
- relay_agent: the node's half of the relay push, sent as source over SSH and run by the node's
  python3

May import: the standard library only (and torch, for the gate, which runs in the image); nothing
of runner/, since a node has no runner installed. tests/unit/test_layers.py checks both.
"""
