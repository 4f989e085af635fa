"""`runner up --scheduler slurm` and `runner down` of a Slurm run.

up: check the cluster (client tools, partition, node count, `sbatch --test-only`) -> stage the
config, the 0600 env_file and the script in the run dir on the shared filesystem -> `sbatch` on
this machine or the login node -> follow the nodes' output until the job ends (or `--detach`).
Nothing is written or submitted when a check fails.

down: `scancel --signal=USR1` (the job's steps: torchrun forwards it, every rank writes the
`.preempt` checkpoint), wait up to the grace period for the job to end, then `scancel`. A `down`
mark in the run dir keeps a `--requeue` job from requeueing itself after it.
"""

from __future__ import annotations

import copy
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from runner.backends.base import dry_run_id, sizing_text, up_job
from runner.backends.results import CancelReport, NodeLaunch, Plan, Run
from runner.backends.slurm.jobs import (
    JobState,
    job_state,
    node_names,
    preflight,
    read_record,
    resolve_run,
    test_only,
    workdir,
    write_record,
)
from runner.backends.slurm.plan import DOWN_MARK, SlurmFacts, SlurmPlan, make_slurm_plan, oci_config_json
from runner.backends.slurm.shell import Shell
from runner.backends.slurm.status import Follower, last_job, last_metrics_line
from runner.core.errors import EXIT_HUNG, Terminated, UserError
from runner.core.node_output import visible
from runner.core.redact import printable
from runner.inventory.job_data import refuse_for
from runner.inventory.slurm import SlurmInventory
from runner.planning import hang_budget
from runner.planning.plan import masked
from runner.planning.sizing import check_sizing, slurm_nodes


def _prepare(inv: SlurmInventory, options, detach: bool) -> tuple[SlurmInventory, dict[str, str], object, list[str]]:
    """What a plan and a submission both do first, on a copy of the job: what Slurm cannot do with
    it refused, its secrets and notify spec, job.dp_sync's flags. (inventory, secrets, notify spec,
    job.dp_sync's --dry-run lines)."""
    inv = copy.copy(inv)
    inv.job = copy.deepcopy(inv.job)
    refuse_for(inv.job, "--scheduler slurm")
    secrets, spec = up_job(options, detach, inv.job, inv.path)
    dp_sync = _dp_sync(inv)
    if dp_sync is not None:
        inv.job.args += dp_sync.args
    return inv, secrets, spec, (dp_sync.lines if dp_sync is not None else [])


def _dp_sync(inv: SlurmInventory):
    """job.dp_sync on Slurm (runner/planning/dp_sync.py): the allocation's links are not known
    before it runs, so auto keeps allreduce; None when the job does not set it."""
    if inv.job.dp_sync is None:
        return None
    from runner.planning.dp_sync import without_links

    return without_links(inv, "a Slurm allocation's links are not measured before it starts")


def make_plan(backend, options) -> Plan:
    """The batch script and its torchrun line (Plan.detail: the SlurmPlan), and the sizing of
    slurm.nodes against slurm.mem; nothing contacted or submitted."""
    inv, secrets, _spec, dp_lines = _prepare(backend.inventory, options, detach=False)
    run_id = dry_run_id(options)
    home = None if inv.slurm.login else str(Path.home())
    plan = make_slurm_plan(inv, run_id, SlurmFacts(home=home), resume=bool(options.resume), requeue=options.requeue,
                           secret_keys=list(secrets))
    sizing, refused = sizing_text(slurm_nodes(inv.slurm, inv.job, inv.path), memory_field="slurm.mem")
    text = (plan.render(inv, _where(inv)) + "\n" + (sizing + "\n" if sizing is not None else "")
            + ((hang_budget.dry_run_line(inv.job) or "") + "\n").lstrip("\n")
            + "".join(line + "\n" for line in dp_lines))
    s = inv.slurm
    image = (s.image or inv.job.image_for(s.arch)) if s.container != "none" else None
    def launches() -> list[NodeLaunch]:  # the allocation's nodes are known once it runs: named by rank here
        env = masked(plan.env)
        return [NodeLaunch(node=f"node-{k}", rank=k, host="<allocated by Slurm>", arch=s.arch, image=image,
                           command=[str(k) if a == "$rank" else a for a in plan.torchrun],
                           env={**env, "NODE_RANK": str(k)}, secret_keys=list(plan.secret_keys), run_dir=plan.run_dir)
                for k in range(s.nodes)]

    return Plan(backend="slurm", inventory=str(inv.path), run_id=run_id, options=options, text=text,
                master_addr="$MASTER_ADDR", master_port=inv.job.master_port, refusal=refused, detail=plan,
                prepared=inv, launches=launches)


