"""This machine's Docker engine (the laptop's: where images are built, exported and pushed from),
found the way the docker CLI finds it, so the runner uses the engine `docker ps` shows:

  1. RUNNER_HOST_DOCKER, the runner's own override (a URL);
  2. DOCKER_HOST (with DOCKER_TLS_VERIFY / DOCKER_CERT_PATH);
  3. DOCKER_CONTEXT, else `currentContext` in $DOCKER_CONFIG/config.json (~/.docker): the context's
     meta.json (contexts/meta/<sha256 of its name>/) names the endpoint, contexts/tls/ its TLS
     files. Docker Desktop, Colima, rootless Docker and Podman each install such a context;
  4. the default socket, unix:///var/run/docker.sock.

Reading the files runs nothing and contacts nothing; a file that is not what Docker writes is one
line naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.core.errors import UserError

DEFAULT_SOCKET = "unix:///var/run/docker.sock"
CONFIG_LIMIT = 1 << 20  # config.json and meta.json are a few hundred bytes


@dataclass(frozen=True)
class HostEngine:
    url: str
    source: str                  # how it was found, for messages: "DOCKER_HOST", "docker context colima", ...
    context: str | None = None   # the docker context it came from (the CLI is given --context)
    tls: Any = None              # docker.tls.TLSConfig, or None

    def client(self, timeout: float = 600):
        """A docker SDK client of this engine, pinged: unreachable is one line saying what to do."""
        import docker

        try:
            c = docker.DockerClient(base_url=self.url, tls=self.tls or False, version="auto",
                                    timeout=timeout)  # type: ignore[arg-type]  # seconds: docker-py takes a float
            c.ping()
            return c
        except Exception as exc:  # noqa: BLE001 - any failure to reach it is the same advice
            raise UserError(f"{self.unreachable()}: {exc}") from None

    def cli(self) -> list[str]:
        """argv prefix of the docker CLI talking to this engine (a context keeps its TLS)."""
        return ["docker", "--context", self.context] if self.context else ["docker", "-H", self.url]

    def unreachable(self) -> str:
        return (f"this machine's Docker engine {self.url} ({self.source}) is not reachable; start it (Docker "
                f"Desktop, Colima, `sudo systemctl start docker`), or point DOCKER_HOST or `docker context use` "
                f"at one that runs")


def host_engine(environ: Mapping[str, str] | None = None) -> HostEngine:
    env = os.environ if environ is None else environ
    if env.get("RUNNER_HOST_DOCKER"):
        return HostEngine(env["RUNNER_HOST_DOCKER"], "RUNNER_HOST_DOCKER")
    if env.get("DOCKER_HOST"):
        return HostEngine(env["DOCKER_HOST"], "DOCKER_HOST", tls=_env_tls(env))
    config_dir = Path(env["DOCKER_CONFIG"]) if env.get("DOCKER_CONFIG") else Path(env.get("HOME") or "~").expanduser() / ".docker"
    name = env.get("DOCKER_CONTEXT") or _current_context(config_dir / "config.json")
    if name and name != "default":
        return _context_engine(config_dir, name)
    return HostEngine(DEFAULT_SOCKET, "the default socket")


def _read_json(path: Path, what: str) -> dict | None:
    try:
        with path.open("rb") as fh:
            raw = fh.read(CONFIG_LIMIT + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UserError(f"{path}: cannot read {what}: {exc.strerror}") from None
    try:
        doc = json.loads(raw) if len(raw) <= CONFIG_LIMIT else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: {what} is not a JSON object of Docker's (fix or remove it)")
    return doc


def _current_context(config: Path) -> str | None:
    doc = _read_json(config, "the docker CLI's config")
    name = doc.get("currentContext") if doc else None
    return name if isinstance(name, str) and name else None


def _context_engine(config_dir: Path, name: str) -> HostEngine:
    ident = hashlib.sha256(name.encode()).hexdigest()
    meta_file = config_dir / "contexts" / "meta" / ident / "meta.json"
    meta = _read_json(meta_file, f"docker context {name!r}")
    if meta is None:
        raise UserError(f"docker context {name!r} (the current one) has no {meta_file}; `docker context ls` shows "
                        "the contexts, `docker context use NAME` picks one")
    endpoint = (meta.get("Endpoints") or {}).get("docker") if isinstance(meta.get("Endpoints"), dict) else None
    host = endpoint.get("Host") if isinstance(endpoint, dict) else None
    if not isinstance(host, str) or not host:
        raise UserError(f"{meta_file}: docker context {name!r} names no docker endpoint (Endpoints.docker.Host)")
    skip_verify = isinstance(endpoint, dict) and bool(endpoint.get("SkipTLSVerify"))  # (a dict: it named the host)
    tls = _context_tls(config_dir / "contexts" / "tls" / ident / "docker", skip_verify)
    return HostEngine(host, f"docker context {name}", context=name, tls=tls)


def _context_tls(d: Path, skip_verify: bool):
    files = {k: d / f"{k}.pem" for k in ("ca", "cert", "key")}
    if not all(p.is_file() for p in files.values()):
        return None
    from docker.tls import TLSConfig

    return TLSConfig(client_cert=(str(files["cert"]), str(files["key"])), ca_cert=str(files["ca"]),
                     verify=not skip_verify)


def _env_tls(env: Mapping[str, str]):
    if not env.get("DOCKER_TLS_VERIFY") and not env.get("DOCKER_CERT_PATH"):
        return None
    from docker.utils import kwargs_from_env

    return kwargs_from_env(environment=dict(env)).get("tls")
