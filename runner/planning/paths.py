"""Where a node keeps the runner's files: the one place that turns a node's `workdir` into paths.

    <workdir>/runs/<run-id>/          the run dir, mounted as /out
    <workdir>/secrets/<run-id>.env    the env_file's values (0600), removed with the run
    <workdir>/gates/<run-id>/         go-files for gated workers
    <workdir>/data/                   job.sync's files by content (runner/delivery/sync.py)

`workdir` is validated when the inventory loads (absolute, or `~/...` for the SSH user's home;
no characters a shell or a bind spec would read). `~` is resolved here with the home the node
reported, so every path the runner sends is absolute, and is still shell-quoted wherever it
reaches a shell.
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.inventory import Node


@dataclass(frozen=True)
class NodePaths:
    workdir: str

    @property
    def runs(self) -> str:
        return f"{self.workdir}/runs"

    def run(self, run_id: str) -> str:
        return f"{self.runs}/{run_id}"

    def secrets(self, run_id: str) -> str:
        return f"{self.workdir}/secrets/{run_id}.env"

    def gates(self, run_id: str) -> str:
        return f"{self.workdir}/gates/{run_id}"

    @property
    def data_blobs(self) -> str:
        """job.sync's files by sha256 (runner/delivery/sync.py)."""
        return f"{self.workdir}/data/blobs"

    @property
    def data_trees(self) -> str:
        return f"{self.workdir}/data/trees"

    def data_tree(self, digest: str) -> str:
        return f"{self.data_trees}/{digest}"

    def on_node(self, path: str, home: str | None) -> str:
        """A node path from the inventory (absolute or ~/...) made absolute with the node's home."""
        if (path == "~" or path.startswith("~/")) and home:
            return home.rstrip("/") + path[1:]
        return path


def node_paths(node: Node, home: str | None) -> NodePaths:
    """home: the SSH user's home on the node; None (a dry-run) keeps `~` as written."""
    wd = node.workdir.rstrip("/") or "/"
    if (wd == "~" or wd.startswith("~/")) and home:
        wd = home.rstrip("/") + wd[1:]
    return NodePaths(wd)
