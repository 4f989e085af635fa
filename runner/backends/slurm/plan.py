"""Slurm plan: inventory + run id + a few facts in, the sbatch script (and, for `container: oci`,
the bundle's config.json) out. Pure: no sockets, no files, no clocks; `--dry-run` prints it and
tests read it field by field.

The script keeps the SSH runner's contract (docs/contract.md): one torchrun per node with the
static rendezvous, node rank = the node's index in the allocation (rank 0 = its first node, whose
NodeAddr is MASTER_ADDR), the same env (RUN_ID, NODE_NAME, NODE_RANK, NNODES, MASTER_ADDR/PORT,
OUTPUT_DIR, GLOO/NCCL_SOCKET_IFNAME probed on each node), secrets from a 0600 file, and everything
written under the run dir on the cluster's shared filesystem: `/out` in a pyxis container. In an
OCI container it is `/runner/runs/<run-id>`: Slurm 22.05 fixes the container's root to
`<bundle>/rootfs` (runc refuses a symlink there), so one bundle per image serves every run and
its config.json can only mount the workdir's `runs/` and `secrets/`, not one run's dir at /out.

Layout of a run dir: `slurm/submit-K.sbatch` (each submission's script), `slurm/jobs` (job ids),
`slurm/<job>.out` (the batch script's output) and `slurm/<job>/` (node list, per-node probe and
output `node<K>.out`, exit code) beside what the trainer writes.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from runner.core.node_output import visible, visible_lines
from runner.inventory.slurm import SlurmInventory
from runner.planning import jobspec
from runner.planning.jobspec import CHOOSE_TORCHRUN
from runner.planning.plan import OUT, SECRETS_IN_CONTAINER
from runner.transport.rendezvous import AUTO_PORT_BASE, AUTO_PORT_SPAN, port_offset

OCI_WORK = "/runner"          # oci: <workdir>/runs and <workdir>/secrets are mounted under it
DOWN_MARK = "down"            # <run dir>/slurm/down: written by `runner down` (no requeue after it)


@dataclass(frozen=True)
class SlurmFacts:
    """What the runner learned on the submit host; all optional for a dry-run."""

    home: str | None = None          # to resolve ~ (sbatch needs absolute paths)
    uid: int = 0                     # oci: the container runs as the submitting user
    gid: int = 0
    bundle: str | None = None        # oci: the exported image's bundle dir (rootfs/ inside)
    image_env: tuple[str, ...] = ()  # oci: the image's own env (PATH of its virtualenv, ...)
    image_workdir: str = "/"         # oci: the image's WorkingDir (relative paths in configs)


@dataclass
class SlurmPlan:
    run_id: str
    submission: int
    workdir: str
    run_dir: str
    script_path: str
    script: str
    env: dict[str, str]              # exported to every task; never a secret
    secret_keys: list[str]
    secrets_file: str | None         # on the shared filesystem, 0600
    config_file: str | None
    torchrun: list[str]              # the task's command, with shell variables for per-node values
    oci_config: dict | None = None   # container: oci -> <bundle>/config.json
    bundle: str | None = None

    @property
    def slurm_dir(self) -> str:
        return f"{self.run_dir}/slurm"

    def render(self, inv: SlurmInventory, submit_from: str) -> str:
        s = inv.slurm
        lines = [f"run {self.run_id}: {s.nodes} node(s) via Slurm (partition {s.partition or '<default>'}, "
                 f"container {s.container}), submitted with sbatch on {submit_from}, static rendezvous",
                 f"  run dir   {self.run_dir} (shared filesystem; OUTPUT_DIR={self.env['OUTPUT_DIR']})",
                 f"  script    {self.script_path}"]
        if self.run_dir.startswith("~"):
            lines.append("  (~ is the submit host's home, resolved at submission: sbatch needs absolute paths)")
        if self.config_file:
            lines.append(f"  config    {inv.job.config} -> {self.config_file}")
        if self.secrets_file:
            lines.append(f"  env_file  {inv.job.env_file} -> {self.secrets_file} (0600; values masked: "
                         + ", ".join(f"{k}=******" for k in self.secret_keys) + ")")
        if self.oci_config is not None:
            lines.append(f"  oci       bundle {self.bundle} (config.json, rootfs/)")
        # Each line as `cat -v` shows it: the script's own lines stay lines, a value's escapes are seen.
        return visible_lines("\n".join(lines) + "\n" + masked_script(self.script))


def masked_script(script: str) -> str:
    """For display: values of secret-looking names (TOKEN, PASSWORD, ...) in job.env masked, as the
    SSH runner's plan masks them. The script itself keeps them (owner-only file on the cluster)."""
    from runner.inventory import looks_secret
    from runner.planning.plan import MASK

    def one(m: re.Match) -> str:
        return f"export {m[1]}={MASK}  # looks like a secret: use env_file" if looks_secret(m[1]) else m[0]

    return re.sub(r"^export ([A-Za-z_][A-Za-z0-9_]*)=(.*)$", one, script, flags=re.M)


