"""Image distribution: bytes and time of a first push to 1 and to 3 empty sandbox nodes, and of a
re-push after a code-only change, beside the naive `docker save | ssh docker load`.

    .venv/bin/python -m bench.push

Targets (issue 7): re-push <= 5% of the image's bytes; first push to 3 nodes <= 1.5 x one node.
Results: bench/results/push.json.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import tarfile
import time

import yaml

from bench.sandbox_bench import REPO, runner, sandbox, ssh_argv, subset

IMAGE = "runner-trainer:latest"
CODE_TAG = "runner-trainer:bench-code"
HOST = "unix:///var/run/docker.sock"
ROW = re.compile(r"^(\S+)\s+(\S+)\s+(skipped|layers|full)\s+layers (\d+)/(\d+)\s+([\d.]+) MB of ([\d.]+) MB\s+([\d.]+)s", re.M)


def push(inv) -> tuple[float, float, float]:
    """(wall seconds, MB sent summed over nodes, image MB)."""
    t0 = time.perf_counter()
    out = runner("push", "-i", str(inv)).stdout
    wall = time.perf_counter() - t0
    rows = ROW.findall(out)
    return wall, sum(float(r[5]) for r in rows), float(rows[0][6])


def wipe(inv) -> None:
    doc = yaml.safe_load(inv.read_text())
    for n in doc["nodes"]:
        subprocess.run([*ssh_argv(doc, n), "docker image prune -af >/dev/null; docker rmi -f $(docker images -aq) "
                        ">/dev/null 2>&1; true"], check=True)


def naive(inv, tag: str) -> tuple[float, int]:
    """docker save | ssh node docker load, one node after the other (the hand-written loop)."""
    doc = yaml.safe_load(inv.read_text())
    size = int(subprocess.run(f"docker -H {HOST} save {tag} | wc -c", shell=True, capture_output=True,
                              text=True, check=True).stdout)
    t0 = time.perf_counter()
    for n in doc["nodes"]:
        subprocess.run(f"docker -H {HOST} save {tag} | {' '.join(ssh_argv(doc, n))} docker load -q",
                       shell=True, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0, size * len(doc["nodes"])


def build_code_change() -> None:
    """FROM the trainer image + the trainer package again: a realistic code-only layer."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        df = b"FROM runner-trainer:latest\nCOPY trainer /opt/bench-code/trainer\n"
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(df)
        tf.addfile(info, io.BytesIO(df))
        tf.add(REPO / "trainer", arcname="trainer", filter=lambda t: None if "__pycache__" in t.name else t)
    buf.seek(0)
    import docker

    docker.DockerClient(base_url=HOST, version="auto").images.build(fileobj=buf, custom_context=True, tag=CODE_TAG,
                                                                     network_mode="host", rm=True)


def main() -> None:
    base = sandbox(3, fresh=True)
    job = {"image": IMAGE, "master_port": "auto"}
    one, three = subset(base, 1, job), subset(base, 3, job)
    runner("push", "-i", str(one))  # warm the host-side export cache so both pushes compare like with like
    wipe(one)
    t1, mb1, img_mb = push(one)
    wipe(one)
    t3, mb3, _ = push(three)
    build_code_change()
    code = subset(base, 3, {"image": CODE_TAG, "master_port": "auto"})
    tr, mbr, code_img_mb = push(code)
    wipe(three)
    tn3, bn3 = naive(three, IMAGE)
    tnr, bnr = naive(three, CODE_TAG)
    res = {
        "image_mb": img_mb,
        "first_push_1_node": {"s": round(t1, 1), "mb": mb1},
        "first_push_3_nodes": {"s": round(t3, 1), "mb": mb3, "x_1_node": round(t3 / t1, 2)},
        "repush_code_change_3_nodes": {"s": round(tr, 1), "mb": mbr,
                                       "pct_of_image_per_node": round(100 * mbr / 3 / code_img_mb, 3)},
        "naive_first_3_nodes": {"s": round(tn3, 1), "mb": round(bn3 / 1e6, 1)},
        "naive_repush_3_nodes": {"s": round(tnr, 1), "mb": round(bnr / 1e6, 1)},
    }
    out = REPO / "bench/results/push.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    print("| what | runner push | naive save\\|ssh load |\n|---|---|---|")
    print(f"| first push, 1 node | {t1:.1f}s, {mb1:.0f} MB | |")
    print(f"| first push, 3 nodes | {t3:.1f}s ({t3 / t1:.2f}x 1 node), {mb3:.0f} MB | {tn3:.1f}s, {bn3 / 1e6:.0f} MB |")
    print(f"| re-push after code change, 3 nodes | {tr:.1f}s, {mbr:.2f} MB "
          f"({100 * mbr / 3 / code_img_mb:.3f}% of image per node) | {tnr:.1f}s, {bnr / 1e6:.0f} MB |")


if __name__ == "__main__":
    main()
