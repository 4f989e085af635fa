"""What a node's Docker engine answers, bounded and checked before the runner reads it.

The engine is the node's: whatever answers on its `docker system dial-stdio` may send anything.
docker-py trusts it: it reads every answer whole (a listing of gigabytes is held in memory), waits
on each read alone (an answer sent a byte a minute never ends), and its models index into the
answer as they find it (`Config` a string, `Labels` a list, `State` a number: AttributeError,
TypeError, KeyError in the middle of `runner status`). Here:

- an answer read whole (not a stream: logs, attach and pulls keep docker-py's reading) is at most
  MAX_ANSWER bytes, and arrives within ANSWER_S plus the request's own timeout of its headers, each
  read of the channel checking the time (a call made to wait for ever, docker-py's `wait()`, has no
  time bound; the status line and headers: docker_api.HEADERS_S);
- a JSON answer holds at most MAX_JSON_VALUES values, counted before it is parsed (parsed, 64 MiB
  of `{},` are 22 million dicts: 1.5 GiB);
- an error answer's message is a string of at most MAX_EXPLANATION characters (docker-py indexed
  the answer's JSON for it: a list was a TypeError, a dict an AttributeError);
- the listings and inspections the models are made from must be JSON objects with an engine id,
  else EngineAnswerError: a DockerException (caught where an engine refusal is) and a UserError
  (one line naming the node, exit 2, where no caller catches it: `runner exec`, a relaunch);
- the models' fields give the runner only what a real engine would: labels as str -> str, a status
  that is one plain word ("unknown" otherwise), an exit code that is an int or None.

`docker_client` builds the client from these and docker_api's channel adapter.
"""

from __future__ import annotations

import functools
import json
import re
import time
from typing import TYPE_CHECKING

import docker.constants
from docker.models.containers import Container, ContainerCollection
from docker.models.images import Image, ImageCollection

import docker
from contract.bounded_json import value_count
from runner.transport.docker_api import DeadlineFile, EngineAnswerError, NoAnswer, VerifiedSSHAdapter

if TYPE_CHECKING:
    import paramiko

MAX_ANSWER = 64 << 20  # one answer read whole: a busy node's `containers/json` is a few MB
ANSWER_S = 120.0       # an answer's body after its headers, beyond the request's own timeout
CHUNK = 64 << 10
MAX_JSON_VALUES = 2_000_000  # a real listing: ~60 values a container; parsed, ~100 bytes each
MAX_EXPLANATION = 2000       # characters of an engine's error message kept (a real one: a line)
ENGINE_ID = re.compile(r"(sha256:)?[0-9a-f]{12,64}")
WORD = re.compile(r"[a-z]{1,32}")  # created, running, paused, restarting, removing, exited, dead


def bound_answer(r, *args, stream: bool = False, node: str = "?", **kwargs):
    """requests' response hook: it runs before requests reads a body. A body read whole is read
    here instead, at most MAX_ANSWER bytes within ANSWER_S; streamed answers are left as they are."""
    if stream:
        return r
    length = r.headers.get("Content-Length", "")
    if length.isdigit() and int(length) > MAX_ANSWER:
        r.close()
        raise EngineAnswerError(node, f"the engine's answer to {_what(r)} is {int(length) >> 20} MiB, over the "
                                f"{MAX_ANSWER >> 20} MiB any engine answer needs")
    timeout = kwargs.get("timeout")
    timeout = sum(t or 0 for t in timeout) if isinstance(timeout, tuple) else timeout
    # (deadline, seconds) of the whole body; None for a request made to wait for ever (no timeout)
    bound = None if timeout is None else (time.monotonic() + ANSWER_S + timeout, ANSWER_S + timeout)
    # Each read of the channel checks the time (a read of CHUNK bytes waits for all of them: a byte
    # a timeout apart, 64 KiB took days): docker_api's answer file, as for the headers.
    fp = getattr(getattr(r.raw, "_fp", None), "fp", None)
    if isinstance(fp, DeadlineFile) and bound is not None:
        fp.deadline, fp.seconds = bound
    # The chunks as they came, joined once at the end: no growing buffer to realloc (where the
    # allocator cannot grow one in place, each step copies it).
    body: list[bytes] = []
    size = 0
    try:
        for chunk in r.raw.stream(CHUNK, decode_content=True):
            body.append(chunk)
            size += len(chunk)
            if size > MAX_ANSWER:
                raise EngineAnswerError(node, f"the engine's answer to {_what(r)} went past {MAX_ANSWER >> 20} MiB: "
                                        "stopped reading it")
            if bound is not None and time.monotonic() > bound[0]:
                raise NoAnswer(bound[1])
    except NoAnswer as exc:
        r.close()
        raise EngineAnswerError(node, f"the engine's answer to {_what(r)} took over {exc.seconds:.0f}s "
                                f"({size} bytes so far): stopped reading it") from None
    except EngineAnswerError:
        r.close()
        raise
    finally:
        if isinstance(fp, DeadlineFile):
            fp.deadline = None
    r._content = b"".join(body)  # what requests would have read itself (its documented body cache)
    return r