def resolve(path: str, home: str | None) -> str:
    if path == "~" or path.startswith("~/"):
        return (home.rstrip("/") if home else "~") + path[1:]
    return path


def make_slurm_plan(inv: SlurmInventory, run_id: str, facts: SlurmFacts | None = None, submission: int = 1,
                    resume: bool = False, requeue: bool = False, secret_keys: list[str] | None = None) -> SlurmPlan:
    facts = facts or SlurmFacts()
    s, job = inv.slurm, inv.job
    workdir = resolve(s.workdir, facts.home)
    run_dir = f"{workdir}/runs/{run_id}"
    out = {"none": run_dir, "pyxis": OUT, "oci": f"{OCI_WORK}/runs/{run_id}"}[s.container]
    secret_keys = sorted(secret_keys or [])
    secrets_file = f"{workdir}/secrets/{run_id}.env" if secret_keys else None
    nproc = job.nproc_per_node or s.gpus_per_node or 1
    env = {**jobspec.signal_env(job.grace_period), **job.env}
    env.update({"RUN_ID": run_id, "NNODES": str(s.nodes), "OUTPUT_DIR": out, "PYTHONUNBUFFERED": "1"})
    if secrets_file:
        env["RUNNER_SECRETS"] = {"none": secrets_file, "pyxis": SECRETS_IN_CONTAINER,
                                 "oci": f"{OCI_WORK}/secrets/{run_id}.env"}[s.container]
    for k in secret_keys:
        env.pop(k, None)  # the env_file wins, and its value must not sit in the script
    args = list(job.args)
    if resume and "--resume" not in args:
        args += ["--resume", "latest"]
    torchrun = torchrun_argv(inv, nproc, f"{out}/config.yaml" if job.config else None, args)
    oci = oci_config(inv, workdir, facts) if s.container == "oci" else None
    bundle = (facts.bundle or f"{workdir}/bundles/<image id>") if s.container == "oci" else None
    plan = SlurmPlan(run_id=run_id, submission=submission, workdir=workdir, run_dir=run_dir,
                     script_path=f"{run_dir}/slurm/submit-{submission}.sbatch", script="", env=env,
                     secret_keys=secret_keys, secrets_file=secrets_file,
                     config_file=f"{run_dir}/config.yaml" if job.config else None, torchrun=torchrun,
                     oci_config=oci, bundle=bundle)
    plan.script = sbatch_script(inv, plan, facts, requeue)
    return plan


def torchrun_argv(inv: SlurmInventory, nproc: int, config: str | None, args: list[str]) -> list[str]:
    """The launch contract's torchrun line (runner/planning/jobspec.py), with the node rank and master
    address as shell variables (they are known only inside the allocation)."""
    return jobspec.torchrun_argv(inv.job, inv.slurm.nodes, "$rank", nproc, "$MASTER_ADDR", "$MASTER_PORT", config, args)


# Where torchrun_argv puts shell variables on purpose: the value after each of torchrun's own flags.
SHELL_VARS = {"--node-rank": "$rank", "--master-addr": "$MASTER_ADDR", "--master-port": "$MASTER_PORT"}


def _shell_words(argv: list[str]) -> list[str]:
    """Quoted, except the $variables torchrun_argv put in on purpose, told by position (torchrun's own
    flags come before the entry point): a user's argument that reads `$rank` stays literal, as over SSH."""
    own = argv.index("--max-restarts") + 2  # torchrun's own flags end there (jobspec.torchrun_argv)
    live = {i + 1 for i in range(own - 1) if SHELL_VARS.get(argv[i]) == argv[i + 1]}
    assert len(live) == len(SHELL_VARS), argv  # torchrun_argv changed: mark its variables again
    return [f'"{a}"' if i in live else shlex.quote(a) for i, a in enumerate(argv)]


