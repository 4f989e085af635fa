"""One sandbox node's files: where its keys, sshd config, engine socket, data root and workdir are."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runner.delivery.host_engine import host_engine


@dataclass(frozen=True)
class SandboxNode:
    index: int
    addr: str
    port: int
    root: Path  # <state>/node-i: keys, configs, data root, workdir
    run: Path  # short path under /run for sockets (unix socket paths are limited to 108 bytes)
    light: bool = False  # sshd only; sessions use this machine's engine
    work: Path | None = None  # --user: the workdir in the account's home (default: root/work)

    @property
    def name(self) -> str:
        return f"node-{self.index}"

    @property
    def host_key(self) -> Path:
        return self.root / "ssh_host_ed25519_key"

    @property
    def host_key_ecdsa(self) -> Path:
        return self.root / "ssh_host_ecdsa_key"

    @property
    def sshd_config(self) -> Path:
        return self.root / "sshd_config"

    @property
    def sshd_pid(self) -> Path:
        return self.root / "sshd.pid"

    @property
    def docker_sock(self) -> Path:
        return self.run / "docker.sock"

    @property
    def docker_pid(self) -> Path:
        return self.run / "docker.pid"

    @property
    def data_root(self) -> Path:
        return self.root / "docker"

    @property
    def exec_root(self) -> Path:
        return self.run / "exec"

    @property
    def workdir(self) -> Path:
        return self.work or self.root / "work"

    @property
    def docker_host(self) -> str:
        return host_engine().url if self.light else f"unix://{self.docker_sock}"
