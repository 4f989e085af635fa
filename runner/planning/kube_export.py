"""`runner export --to kubernetes`: the inventory's job as a JobSet manifest (jobset.x-k8s.io).

One pod per node of the inventory (an SSH inventory's nodes, or a Slurm inventory's `nodes`),
grouped into one replicated Job per (architecture, GPUs) so each group gets its image through a
`kubernetes.io/arch` node selector. torchrun is configured by its PET_* variables with the same
contract as the other schedulers: static rendezvous, node rank = the group's first rank + the
pod's completion index, rank 0's pod (group 0, index 0) as the master address through the
JobSet's headless service, OUTPUT_DIR=/out on a volume, a memory-backed /dev/shm, GPU limits,
the env_file as a Secret and the config as a ConfigMap.

No cluster exists here: tests check the manifest against the JobSet CRD's schema and the core
Kubernetes schemas offline. Pure: the manifest is built from the job and the nodes; reading the
inventory and writing the file are runner/cli/export.py's.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any

import yaml

from runner.inventory import Job
from runner.planning.jobspec import CHOOSE_TORCHRUN, entry_argv, signal_env
from runner.planning.plan import OUT

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
CONFIG_DIR = "/run/runner/config"
DEFAULT_PORT = 29500
# Node rank from the group's first rank + the pod's index in its Indexed Job (a downward-API value).
RANK_SH = ('export PET_NODE_RANK=$((RUNNER_RANK_OFFSET + RUNNER_POD_INDEX)); export NODE_RANK=$PET_NODE_RANK; '
           f'{CHOOSE_TORCHRUN}; exec $launch "$@"')
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


@dataclass(frozen=True)
class Group:
    """Pods that share an image and a GPU request; their ranks are contiguous."""

    name: str
    arch: str
    gpus: int
    nproc: int
    count: int
    offset: int       # the group's first node rank


def groups_from(nodes: list[tuple[str, int, int]]) -> list[Group]:
    """nodes in rank order as (arch, gpus, nproc); rank 0 stays rank 0 (first group, index 0)."""
    order: list[tuple[str, int, int]] = []
    counts: dict[tuple[str, int, int], int] = {}
    for key in nodes:
        if key not in counts:
            order.append(key)
        counts[key] = counts.get(key, 0) + 1
    out, offset = [], 0
    for arch, gpus, nproc in order:
        n = counts[(arch, gpus, nproc)]
        name = arch + (f"-gpu{gpus}" if gpus else "") + (f"-p{nproc}" if len({k[2] for k in order}) > 1 else "")
        out.append(Group(name, arch, gpus, nproc, n, offset))
        offset += n
    return out


def k8s_name(run_id: str) -> str:
    name = "runner-" + re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")
    # Pod hostnames are <jobset>-<group>-<job index>-<pod index>: keep room in the 63-char label.
    return name[:40].rstrip("-")


def manifest(job: Job, groups: list[Group], run_id: str, *, namespace: str | None = None,
             out_claim: str | None = None, secrets: dict[str, str] | None = None,
             config_text: str | None = None, image_for=None) -> list[dict]:
    """The documents to `kubectl apply`: [Secret], [ConfigMap], JobSet."""
    name = k8s_name(run_id)
    meta = {"namespace": namespace} if namespace else {}
    labels = {"app.kubernetes.io/name": "runner", "io.runner/run-id": re.sub(r"[^A-Za-z0-9_.-]", "-", run_id)[:63]}
    docs: list[dict] = []
    secret_name = f"{name}-env" if secrets else None
    if secrets:
        docs.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                     "metadata": {"name": secret_name, **meta, "labels": dict(labels)},
                     "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(secrets.items())}})
    config_name = f"{name}-config" if config_text is not None else None
    if config_text is not None:
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": config_name, **meta, "labels": dict(labels)},
                     "data": {"config.yaml": config_text}})
    master = f"{name}-{groups[0].name}-0-0.{name}"   # rank 0's pod, through the JobSet's headless service
    port = job.master_port if isinstance(job.master_port, int) else DEFAULT_PORT
    nnodes = sum(g.count for g in groups)
    args = entry_argv(job, f"{CONFIG_DIR}/config.yaml" if config_name else None)
    base_env = {**signal_env(job.grace_period), **job.env}
    for k in secrets or {}:
        base_env.pop(k, None)  # the Secret wins, and its value must not sit in the pod spec
    base_env.update({"RUN_ID": run_id, "NNODES": str(nnodes), "MASTER_ADDR": master, "MASTER_PORT": str(port),
                     "OUTPUT_DIR": OUT, "PYTHONUNBUFFERED": "1",
                     "PET_NNODES": str(nnodes), "PET_MASTER_ADDR": master, "PET_MASTER_PORT": str(port),
                     "PET_RDZV_BACKEND": "static", "PET_MAX_RESTARTS": "0"})
    rjobs = []
    for g in groups:
        group_env = {**base_env, "PET_NPROC_PER_NODE": str(g.nproc), "RUNNER_RANK_OFFSET": str(g.offset)}
        env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(group_env.items())]
        env += [{"name": "RUNNER_POD_INDEX", "valueFrom": {"fieldRef": {
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
                {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
        container = {"name": "trainer", "image": image_for(g.arch), "command": ["/bin/sh", "-c", RANK_SH, "runner"],
                     "args": [*args, *job.args], "env": env,
                     "volumeMounts": [{"name": "out", "mountPath": OUT}, {"name": "dshm", "mountPath": "/dev/shm"}]}
        if secret_name:
            container["envFrom"] = [{"secretRef": {"name": secret_name}}]
        if config_name:
            container["volumeMounts"].append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
        if g.gpus:
            container["resources"] = {"limits": {"nvidia.com/gpu": g.gpus}}
        out_vol = ({"name": "out", "persistentVolumeClaim": {"claimName": out_claim}} if out_claim
                   else {"name": "out", "emptyDir": {}})
        if out_claim:
            container["volumeMounts"][0]["subPath"] = f"runs/{run_id}"
        volumes = [out_vol, {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        if config_name:
            volumes.append({"name": "config", "configMap": {"name": config_name}})
        pod = {"metadata": {"labels": dict(labels)},
               "spec": {"restartPolicy": "Never", "nodeSelector": {"kubernetes.io/arch": g.arch},
                        "terminationGracePeriodSeconds": int(job.grace_period), "containers": [container],
                        "volumes": volumes}}
        rjobs.append({"name": g.name, "replicas": 1, "template": {"spec": {
            "parallelism": g.count, "completions": g.count, "completionMode": "Indexed", "backoffLimit": 0,
            "template": pod}}})
    docs.append({"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": {"name": name, **meta, "labels": dict(labels)},
                 "spec": {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                          "failurePolicy": {"maxRestarts": 0}, "successPolicy": {"operator": "All"},
                          "replicatedJobs": rjobs}})
    return docs


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (the ConfigMap's config reads as the file it is)."""


def _str(dumper: yaml.SafeDumper, value: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def dump(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=120)