def sbatch_directives(inv: SlurmInventory, plan: SlurmPlan, requeue: bool) -> list[str]:
    s, job = inv.slurm, inv.job
    d = [f"--job-name=runner-{plan.run_id}", f"--nodes={s.nodes}", "--ntasks-per-node=1"]
    for key, opt in (("partition", "partition"), ("account", "account"), ("qos", "qos"), ("time", "time"),
                     ("cpus_per_task", "cpus-per-task"), ("mem", "mem")):
        if getattr(s, key) is not None:
            d.append(f"--{opt}={getattr(s, key)}")
    if s.gpus_per_node:
        d.append(f"--gpus-per-node={s.gpus_per_node}")
    d += [f"--output={plan.slurm_dir}/%j.out", "--open-mode=append", f"--chdir={plan.run_dir}"]
    if s.time is not None:
        # Before the time limit: USR1 to the tasks (torchrun forwards it), time for the preempt checkpoint.
        d.append(f"--signal=USR1@{int(job.grace_period) + 60}")
    d.append("--requeue" if requeue else "--no-requeue")
    # The inventory's options first: sbatch takes the later of two, so the runner's own win
    # (the list is closed already: runner/inventory/sbatch_options.py).
    return list(s.sbatch) + d


PROBE = r"""# Per node, outside any container: its name and the interface that routes to MASTER_ADDR,
# probed as `runner check` probes an SSH node (never guessed).
set -u
A=$(getent ahostsv4 "$MASTER_ADDR" 2>/dev/null | awk 'NR==1{print $1}'); [ -n "$A" ] || A=$MASTER_ADDR
R=$(ip -o route get "$A" 2>/dev/null | head -n 1)
IF=$(printf '%s\n' "$R" | sed -n 's/.* dev \([^ ]*\).*/\1/p')
# The master's own address routes via lo: gloo must bind the interface that holds it, if one does.
case "$R" in local*) D=$(ip -o addr show to "$A" 2>/dev/null | awk 'NR==1{print $2}'); IF=${D:-$IF} ;; esac
if [ -z "$IF" ]; then
  echo "runner: node ${SLURMD_NODENAME:-$(hostname)}: no interface routes to master $MASTER_ADDR" >&2
  exit 1
fi
printf 'NODE_NAME=%s\nGLOO_SOCKET_IFNAME=%s\nNCCL_SOCKET_IFNAME=%s\n' "${SLURMD_NODENAME:-$(hostname)}" "$IF" "$IF" \
  > "$1/node$SLURM_NODEID.env"
"""


def task_script(inv: SlurmInventory, plan: SlurmPlan, facts: SlurmFacts) -> str:
    s = inv.slurm
    lines = ["# Per node: $1 = node rank (task id = node index: one task per node), $2 = the job dir as",
             "# seen here (inside a container: under /out). Extra arguments go to the trainer.",
             "set -eu", 'rank=$1; dir=$2; shift 2',
             "# The job's env (job.env and the contract's), set here where the job runs: never in the batch",
             "# step, whose own commands (cat, srun, scontrol) and variables a job.env PATH or JOB_DIR would change.",
             *(f"export {k}={shlex.quote(v)}" for k, v in sorted(plan.env.items())),
             'set -a; . "$dir/node$rank.env"; set +a', 'export NODE_RANK="$rank"']
    if s.container == "none" and s.venv:
        venv = resolve(s.venv, facts.home)
        lines.append(f'export VIRTUAL_ENV={shlex.quote(venv)} PATH={shlex.quote(venv)}/bin:"$PATH"')
    if s.container == "none" and s.chdir:
        lines.append(f"cd {shlex.quote(resolve(s.chdir, facts.home))}")
    if s.container == "oci":
        # Slurm gives an OCI container the job's env: the image's own PATH (its venv) must win.
        path = next((e.split("=", 1)[1] for e in facts.image_env if e.startswith("PATH=")), None)
        if path:
            lines.append(f"export PATH={shlex.quote(path)}")
        lines.append(f"cd {shlex.quote(facts.image_workdir)}  # the image's WorkingDir, as under docker")
    if plan.secrets_file:
        lines.append('set -a; . "$RUNNER_SECRETS"; set +a   # the env_file: never in argv or in this script')
    lines += ["got=", "trap 'got=1; cut=1' USR1 TERM  # set first: a signal from now on counts (the end)",
              CHOOSE_TORCHRUN, " ".join(["$launch", *_shell_words(plan.torchrun)[1:], '"$@" &'])]
    return "\n".join(lines) + "\n" + SIGNALLED_143