def submit_plan(backend, plan: Plan, detach: bool) -> Run:
    """Check the cluster, stage the run's files, sbatch; attached: follow the nodes' output until the
    job ends (the Run's exit_code: 0 when it completed with exit 0)."""
    from runner.backends.notify import Outcome, notifying

    if plan.backend != "slurm":
        raise UserError(f"a plan for {plan.backend} runs cannot be submitted to Slurm")
    opts = plan.options
    inv, secrets, spec, _dp_lines = _prepare(backend.inventory, opts, detach)
    run = Run(backend="slurm", inventory=str(inv.path), run_id="", detached=detach)
    with notifying(spec, Outcome(inv.path, "slurm")) as outcome:
        # a stage that cannot fit slurm.mem: refused before anything is contacted or submitted
        check_sizing(slurm_nodes(inv.slurm, inv.job, inv.path), show=False, ignore=opts.ignore_sizing,
                     memory_field="slurm.mem")
        outcome.exit_code = _up(backend, inv, opts, detach, secrets, outcome, run)
    run.exit_code = outcome.exit_code
    return run


def _up(backend, inv: SlurmInventory, opts, detach: bool, secrets: dict[str, str], outcome, run: Run) -> int:
    sh = backend.shell()
    try:
        part = preflight(sh, inv)
        wd = workdir(sh, inv)
        submission = 1
        if opts.resume:
            run_id = resolve_run(sh, wd, opts.resume)
            rec = read_record(sh, f"{wd}/runs/{run_id}")
            for sub in rec.get("submissions", []):
                st = job_state(sh, sub["job_id"])
                if st.active:
                    raise UserError(f"--resume {run_id}: Slurm job {sub['job_id']} of the run is still {st.state}; "
                                    f"`runner down {run_id} -i {inv.path}` first")
            submission = len(rec.get("submissions", [])) + 1
        else:
            from runner.core.runs import new_run_id

            run_id = new_run_id()
        facts = _facts(sh, inv, wd)
        plan = make_slurm_plan(inv, run_id, facts, submission=submission, resume=bool(opts.resume),
                               requeue=opts.requeue, secret_keys=list(secrets))
        test_only(sh, inv, plan.script)
        outcome.run_id = run.run_id = run_id
        job_id = run.job_id = submit(sh, inv, plan, secrets)
        print(f"run {run_id} submitted: Slurm job {job_id} ({inv.slurm.nodes} node(s), partition {part.name}, "
              f"container {inv.slurm.container}) from {sh.where}", flush=True)
        if detach:
            print(f"follow: runner logs {run_id} -f -i {inv.path}   stop: runner down {run_id} -i {inv.path}")
            return 0
        return _follow(sh, inv, plan, job_id, outcome)
    finally:
        sh.close()


def _where(inv: SlurmInventory) -> str:
    return f"login node {inv.slurm.login.host}" if inv.slurm.login else "this machine"


def _facts(sh: Shell, inv: SlurmInventory, wd: str) -> SlurmFacts:
    ids = sh.run(["sh", "-c", "id -u; id -g"]).out.split()
    uid, gid = (int(ids[0]), int(ids[1])) if len(ids) == 2 and all(i.isdigit() for i in ids) else (0, 0)
    facts = SlurmFacts(home=sh.home(), uid=uid, gid=gid)
    if inv.slurm.container == "oci":
        from runner.backends.slurm.oci import ensure_bundle

        bundle, env, image_wd = ensure_bundle(sh, inv, wd)
        facts = SlurmFacts(home=facts.home, uid=uid, gid=gid, bundle=bundle, image_env=tuple(env),
                           image_workdir=image_wd)
    return facts


