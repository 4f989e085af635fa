"""`runner export --to kubernetes`, checked offline (no cluster exists here):

- the JobSet against the JobSet CRD's own OpenAPI schema (kubernetes-sigs/jobset v0.12.0,
  vendored in tests/fixtures/ with its source), with jsonschema plus the API server's strict
  rule that a field the schema does not declare is an error;
- the pod template (as a batch/v1 Job), the Secret and the ConfigMap against the core Kubernetes
  schemas bundled by kubernetes-validate, strict;
- and field by field: ranks, PET_* variables, master address, images per arch, GPUs, /dev/shm,
  /out, the Secret. The validators are also shown to reject broken manifests.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import stat
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from runner.inventory import load_inventory
from runner.planning.kube_export import groups_from, manifest
from tests.support.runner_helpers import REPO, runner

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "jobset-v0.12.0-v1alpha2.schema.json"
K8S_VERSION = "1.30"


def jobset_schema() -> dict:
    return json.loads(FIXTURE.read_text())["openAPIV3Schema"]


def unknown_fields(doc, schema: dict, path: str = "") -> list[str]:
    """Fields the structural schema does not declare (`kubectl apply --validate=strict` rejects
    them; jsonschema alone would let a typo through, CRD schemas do not forbid extra keys)."""
    out: list[str] = []
    if isinstance(doc, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for k, v in doc.items():
            if props is not None and k in props:
                out += unknown_fields(v, props[k], f"{path}.{k}")
            elif isinstance(extra, dict):
                out += unknown_fields(v, extra, f"{path}.{k}")
            elif props is not None and not extra and not schema.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f"{path}.{k}")
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(doc):
            out += unknown_fields(v, schema["items"], f"{path}[{i}]")
    return out


def check(docs: list[dict]) -> list[str]:
    """Every problem the offline validators find, as strings (empty: valid)."""
    problems = []
    for d in docs:
        if d["kind"] == "JobSet":
            schema = jobset_schema()
            problems += [f"jobset schema: {'/'.join(map(str, e.absolute_path))}: {e.message}"
                         for e in jsonschema.Draft7Validator(schema).iter_errors(d)]
            problems += [f"jobset unknown field {f}" for f in unknown_fields(d, schema)]
            for rj in d["spec"].get("replicatedJobs", []):
                if "template" not in rj:
                    continue
                job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": rj["template"]["spec"]}
                problems += _core(job)
        else:
            problems += _core(d)
    return problems


def _core(doc: dict) -> list[str]:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{doc['kind']}: {'/'.join(map(str, e.absolute_path))}: {e.message}"]
    return []


def export(tmp: Path, *args: str, inventory: str | Path = REPO / "hosts" / "pis.yaml") -> list[dict]:
    out = tmp / "m.yaml"
    res = runner("export", "--to", "kubernetes", "-i", str(inventory), "-o", str(out), "--run-id",
                 "20260101-000000-abcd", *args)
    assert res.returncode == 0, res.stderr
    return list(yaml.safe_load_all(out.read_text()))


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_pi_inventory_jobset_field_by_field(tmp_path):
    docs = export(tmp_path)
    assert [d["kind"] for d in docs] == ["ConfigMap", "JobSet"]
    cm, js = docs
    assert cm["data"]["config.yaml"] == (REPO / "configs" / "pi-qwen3-3stage.yaml").read_text()
    name = "runner-20260101-000000-abcd"
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["metadata"]["name"] == name
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    [rj] = js["spec"]["replicatedJobs"]
    assert rj["name"] == "arm64" and rj["replicas"] == 1
    jspec = rj["template"]["spec"]
    assert (jspec["parallelism"], jspec["completions"], jspec["completionMode"], jspec["backoffLimit"]) == (3, 3, "Indexed", 0)
    pod = jspec["template"]["spec"]
    assert pod["nodeSelector"] == {"kubernetes.io/arch": "arm64"} and pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] == 60
    [c] = pod["containers"]
    assert c["image"] == "runner-trainer:arm64"
    assert c["command"][:2] == ["/bin/sh", "-c"] and c["command"][3] == "runner"
    assert "PET_NODE_RANK=$((RUNNER_RANK_OFFSET + RUNNER_POD_INDEX))" in c["command"][2]
    assert c["args"] == ["-m", "trainer", "--config", "/run/runner/config/config.yaml", "--train_steps", "5",
                         "--batch_size", "16", "--microbatch_num", "4", "--profile_batch", "1"]
    master = f"{name}-arm64-0-0.{name}"  # rank 0's pod through the JobSet's headless service
    assert env_of(c) == {
        "MASTER_ADDR": master, "MASTER_PORT": "29500", "NNODES": "3", "OMP_NUM_THREADS": "4", "OUTPUT_DIR": "/out",
        "PET_MASTER_ADDR": master, "PET_MASTER_PORT": "29500", "PET_MAX_RESTARTS": "0", "PET_NNODES": "3",
        "PET_NPROC_PER_NODE": "1", "PET_RDZV_BACKEND": "static", "PET_SHUTDOWN_TIMEOUT": "58",
        "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "PYTHONUNBUFFERED": "1",
        "RUNNER_RANK_OFFSET": "0", "RUN_ID": "20260101-000000-abcd",
        "RUNNER_POD_INDEX": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}},
        "NODE_NAME": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["out"]["mountPath"] == "/out" and mounts["dshm"]["mountPath"] == "/dev/shm"
    assert mounts["config"] == {"name": "config", "mountPath": "/run/runner/config", "readOnly": True}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory"} and vols["out"] == {"name": "out", "emptyDir": {}}
    assert vols["config"]["configMap"]["name"] == f"{name}-config"
    assert "resources" not in c and "envFrom" not in c
    assert check(docs) == []


def test_mixed_arch_gpus_secret_and_claim(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("HF_TOKEN=hf_abc123secret\n")
    inv = tmp_path / "mixed.yaml"
    inv.write_text(yaml.safe_dump({
        "nodes": [{"name": "a0", "host": "10.9.0.1", "arch": "amd64", "gpus": 8, "slots": 8, "role": "master"},
                  {"name": "p0", "host": "10.9.0.2", "arch": "arm64"},
                  {"name": "a1", "host": "10.9.0.3", "arch": "amd64", "gpus": 8, "slots": 8}],
        "job": {"image": {"amd64": "reg.example.org/trainer:1", "arm64": "reg.example.org/trainer:1-arm64"},
                "config": str(REPO / "configs" / "tiny.yaml"), "env_file": str(env_file),
                "env": {"HF_TOKEN": "inline-loses"}, "master_port": 29400, "grace_period": 30}}))
    out = tmp_path / "m.yaml"
    res = runner("export", "--to", "kubernetes", "-i", str(inv), "-o", str(out), "--run-id", "r1",
                 "--namespace", "ml", "--out-claim", "shared-runs")
    assert res.returncode == 0, res.stderr
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600 and "hf_abc123secret" not in res.stdout
    docs = list(yaml.safe_load_all(out.read_text()))
    assert [d["kind"] for d in docs] == ["Secret", "ConfigMap", "JobSet"]
    secret, _, js = docs
    assert secret["metadata"] == {"name": "runner-r1-env", "namespace": "ml", "labels": secret["metadata"]["labels"]}
    assert base64.b64decode(secret["data"]["HF_TOKEN"]).decode() == "hf_abc123secret"
    amd, arm = js["spec"]["replicatedJobs"]
    # Ranks: the amd64 GPU group first (it holds the master, rank 0), then the arm64 node as rank 2.
    assert (amd["name"], amd["template"]["spec"]["parallelism"]) == ("amd64-gpu8-p8", 2)
    assert (arm["name"], arm["template"]["spec"]["parallelism"]) == ("arm64-p1", 1)
    ca = amd["template"]["spec"]["template"]["spec"]["containers"][0]
    cp = arm["template"]["spec"]["template"]["spec"]["containers"][0]
    assert (env_of(ca)["RUNNER_RANK_OFFSET"], env_of(cp)["RUNNER_RANK_OFFSET"]) == ("0", "2")
    assert (env_of(ca)["PET_NPROC_PER_NODE"], env_of(cp)["PET_NPROC_PER_NODE"]) == ("8", "1")
    assert env_of(ca)["PET_MASTER_ADDR"] == env_of(cp)["PET_MASTER_ADDR"] == "runner-r1-amd64-gpu8-p8-0-0.runner-r1"
    assert env_of(ca)["MASTER_PORT"] == "29400" and env_of(ca)["PET_NNODES"] == "3"
    assert (ca["image"], cp["image"]) == ("reg.example.org/trainer:1", "reg.example.org/trainer:1-arm64")
    assert ca["resources"] == {"limits": {"nvidia.com/gpu": 8}} and "resources" not in cp
    assert amd["template"]["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/arch": "amd64"}
    assert ca["envFrom"] == [{"secretRef": {"name": "runner-r1-env"}}] and "HF_TOKEN" not in env_of(ca)
    assert "hf_abc123secret" not in yaml.safe_dump(js) and "inline-loses" not in yaml.safe_dump(js)
    pod = amd["template"]["spec"]["template"]["spec"]
    assert {"name": "out", "persistentVolumeClaim": {"claimName": "shared-runs"}} in pod["volumes"]
    assert ca["volumeMounts"][0] == {"name": "out", "mountPath": "/out", "subPath": "runs/r1"}
    assert check(docs) == []
    shown = runner("export", "--to", "kubernetes", "-i", str(inv), "-o", "-", "--run-id", "r1")
    assert shown.returncode == 0 and "HF_TOKEN: '******'" in shown.stdout and "hf_abc" not in shown.stdout


@pytest.mark.parametrize("inv,extra", [("ec2.yaml", ["--gpus-per-node", "4"]), ("local.yaml", []),
                                       ("slurm.yaml", [])])
def test_other_inventories_validate(tmp_path, inv, extra):
    path = REPO / "hosts" / inv
    if not path.exists():
        pytest.skip(f"{inv} is written by `runner sandbox up`")
    docs = export(tmp_path, *extra, inventory=path)
    assert check(docs) == []


def test_slurm_inventory_exports(tmp_path):
    inv = tmp_path / "s.yaml"
    inv.write_text(yaml.safe_dump({"slurm": {"nodes": 4, "gpus_per_node": 2, "container": "pyxis"},
                                   "job": {"image": "reg.example.org/trainer:1", "config": str(REPO / "configs" / "tiny.yaml")}}))
    docs = export(tmp_path, inventory=inv)
    [rj] = docs[-1]["spec"]["replicatedJobs"]
    c = rj["template"]["spec"]["template"]["spec"]["containers"][0]
    assert (rj["name"], rj["template"]["spec"]["parallelism"]) == ("amd64-gpu2", 4)
    assert env_of(c)["PET_NPROC_PER_NODE"] == "2" and c["resources"] == {"limits": {"nvidia.com/gpu": 2}}
    assert check(docs) == []


def test_validators_reject_broken_manifests():
    """The checks can fail: each mutation of a valid manifest is reported."""
    inv = load_inventory(REPO / "hosts" / "pis.yaml", check_files=False)
    docs = manifest(inv.job, groups_from([("arm64", 0, 1)] * 3), "r1", config_text="a: 1\n",
                    image_for=lambda a: "img")
    assert check(docs) == []

    def broken(fn) -> list[str]:
        d = copy.deepcopy(docs)
        fn(d[-1])
        return check(d)

    pod = lambda js: js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]  # noqa: E731
    assert any("'template' is a required property" in p for p in broken(lambda js: js["spec"]["replicatedJobs"][0].pop("template")))
    assert broken(lambda js: js["spec"].update(replicatedJob=[])) == ["jobset unknown field .spec.replicatedJob"]
    assert any("nodeSelectr" in p for p in broken(lambda js: pod(js).update(nodeSelectr={})))
    assert any("'8' is not of type 'integer'" in p or "is not valid" in p
               for p in broken(lambda js: js["spec"]["replicatedJobs"][0].update(replicas="8")))
    assert broken(lambda js: pod(js)["containers"][0]["env"].append({"name": "X", "value": 3}))
    bad_secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "data": {"A": 1}}
    assert check([bad_secret])


def test_bad_export_arguments_are_one_line(tmp_path):
    res = runner("export", "--to", "kubernetes", "-i", str(REPO / "hosts" / "ec2.yaml"), "-o", str(tmp_path / "x.yaml"))
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1
    assert "gpus: all cannot be requested from Kubernetes; pass --gpus-per-node N" in res.stderr
    res = runner("export", "--to", "kubernetes", "-i", str(REPO / "hosts" / "pis.yaml"), "-o", "-", "--namespace", "ML_team")
    assert res.returncode != 0 and "--namespace 'ML_team': must be a lowercase DNS label" in res.stderr
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("run_id", ["r1\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: injected}", "../../other-team"])
def test_export_refuses_a_run_id_that_is_not_one(tmp_path, run_id):
    """--run-id went raw into the manifest's header comment (a newline began a Pod of the caller's
    choosing), its file name and its volume's subPath."""
    out = tmp_path / "x.yaml"
    res = runner("export", "--to", "kubernetes", "-i", str(REPO / "hosts" / "pis.yaml"), "-o", str(out), "--run-id", run_id)
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "--run-id " in res.stderr and ": not a run id" in res.stderr
    assert not out.exists()
