"""`runner export --to kubernetes`: the inventory's job (its nodes in rank order from the backend's
shapes: SSH nodes or a Slurm allocation) as a JobSet manifest file (built by
runner/planning/kube_export.py), written 0600 whole or not at all when it holds secret values, or printed
with them masked."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from runner.cli.common import add_inventory_args, open_backend
from runner.core.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
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
    from runner.core.node_output import visible
    from runner.core.redact import hide_job
    from runner.core.runs import is_run_name, new_run_id
    from runner.inventory import looks_secret
    from runner.inventory.job_data import refuse_for
    from runner.planning.kube_export import DNS_LABEL, dump, groups_from, manifest

    backend = open_backend(args, check_files=False)  # SSH nodes or a Slurm allocation, as pods
    job, nodes = backend.inventory.job, backend.shapes(args.arch, args.gpus_per_node)
    refuse_for(job, "export --to kubernetes")
    for flag, val in (("--namespace", args.namespace), ("--out-claim", args.out_claim)):
        if val is not None and not DNS_LABEL.fullmatch(val):
            raise UserError(f"{flag} {val!r}: must be a lowercase DNS label (a-z, 0-9, '-')")
    if args.run_id is not None and not is_run_name(args.run_id):
        raise UserError(f"--run-id {visible(args.run_id)[:80]!r}: not a run id (letters, digits, '.', '_', '-'; "
                        "it names the manifest's file and its volume's subPath)")
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
    head = (f"# runner export --to kubernetes: run {run_id}, {len(nodes)} pod(s), from {visible(str(args.inventory))}.\n"
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

    from runner.core.redact import MASK
    from runner.inventory import looks_secret

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
