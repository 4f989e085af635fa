"""Counting the aten ops a piece of code dispatches (tests of how much work a path does)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """`with OpCounter(torch.ops.aten.mm, ...) as ops:` ... `ops.count`: calls of those ops (any overload)."""

    def __init__(self, *ops):
        super().__init__()
        self.ops, self.count = set(ops), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.ops:
            self.count += 1
        return func(*args, **(kwargs or {}))