def submit(sh: Shell, inv: SlurmInventory, plan: SlurmPlan, secrets: dict[str, str]) -> str:
    """Stage the run's files and sbatch the script; the job id. Until Slurm has taken the job, a
    failure (sbatch refusing it, a lost connection, Ctrl-C) removes the secrets file and the script
    (job.env's values) it staged: no job, nothing of it left that holds a value."""
    from runner.planning.plan import render_secrets_file

    staged: list[str] = []
    try:
        sh.makedirs(plan.slurm_dir)
        if plan.config_file and inv.job.config:
            sh.put_bytes(plan.config_file, Path(inv.job.config).read_bytes())
        if plan.secrets_file:
            sh.makedirs(plan.secrets_file.rsplit("/", 1)[0], 0o700)
            staged.append(plan.secrets_file)
            sh.put_bytes(plan.secrets_file, render_secrets_file(secrets).encode(), 0o600)
        if plan.oci_config is not None:
            # Mounted into every container of the bundle: they must exist. Same content for every run
            # from this workdir, so rewriting it never changes what a running job was started with.
            sh.makedirs(f"{plan.workdir}/secrets", 0o700)
            if sh.read_bytes(f"{plan.bundle}/config.json") != oci_config_json(plan):
                sh.put_bytes(f"{plan.bundle}/config.json", oci_config_json(plan))
        staged.append(plan.script_path)
        sh.put_bytes(plan.script_path, plan.script.encode(), 0o700)  # job.env values: owner only
        res = sh.run(["sbatch", "--parsable", plan.script_path], timeout=120)
        job_id = res.out.strip().split(";")[0]
        if res.rc != 0 or not job_id.isdigit():
            why = (res.err or res.out).strip().splitlines()[-1:] or [f"exit {res.rc}"]
            raise UserError(f"sbatch failed on {sh.where}: {visible(why[0])[:300]}; nothing submitted")
    except BaseException:
        for path in staged:
            try:
                sh.remove(path)
            except Exception:  # noqa: BLE001 - the connection that failed may be gone: the first error says why
                pass
        raise
    rec = read_record(sh, plan.run_dir) or {"run_id": plan.run_id, "inventory": inv.path, "submissions": []}
    rec.update({"grace_period": inv.job.grace_period, "container": inv.slurm.container, "nodes": inv.slurm.nodes})
    rec["submissions"].append({"job_id": job_id, "submission": plan.submission, "script": plan.script_path,
                               "resume": "--resume" in plan.torchrun,
                               "submitted": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    write_record(sh, plan.run_dir, rec)
    return job_id


def _follow(sh: Shell, inv: SlurmInventory, plan: SlurmPlan, job_id: str, outcome=None) -> int:
    from runner.backends.slurm.hang import watch_for

    watch = watch_for(sh, inv, plan, job_id)
    try:
        st = Follower(sh, plan.run_dir, job_id).follow(watch.tick if watch is not None else None)
        if outcome is not None:
            outcome.nodes = node_names(sh, plan.run_dir, job_id)
            outcome.last_metrics = last_metrics_line(sh, plan.run_dir)
            outcome.summary = (f"run {plan.run_id}: Slurm job {job_id} ended {st.state}"
                               + (f" (exit {st.exit_code})" if st.exit_code is not None else ""))
    except KeyboardInterrupt as exc:
        sys.stderr.write(f"runner: {'terminated' if isinstance(exc, Terminated) else 'interrupted'}: stopping run "
                         f"{plan.run_id} (Slurm job {job_id}, grace {inv.job.grace_period:.0f}s)\n")
        stop_job(sh, plan.run_dir, job_id, inv.job.grace_period)
        return getattr(exc, "exit_code", 130)
    finally:
        if watch is not None:
            watch.close()
    if watch is not None and (hung := watch.hung) is not None:  # the hang watch cancelled it
        what = f"node {hung.node} (rank {hung.node_rank}) failed: {hung.verdict.line}"
        sys.stderr.write(f"runner: error: run {plan.run_id}: {printable(what)}; stopped Slurm job {job_id} "
                         f"(ended {st.state})\n")
        if outcome is not None:
            outcome.summary = f"run {plan.run_id}: {what}"
        return EXIT_HUNG
    code = st.exit_code
    if st.state in ("COMPLETED", "GONE") and code == 0:
        print(f"run {plan.run_id} finished: Slurm job {job_id} exited 0 on all {inv.slurm.nodes} node(s); "
              f"collect: runner collect {plan.run_id} -i {inv.path}")
        return 0
    sys.stderr.write(f"runner: error: run {plan.run_id}: Slurm job {job_id} ended {st.state}"
                     + (f" (exit {code})" if code is not None else "") + f"; its output: {plan.slurm_dir}/{job_id}.out\n")
    return code if code and 0 < code < 126 else 1


def stop_job(sh: Shell, run_dir: str, job_id: str, grace: float) -> tuple[JobState, str]:
    """USR1 to the job's steps, up to `grace` seconds for it to end, then scancel. Returns the
    final state and what was done."""
    sh.put_bytes(f"{run_dir}/slurm/{DOWN_MARK}", b"")  # a --requeue job must not come back after this
    st = job_state(sh, job_id, run_dir)
    if not st.active:
        return st, "not running"
    how = "cancelled"
    deadline = time.monotonic() + grace
    if st.state == "RUNNING":
        res = sh.run(["scancel", "--signal=USR1", job_id])
        how = "sent USR1" if res.rc == 0 else "cancelled"
        while res.rc == 0 and time.monotonic() < deadline:
            st = job_state(sh, job_id, run_dir)
            if not st.active:
                return st, "sent USR1; ended within the grace period"
            time.sleep(0.5)
        how += f"; still {st.state} after {grace:.0f}s: cancelled" if res.rc == 0 else ""
    sh.run(["scancel", job_id])
    end = time.monotonic() + 60  # scancel: SIGTERM, KillWait, SIGKILL on the nodes
    while time.monotonic() < end:
        st = job_state(sh, job_id, run_dir)
        if not st.active:
            break
        time.sleep(0.5)
    return st, how


def _latest_active(sh: Shell, wd: str) -> str:
    """Without a run id: the newest run with a job in the queue (named runner-<run>), else the newest run."""
    from runner.backends.slurm.jobs import list_runs

    res = sh.run(["squeue", "-h", "--me", "-o", "%j"])
    queued = {n.removeprefix("runner-") for n in res.out.split() if n.startswith("runner-")} if res.rc == 0 else set()
    active = [r for r in list_runs(sh, wd) if r in queued]
    return active[-1] if active else resolve_run(sh, wd, None)


def cancel(backend, run: str | None, grace: float | None) -> CancelReport:
    """USR1 to the job's steps (the preempt checkpoint), up to the grace period (the run's
    job.grace_period unless given), then scancel; exit_code 1 while the job is still active."""
    inv = backend.inventory
    sh = backend.shell()
    try:
        wd = workdir(sh, inv)
        run_id = resolve_run(sh, wd, run) if run else _latest_active(sh, wd)
        rep = CancelReport(run_id=run_id)
        run_dir = f"{wd}/runs/{run_id}"
        job_id, rec = last_job(sh, run_dir)
        if not job_id:
            rep.lines.append(f"run {run_id}: nothing submitted")
            return rep
        grace = grace if grace is not None else float(rec.get("grace_period", 30))
        t0 = time.monotonic()
        st, how = stop_job(sh, run_dir, job_id, grace)
        sh.run(["rm", "-f", f"{wd}/secrets/{run_id}.env"])  # no use once the job is gone
        if how == "not running":
            rep.lines.append(f"run {run_id}: nothing running (Slurm job {job_id} {st.state})")
            return rep
        rep.stopped = node_names(sh, run_dir, job_id)
        latest = (sh.read_bytes(f"{run_dir}/checkpoints/latest") or b"").decode(errors="replace").strip()
        rep.lines.append(visible(f"run {run_id}: Slurm job {job_id} {how}; {st.state} after "
                                 f"{time.monotonic() - t0:.1f}s" + (f"; latest checkpoint {latest[:200]}" if latest else "")))
        rep.exit_code = 0 if not st.active else 1
        return rep
    finally:
        sh.close()