# torchrun ends with 1 when USR1/TERM stops it (its ranks end 143 once the preempt checkpoint is
# written), so srun's code said 143 only when --kill-on-bad-exit had terminated another node's task
# first. The task says it: a failed torchrun on a node that got USR1/TERM (Slurm signals every
# process of the step; torchrun gets its own copy, so nothing is forwarded) ends 143, which the batch
# script's requeue branch reads. A wait cut short by the trap is waited again.
SIGNALLED_143 = """pid=$!
# The end: a failed torchrun on a node that got USR1/TERM was preempted: 143, as its ranks ended.
while :; do
  cut=; rc=0; wait "$pid" || rc=$?
  [ -n "$cut" ] || break
done
if [ -n "$got" ] && [ "$rc" != 0 ]; then rc=143; fi
exit "$rc"
"""


def container_flags(inv: SlurmInventory, plan: SlurmPlan) -> list[str]:
    s, job = inv.slurm, inv.job
    if s.container == "pyxis":
        image = s.image or job.image_for(s.arch) or ""
        mounts = [f"{plan.run_dir}:{OUT}"]
        if plan.secrets_file:
            mounts.append(f"{plan.secrets_file}:{SECRETS_IN_CONTAINER}:ro")
        # Image env wins over the step's under pyxis unless named here: the master's must win (the
        # task script sets the job's env itself, inside the container).
        return [f"--container-image={image}", f"--container-mounts={','.join(mounts)}", "--no-container-mount-home",
                "--container-env=MASTER_ADDR,MASTER_PORT"]
    if s.container == "oci":
        return [f"--container={plan.bundle}"]
    return []


def heredoc(dest: str, body: str, tag: str) -> str:
    """`cat > dest` of body, verbatim: a quoted here-document whose end line is tag, lengthened until
    no line of body reads the same (a job.args value with a newline and the tag on a line of its own
    ended the document early under a fixed tag, and its next lines ran in the batch step)."""
    assert body.endswith("\n"), tag
    lines = set(body.splitlines())
    while tag in lines:
        tag += "_"
    return f"cat > {dest} <<'{tag}'\n{body}{tag}"


def sbatch_script(inv: SlurmInventory, plan: SlurmPlan, facts: SlurmFacts, requeue: bool) -> str:
    s, job = inv.slurm, inv.job
    q = shlex.quote
    container = s.container != "none"
    task_dir = "$JOB_DIR" if not container else f"{plan.env['OUTPUT_DIR']}/slurm/$SLURM_JOB_ID"
    if isinstance(job.master_port, int):
        port = f"MASTER_PORT={job.master_port}"
    else:
        lo = AUTO_PORT_BASE + port_offset(plan.run_id)
        port = (f"# master_port auto: the first port nothing listens on here (the batch script runs on the\n"
                f"# master's node), from the run's place in torchrun's neighbourhood, as the SSH runner picks it.\n"
                f"MASTER_PORT=\n"
                f"used=\" $(ss -Htln 2>/dev/null | awk '{{n = split($4, a, \":\"); printf \"%s \", a[n]}}')\"\n"
                f"for p in $(seq {lo} {lo + AUTO_PORT_SPAN - 1}); do\n"
                f"  case \"$used\" in *\" $p \"*) ;; *) MASTER_PORT=$p; break ;; esac\n"
                f"done\n"
                f"[ -n \"$MASTER_PORT\" ] || {{ echo \"runner: no free master port in {lo}..{lo + AUTO_PORT_SPAN - 1}\" >&2; exit 1; }}")
    flags = " ".join(q(f) for f in container_flags(inv, plan))
    resume = ('RESUME=""\n[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && RESUME="--resume latest"  '
              '# requeued: continue from the latest checkpoint' if requeue and "--resume" not in plan.torchrun else 'RESUME=""')
    requeue_sh = ""
    if requeue:
        requeue_sh = (f'# Preempted by our own signal (the time limit\'s USR1), not by `runner down`: back in the queue.\n'
                      f'if [ "$rc" = 143 ] && [ ! -e "$RUN_DIR/slurm/{DOWN_MARK}" ]; then\n'
                      f'  scontrol requeue "$SLURM_JOB_ID"\nfi\n')
    cleanup = (f'[ "$rc" = 0 ] && rm -f {q(plan.secrets_file)}  # the run is over: its secrets go\n'
               if plan.secrets_file else "")
    head = [
        "#!/bin/bash",
        f"# runner: run {plan.run_id}, submission {plan.submission}, from {visible(str(inv.path))}. Written by `runner up",
        "# --scheduler slurm`; kept with the run. One task per node runs torchrun with the static rendezvous:",
        "# node rank = the node's index in the allocation, rank 0 = its first node (MASTER_ADDR).",
        *[f"#SBATCH {d}" for d in sbatch_directives(inv, plan, requeue)],
    ]
    body = f"""set -uo pipefail
RUN_DIR={q(plan.run_dir)}
JOB_DIR="$RUN_DIR/slurm/$SLURM_JOB_ID"
mkdir -p "$JOB_DIR"
echo "runner: job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}) on $SLURM_JOB_NODELIST"
# Node rank order: the allocation's node list; rank 0's NodeAddr is where the ranks rendezvous.
scontrol show hostnames "$SLURM_JOB_NODELIST" > "$JOB_DIR/nodes"
MASTER_NODE=$(head -n 1 "$JOB_DIR/nodes")
MASTER_ADDR=$(scontrol show node "$MASTER_NODE" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
[ -n "$MASTER_ADDR" ] || MASTER_ADDR=$MASTER_NODE
{port}
export MASTER_ADDR MASTER_PORT
echo "runner: master $MASTER_NODE at $MASTER_ADDR:$MASTER_PORT"
{resume}
{heredoc('"$JOB_DIR/probe.sh"', PROBE, "RUNNER_PROBE")}
{heredoc('"$JOB_DIR/task.sh"', task_script(inv, plan, facts), "RUNNER_TASK")}
# Per-task command lines: the task id (%t) is the node rank, also inside an OCI container, where
# Slurm 22.05 passes no SLURM_NODEID.
echo "* /bin/sh {task_dir}/task.sh %t {task_dir} $RESUME" > "$JOB_DIR/multi-prog.conf"
srun --ntasks-per-node=1 --kill-on-bad-exit=1 /bin/sh "$JOB_DIR/probe.sh" "$JOB_DIR" \\
  || {{ echo "runner: probing the nodes failed" >&2; echo 1 > "$JOB_DIR/exit-code"; exit 1; }}
srun --ntasks-per-node=1 --kill-on-bad-exit=1 --output="$JOB_DIR/node%n.out" --open-mode=append \\
  {flags + ' ' if flags else ''}--multi-prog "$JOB_DIR/multi-prog.conf"
rc=$?
echo "$rc" > "$JOB_DIR/exit-code"
echo "runner: job $SLURM_JOB_ID: torchrun exited $rc on the nodes"
{requeue_sh}{cleanup}exit "$rc"
"""
    return "\n".join(head) + "\n" + body


