"""`runner export --to kubernetes`: the inventory's job as a JobSet manifest (jobset.x-k8s.io).

One pod per node of the inventory (an SSH inventory's nodes, or a Slurm inventory's `nodes`),
grouped into one replicated Job per (architecture, GPUs) so each group gets its image through a
`kubernetes.io/arch` node selector. torchrun is configured by its PET_* variables with the same
contract as the other schedulers: static rendezvous, node rank = the group's first rank + the
pod's completion index, rank 0's pod (group 0, index 0) as the master address through the
JobSet's headless service, OUTPUT_DIR=/out on a volume, a memory-backed /dev/shm, GPU limits,
the env_file as a Secret and the config as a ConfigMap.

No cluster exists here: tests check the manifest against the JobSet CRD's schema and the core
Kubernetes schemas offline. Pure: the manifest is built from the inventory; only `main` writes.
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from runner.errors import UserError
from runner.inventory import Job, looks_secret
from runner.inventory.job_data import refuse_for
from runner.jobspec import entry_argv, signal_env
from runner.plan import MASK, OUT
from runner.redact import hide_job

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
CONFIG_DIR = "/run/runner/config"
DEFAULT_PORT = 29500
# Node rank from the group's first rank + the pod's index in its Indexed Job (a downward-API value).
RANK_SH = ('export PET_NODE_RANK=$((RUNNER_RANK_OFFSET + RUNNER_POD_INDEX)); export NODE_RANK=$PET_NODE_RANK; '
           'exec torchrun "$@"')
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
        env = [{"name": k, "value": v} for k, v in sorted({**base_env, "PET_NPROC_PER_NODE": str(g.nproc),
                                                            "RUNNER_RANK_OFFSET": str(g.offset)}.items())]
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


def _nodes_of(path: str, job_path: str | None, arch: str | None,
              gpus_per_node: int | None = None) -> tuple[Job, list[tuple[str, int, int]]]:
    """(job, nodes in rank order as (arch, gpus, nproc)) from an SSH or a Slurm inventory."""
    from runner.inventory.slurm import load_slurm_inventory, top_level_keys

    keys = top_level_keys(path)
    if "slurm" in keys and "nodes" not in keys:
        inv = load_slurm_inventory(path, job_path=job_path, check_files=False)
        s = inv.slurm
        gpus = s.gpus_per_node if gpus_per_node is None else gpus_per_node
        return inv.job, [(arch or s.arch, gpus, inv.job.nproc_per_node or gpus or 1)] * s.nodes
    from runner.inventory import load_inventory

    inv = load_inventory(path, check_files=False, job_path=job_path)
    nodes = []
    for n in inv.ordered():
        a = n.arch or arch
        if a is None:
            raise UserError(f"{inv.path}:{n.line}: node {n.name}: arch unknown (not in the inventory); "
                            "add `arch:` or pass --arch amd64|arm64")
        if n.gpus == "all" and gpus_per_node is None:
            raise UserError(f"{inv.path}:{n.line}: node {n.name}: gpus: all cannot be requested from Kubernetes; "
                            "pass --gpus-per-node N (or give the node a count)")
        gpus = gpus_per_node if gpus_per_node is not None else int(n.gpus or 0)
        nodes.append((a, gpus, inv.job.nproc_per_node or n.slots))
    return inv.job, nodes


def register(sub: argparse._SubParsersAction) -> None:
    from runner.inventory_arg import add_inventory_args

    p = sub.add_parser("export", help="write the job for another scheduler (Kubernetes: a JobSet manifest)")
    add_inventory_args(p)
    p.add_argument("--to", choices=("kubernetes",), required=True, help="target (kubernetes: JobSet + Secret + ConfigMap)")
    p.add_argument("--job", help="YAML file with a job section, overriding the inventory's")
    p.add_argument("-o", "--output", default=None,
                   help="file to write (default kubernetes-<run>.yaml; '-' prints it with secret values masked)")
    p.add_argument("--run-id", default=None, help="run id (default: a new one); names the JobSet runner-<run>")
    p.add_argument("--namespace", default=None, help="Kubernetes namespace of every object (default: the kubectl context's)")
    p.add_argument("--out-claim", default=None, metavar="PVC",
                   help="PersistentVolumeClaim for /out (runs/<run> on it); default an emptyDir (lost with the pods)")
    p.add_argument("--arch", default=None, choices=("amd64", "arm64"), help="arch of nodes the inventory leaves unprobed")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                   help="GPUs each pod requests (nvidia.com/gpu), e.g. for nodes with `gpus: all`")
    p.set_defaults(func=main)


def main(args) -> int:
    from runner.runs import new_run_id

    job, nodes = _nodes_of(args.inventory, args.job, args.arch, args.gpus_per_node)
    refuse_for(job, "export --to kubernetes")
    for flag, val in (("--namespace", args.namespace), ("--out-claim", args.out_claim)):
        if val is not None and not DNS_LABEL.fullmatch(val):
            raise UserError(f"{flag} {val!r}: must be a lowercase DNS label (a-z, 0-9, '-')")
    run_id = args.run_id or new_run_id()

    def image_for(arch: str) -> str:
        tag = job.image_for(arch)
        if not tag:
            raise UserError(f"{args.inventory}: job.image: no image for arch {arch}; add `{arch}: <tag>`")
        return tag

    secrets = job.secrets()
    hide_job(job, secrets)
    config_text = Path(job.config).read_text() if job.config else None
    docs = manifest(job, groups_from(nodes), run_id, namespace=args.namespace, out_claim=args.out_claim,
                    secrets=secrets, config_text=config_text, image_for=image_for)
    head = (f"# runner export --to kubernetes: run {run_id}, {len(nodes)} pod(s), from {args.inventory}.\n"
            "# kubectl apply -f THIS (needs the JobSet controller: jobset.x-k8s.io).\n")
    secret_inside = bool(secrets) or any(looks_secret(k) for k in job.env)
    if args.output == "-":
        sys.stdout.write(head + dump(masked_docs(docs)))
        return 0
    out = Path(args.output or f"kubernetes-{run_id}.yaml")
    try:
        write_private(out, head + dump(docs), 0o600 if secret_inside else 0o644)
    except OSError as exc:
        raise UserError(f"-o {out}: cannot write it: {exc.strerror}; nothing written") from None
    kinds = ", ".join(f"{d['kind']} {d['metadata']['name']}" for d in docs)
    print(f"wrote {out}: {kinds} ({len(nodes)} pod(s))" + ("; holds the env_file's values: mode 0600" if secrets else
          "; holds job.env's secret-looking values: mode 0600" if secret_inside else ""))
    return 0


def masked_docs(docs: list[dict]) -> list[dict]:
    """The manifest as printed: the Secret's values and job.env's secret-looking ones (TOKEN, KEY...,
    which land in the pod spec) masked, as every other printed form masks them."""
    import copy

    shown = copy.deepcopy(docs)
    for d in shown:
        if d["kind"] == "Secret":
            d["data"] = dict.fromkeys(d["data"], MASK)
        for rj in d.get("spec", {}).get("replicatedJobs", []):
            for c in rj["template"]["spec"]["template"]["spec"]["containers"]:
                for e in c.get("env", []):
                    if "value" in e and looks_secret(e["name"]):
                        e["value"] = MASK
    return shown


def write_private(path: Path, text: str, mode: int) -> None:
    """path holds text, created with mode (0600 never passes through 0644), whole or not at all: a
    failure leaves neither a partial file nor the temporary one."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # O_EXCL, 0600
    try:
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
