"""What one node ended with after `runner push` (or a registry pull): one row of the push table."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PushResult:
    node: str
    tag: str
    image_id: str
    action: str            # skipped | layers | full | relay | pulled (job.registry)
    layers_sent: int = 0
    layers_total: int = 0
    bytes_sent: int = 0    # archive bytes streamed to it (before ssh compression)
    image_bytes: int = 0
    seconds: float = 0.0
    source: str = ""       # who sent them: "host", or (relay) the node before it in the chain