def oci_config(inv: SlurmInventory, workdir: str, facts: SlurmFacts) -> dict:
    """The image bundle's config.json for `srun --container`: Slurm replaces process.args, env and
    root.path and keeps the rest. Host network, IPC and UTS (as the SSH runner's containers), a
    read-only root with a private /tmp, the workdir's runs/ (rw) and secrets/ (ro) under /runner;
    the container runs as the submitting user."""
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "bind", "source": "/dev/shm", "options": ["rbind", "rw"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]},
        {"destination": "/etc/resolv.conf", "type": "bind", "source": "/etc/resolv.conf", "options": ["rbind", "ro"]},
        {"destination": "/etc/hosts", "type": "bind", "source": "/etc/hosts", "options": ["rbind", "ro"]},
        {"destination": f"{OCI_WORK}/runs", "type": "bind", "source": f"{workdir}/runs", "options": ["rbind", "rw"]},
        {"destination": f"{OCI_WORK}/secrets", "type": "bind", "source": f"{workdir}/secrets", "options": ["rbind", "ro"]},
    ]
    return {
        "ociVersion": "1.0.2",
        "process": {"terminal": False, "user": {"uid": facts.uid, "gid": facts.gid}, "args": ["/bin/false"],
                    "env": list(facts.image_env), "cwd": facts.image_workdir,
                    "capabilities": {k: ["CAP_KILL", "CAP_NET_BIND_SERVICE", "CAP_AUDIT_WRITE"]
                                     for k in ("bounding", "effective", "permitted", "ambient")},
                    "noNewPrivileges": True},
        # Slurm 22.05 sets root.path to <bundle>/rootfs itself; read-only: every run shares it.
        "root": {"path": "rootfs", "readonly": True},
        "mounts": mounts,
        # No network, ipc or uts namespace: the node's own, as the SSH runner's containers have.
        "linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}],
                  "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
                  "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]},
    }


def oci_config_json(plan: SlurmPlan) -> bytes:
    return json.dumps(plan.oci_config, indent=1).encode()