def _what(r) -> str:
    req = getattr(r, "request", None)
    path = (getattr(req, "path_url", "") or "").split("?")[0]
    return f"{getattr(req, 'method', '')} {path}".strip() or "a request"


def _entry(answer, what: str, node: str) -> dict:
    """An inspection the models are made from: a JSON object with an engine id."""
    if not isinstance(answer, dict) or not isinstance(answer.get("Id"), str) or not ENGINE_ID.fullmatch(answer["Id"]):
        raise EngineAnswerError(node, f"the engine's answer for {what} is not an object with an engine id")
    return answer


def _listing(answer, what: str, node: str) -> list[dict]:
    if not isinstance(answer, list):
        raise EngineAnswerError(node, f"the engine's list of {what} is not a list")
    return [_entry(a, f"one of its {what}", node) for a in answer]


def _explanation(response) -> str:
    if getattr(response, "_content", None) is False:  # a stream's error answer: its first 64 KiB only
        try:
            body = response.raw.read(64 << 10, decode_content=True) or b""
        except Exception:  # noqa: BLE001 - the status alone says it then
            body = b""
    else:
        body = response.content or b""
    if len(body) <= 64 << 10:  # an engine's error: {"message": "..."}, a few hundred bytes
        try:
            said = json.loads(body).get("message")
            if isinstance(said, str):
                return said[:MAX_EXPLANATION]
        except (ValueError, AttributeError, RecursionError):
            pass
    return body[:MAX_EXPLANATION].decode(errors="replace").strip()


def mapping(value) -> dict:
    return value if isinstance(value, dict) else {}


def labels_of(attrs) -> dict[str, str]:
    """Config.Labels as str -> str: any other entry, or any other shape, is left out."""
    labels = mapping(mapping(attrs).get("Config")).get("Labels")
    return {k: v for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(labels, dict) else {}


def state_of(attrs) -> dict:
    """A container's State: a mapping, or {} for anything else."""
    return mapping(mapping(attrs).get("State"))


def exit_code_of(attrs) -> int | None:
    code = state_of(attrs).get("ExitCode")
    return code if isinstance(code, int) and not isinstance(code, bool) and -(1 << 31) <= code < 1 << 31 else None


class NodeContainer(Container):
    @property
    def labels(self) -> dict[str, str]:
        return labels_of(self.attrs)

    @property
    def status(self) -> str:
        st = mapping(self.attrs).get("State")
        s = st.get("Status") if isinstance(st, dict) else st
        return s if isinstance(s, str) and WORD.fullmatch(s) else "unknown"

    @property
    def name(self) -> str | None:
        n = mapping(self.attrs).get("Name")
        return n.lstrip("/") if isinstance(n, str) else None

    @property
    def state(self) -> dict:
        return state_of(self.attrs)

    @property
    def exit_code(self) -> int | None:
        return exit_code_of(self.attrs)


class NodeImage(Image):
    @property
    def labels(self) -> dict[str, str]:
        return labels_of(self.attrs)

    @property
    def tags(self) -> list[str]:
        tags = mapping(self.attrs).get("RepoTags")
        return [t for t in tags if isinstance(t, str) and t != "<none>:<none>"] if isinstance(tags, list) else []


class NodeContainers(ContainerCollection):
    model = NodeContainer


class NodeImages(ImageCollection):
    model = NodeImage


class NodeAPI(docker.APIClient):
    """docker.APIClient whose answers the models index into are checked first; `node` names the
    node in every EngineAnswerError."""

    node = "?"

    def bound(self, node: str) -> None:
        """Every answer of this client bounded (bound_answer), its errors naming `node`."""
        self.node = node
        self.hooks["response"].append(functools.partial(bound_answer, node=node))

    def _result(self, response, json=False, binary=False):
        self._raise_for_status(response)  # (docker-py's _result asks again: a no-op then)
        if json:
            self._countable(response)
        try:
            return super()._result(response, json, binary)
        except (ValueError, RecursionError) as exc:  # requests' JSONDecodeError is a ValueError
            raise EngineAnswerError(self.node, f"the engine's answer to {_what(response)} is not JSON: "
                                    f"{type(exc).__name__}") from None

    def _countable(self, response) -> None:
        """At most MAX_JSON_VALUES values (each is after a ',' or a ':', or opens a list), counted in
        the bytes before any is parsed: a ',' inside a string only counts against the answer."""
        if value_count(response.content or b"") > MAX_JSON_VALUES:
            raise EngineAnswerError(self.node, f"the engine's answer to {_what(response)} holds over "
                                    f"{MAX_JSON_VALUES:,} values: stopped before reading them")

    def _raise_for_status(self, response):
        """docker-py's APIError / NotFound / ImageNotFound, its explanation the answer's `message`
        when that is a string (else the answer's first MAX_EXPLANATION characters)."""
        import requests

        try:
            response.raise_for_status()
        except requests.exceptions.HTTPError as e:
            said = _explanation(response)
            cls = docker.errors.APIError
            if response.status_code == 404:
                image = any(f in said.lower() for f in getattr(docker.errors, "_image_not_found_explanation_fragments",
                                                               ("no such image",)))
                cls = docker.errors.ImageNotFound if image else docker.errors.NotFound
            raise cls(e, response=response, explanation=said) from e

    def containers(self, *args, **kwargs):
        answer = super().containers(*args, **kwargs)
        return answer if kwargs.get("quiet") else _listing(answer, "containers", self.node)

    def images(self, *args, **kwargs):
        answer = super().images(*args, **kwargs)
        return answer if kwargs.get("quiet") else _listing(answer, "images", self.node)

    def inspect_container(self, container):
        return _entry(super().inspect_container(container), f"container {container!r}"[:120], self.node)

    def inspect_image(self, image):
        return _entry(super().inspect_image(image), f"image {image!r}"[:120], self.node)

    def create_container(self, *args, **kwargs):
        return _entry(super().create_container(*args, **kwargs), "the container it created", self.node)

    def wait(self, *args, **kwargs):
        answer = super().wait(*args, **kwargs)
        code = answer.get("StatusCode") if isinstance(answer, dict) else None
        if not isinstance(code, int) or isinstance(code, bool):
            raise EngineAnswerError(self.node, "the engine's answer to a container's wait has no exit status")
        return answer


class NodeDocker(docker.DockerClient):
    """docker.DockerClient of checked models over a NodeAPI."""

    @property
    def containers(self) -> NodeContainers:
        return NodeContainers(client=self)

    @property
    def images(self) -> NodeImages:
        return NodeImages(client=self)


def docker_client(client: paramiko.SSHClient, timeout: float, node: str = "?"):
    """docker.DockerClient whose every request rides `client` (docker_api.VerifiedSSHAdapter), its
    answers bounded and checked here, a malformed one named as node `node`'s."""
    api = NodeAPI(base_url="tcp://127.0.0.1:9", version=docker.constants.MINIMUM_DOCKER_API_VERSION,
                  timeout=timeout)  # type: ignore[arg-type]  # seconds; an explicit version: connects to nothing
    api.bound(node)  # every answer bounded, each as it arrives
    adapter = VerifiedSSHAdapter(client, timeout, node)
    # What docker-py's own APIClient does for its SSH adapter (its private attributes: not in its stubs).
    api._custom_adapter = adapter  # type: ignore[attr-defined]
    api.mount("http+docker://ssh", adapter)
    api._unmount("http://", "https://")  # type: ignore[attr-defined]
    api.base_url = "http+docker://ssh"
    api._version = api._retrieve_server_version()  # type: ignore[attr-defined]
    out = NodeDocker.__new__(NodeDocker)
    out.api = api
    return out
