"""`runner up`: check -> push -> run id -> config + env-file to every node -> master container ->
master's rendezvous port listening -> workers (node ranks 1..N-1) -> watch -> the job's result.

Workers whose image carries runner.agents.gate start their containers together with the master's and
import torchrun meanwhile; their torchrun still starts only after the runner has seen the
master's port listening (it writes each one a go-file then). That keeps the master-first
contract and takes the workers' start-up off the launch's critical path.

`--dry-run` stops after planning: it prints the plan with secrets masked and each node's memory
estimate (runner/planning/sizing.py), and opens no socket. A node that cannot hold its pipeline stage is
refused before anything is contacted, with or without --dry-run.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from dataclasses import replace
from pathlib import Path

from runner.backends.ssh import perseus
from runner.backends.ssh.dry_run import RESUME_ARGS, prepare
from runner.backends.ssh.elastic_loop import ElasticRun, joiner, last_step, layout_split
from runner.backends.ssh.node_runs import create_container, run_containers, stop_node, stop_run
from runner.backends.ssh.resume import hand_back_runs, resume_run
from runner.backends.ssh.run_end import last_metrics, write_status
from runner.backends.ssh.watch import FAIL_STOP_GRACE_S, Watcher
from runner.core.errors import (
    EXIT_HUNG,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_TERMINATED,
    Terminated,
    UserError,
    interrupt_code,
)
from runner.core.redact import printable
from runner.core.runs import new_run_id
from runner.delivery.resume_sync import CHECKPOINTS, sync_checkpoints
from runner.inventory import Inventory
from runner.planning.elastic import in_place_on
from runner.planning.paths import node_paths
from runner.planning.plan import (
    GATE_MODULES,
    LABEL_GATE,
    OUT,
    TORCHRUN_MODULES,
    NodePlan,
    Plan,
    make_plan,
    render_secrets_file,
)
from runner.planning.sizing import check_sizing
from runner.profile.auto import pin_auto_partition
from runner.transport.cluster import Cluster
from runner.transport.probe import Probe, probe
from runner.transport.rendezvous import choose_port, wait_listening
from runner.transport.ssh import Remote

log = logging.getLogger("runner.up")
REGROW = -1  # launch_once: an elastic run's layout was stopped to take returning nodes back


def submit(backend, plan, detach: bool = False):
    """Start the planned run (runner.api's submit): attached, until it ends (the Run's exit_code
    says how); detached, once every container is started. The plan's sizing refusal stops it
    here, before anything is contacted, unless its options ignore sizing."""
    from types import SimpleNamespace

    from runner.backends.notify import Outcome, notifying
    from runner.backends.results import Run

    if plan.backend != "ssh":
        raise UserError(f"a plan for {plan.backend} runs cannot be submitted to SSH nodes")
    opts = plan.options
    prepared = prepare(backend.inventory, opts, detach)  # a fresh copy of the job for this launch
    spec, inv = prepared.notify, prepared.inv
    args = SimpleNamespace(**vars(opts), detach=detach, accept_new_host_keys=backend.accept_new_host_keys,
                           parallel=backend.parallel)
    run = Run(backend="ssh", inventory=str(inv.path), run_id="", detached=detach)
    with notifying(spec, Outcome(inv.path, "ssh", [n.name for n in inv.ordered()])) as outcome:
        check_sizing(inv, show=False, ignore=opts.ignore_sizing)  # a stage that cannot fit: refused, nothing contacted
        launcher = Launcher(inv, args, prepared.secrets, outcome if spec else None)
        if prepared.elastic is not None:
            launcher.el = ElasticRun(inv, prepared.elastic, args.accept_new_host_keys,
                                     Path(args.logs_dir) / "elastic-pending")
        outcome.exit_code = launcher.run()
    run.run_id, run.exit_code = launcher.run_id or "", outcome.exit_code
    return run


class Launcher:
    def __init__(self, inv: Inventory, args, secret_vals: dict[str, str], outcome=None):
        self.inv, self.args, self.secret_vals = inv, args, secret_vals
        self.outcome = outcome                # runner/backends/notify.py Outcome: what a notification says
        self.lost: str | None = None          # node lost during the last attempt
        self.lost_reclaimed = False           # ... and reached again, its container removed
        self.gates: dict[str, str | None] = {}  # node -> its image's io.runner.gate label (GATE_MODULES)
        self.trees: list = []                 # job.sync's sources, scanned (runner/delivery/sync.py)
        self.perseus_port: int | None = None  # job.perseus: the server's port on the master
        self.el: ElasticRun | None = None     # job.elastic / --elastic: the layout over the nodes there now
        self.resumed_from: str | None = None  # the checkpoint the last resume chose
        self.failed = None                    # the last attempt's watcher outcome (None: all exited 0)
        self.silent: dict[str, str] = {}      # ... and the nodes that did not answer after it: node -> why
        self.stopped_at = self.synced_at = 0.0  # when the others were stopped; when the resume's files were
        self.run_id: str | None = None        # once chosen (a new id, or the run --resume names)

    def run(self) -> int:
        t0 = time.time()
        with Cluster(self.inv, self.args.accept_new_host_keys, workers=self.args.parallel) as cl:
            log.debug("connected to %d node(s) in %.2fs", len(cl.remotes), time.time() - t0)
            run_id = self.run_id = self._run_id(cl)  # a --resume naming no run fails before anything is pushed
            if self.outcome:
                self.outcome.run_id = run_id
            probes = self.preflight(cl)
            log.debug("preflight done at %.2fs", time.time() - t0)
            # Again with what the nodes have now (MemAvailable): still before anything is pushed or made.
            check_sizing(self.inv, show=False, ignore=self.args.ignore_sizing,
                         probed={n: p.mem_available for n, p in probes.items() if p.mem_available})
            if not self.args.no_push:
                from runner.delivery.push import push_to_nodes

                push_to_nodes(cl, {n: p.arch for n, p in probes.items()}, quiet=False)
                log.debug("images checked at %.2fs", time.time() - t0)
            if self.inv.job.sync:
                from runner.delivery.sync import scan, sync_to_nodes

                self.trees = scan(self.inv.job.sync)
                sync_to_nodes(cl, {n: p.home for n, p in probes.items()}, self.trees)
                log.debug("job.sync done at %.2fs", time.time() - t0)
            self.gates = self.image_gates(cl, probes)
            if self.el is not None:
                try:
                    return self.run_elastic(cl, probes, run_id)
                finally:
                    self.el.close()
            # parallel.partition auto: the nodes measured (cached), the split pinned as custom:...
            pin_auto_partition(cl, probes, lambda n: node_paths(n, probes[n.name].home).run(run_id),
                               resume=bool(self.args.resume))
            attempt = 0
            while True:
                code = self.launch_once(cl, probes, run_id, resume=bool(self.args.resume) or attempt > 0)
                if code in (0, EXIT_INTERRUPTED, EXIT_TERMINATED) or attempt >= self.args.max_restarts:
                    return code  # Ctrl-C and SIGTERM mean stop, not try again
                if self.trained_out():
                    return code
                if self.lost and not self.lost_reclaimed:
                    return code  # a relaunch needs every node
                attempt += 1
                log.warning("run %s: restart %d/%d from the latest checkpoint", run_id, attempt,
                            self.args.max_restarts)

    def run_elastic(self, cl: Cluster, probes: dict[str, Probe], run_id: str) -> int:
        """Launch after launch, each over the nodes there are, until the job ends or cannot go on
        (runner/backends/ssh/elastic_loop.py). Restarts for other failures: --max-restarts, as ever."""
        el, attempt, resume = self.el, 0, bool(self.args.resume)
        el.log_dir = Path(self.args.logs_dir) / run_id
        if resume:  # `up --resume` of an elastic run: its history goes on
            el.load_history(cl[self.inv.master.name], node_paths(self.inv.master, probes[self.inv.master.name].home).run(run_id))
        master = self.inv.master.name
        while True:
            self.inv = el.inventory()
            view = cl.view(self.inv)
            if self.inv.master.name != master:  # each node's interface is the one that routes to the master
                master = self.inv.master.name
                probes.update(self.preflight(view))
            pin_auto_partition(view, probes, lambda n: node_paths(n, probes[n.name].home).run(run_id), resume=resume,
                               pp=el.layout.pp)
            code = self.launch_once(view, probes, run_id, resume=resume)
            if code in (0, EXIT_INTERRUPTED, EXIT_TERMINATED) or self.trained_out():
                return code
            # Which nodes are gone first (pings with a timeout): a read from a cut node would hang.
            gone = {} if code == REGROW else el.gone(self.lost, self.failed, self.silent)
            last = last_step(view, [n for n in self.inv.ordered() if n.name not in gone], probes, run_id)
            if code == REGROW:
                el.regrow(run_id, last)
            else:
                try:
                    if not el.after_failure(cl, run_id, gone, last, self.failed, self.stopped_at):
                        if attempt >= self.args.max_restarts:
                            return code
                        attempt += 1
                        log.warning("run %s: restart %d/%d from the latest checkpoint", run_id, attempt,
                                    self.args.max_restarts)
                except UserError as exc:
                    sys.stderr.write(f"runner: error: {printable(str(exc))}\n")
                    el.stop_retrying()
                    for node in list(el.lost):  # as without elastic: not orphaned while it can be helped
                        self.reclaim_lost(cl, node, run_id)  # says itself what it could not do
                    el.lost.clear()
                    return code
            resume = True

    def trained_out(self) -> bool:
        """The last attempt hung after every rank's `done` (a teardown hang): its training had ended,
        so neither --max-restarts nor job.elastic launches it again; exit 5 says what happened."""
        return bool(self.failed is not None and getattr(self.failed, "teardown", False))

    def _run_id(self, cl: Cluster) -> str:
        if not self.args.resume:
            return new_run_id()
        return resume_run(cl[self.inv.master.name], self.args.resume)

    def image_gates(self, cl: Cluster, probes: dict[str, Probe]) -> dict[str, str | None]:
        """Each node's image's label io.runner.gate: the gate its workers start behind (with the
        master) and the mended torchrun it runs (plan.GATE_MODULES, TORCHRUN_MODULES). Others (an
        image of the user's own) start once the master listens, under plain torchrun. Without a
        push (--no-push) a node that lacks its image is refused here, before anything is made."""
        from runner.delivery.images import node_image_labels

        def tag_of(r: Remote) -> str | None:
            return self.inv.job.image_for(r.node.arch or probes[r.node.name].arch)

        labels = cl.each(lambda r: node_image_labels(r, tag_of(r)) if tag_of(r) else {})
        lacking = sorted(n for n, lb in labels.items() if lb is None)
        if lacking:
            shown = ", ".join(f"{n} ({tag_of(cl[n])})" for n in lacking[:5]) + (" ..." if len(lacking) > 5 else "")
            raise UserError(f"--no-push: {len(lacking)} node(s) lack the job's image: {shown}; "
                            "run `runner push` first, or `runner up` without --no-push")
        return {n: (lb or {}).get(LABEL_GATE) for n, lb in labels.items()}

    def preflight(self, cl: Cluster) -> dict[str, Probe]:
        def one(r: Remote) -> Probe:
            p = probe(r, self.inv.master.rank_addr, clock=False)
            if not p.docker_error:
                r.docker()  # open the API connection now, off the launch's critical path
            return p

        probes = cl.each(one)
        bad = []
        for name, p in probes.items():
            node = self.inv.node(name)  # a dict lookup (a scan per node was O(n^2) at 10,000 nodes)
            if p.docker_error:
                bad.append(f"{name}: docker engine not reachable ({p.docker_error})")
            if not p.ifname:
                bad.append(f"{name}: no interface routes to master {self.inv.master.rank_addr}")
            if node.arch and p.arch and node.arch != p.arch:
                bad.append(f"{name}: inventory says arch {node.arch} but the node is {p.arch}")
        if bad:
            raise UserError("preflight failed: " + "; ".join(bad))
        return probes

    def make_plan(self, probes: dict[str, Probe], run_id: str, resume: bool, port: int,
                  resume_args: list[str] = RESUME_ARGS, direct: bool = False) -> Plan:
        job = self.inv.job
        saved = list(job.args)
        if resume and not any(a == "--resume" for a in job.args):
            job.args = saved + resume_args
        try:
            labels = {n: self.gates.get(n) or "" for n in probes}
            facts = {n: replace(p.facts(), gate=GATE_MODULES.get(labels[n]), torchrun=TORCHRUN_MODULES.get(labels[n]))
                     for n, p in probes.items()}
            plan = make_plan(self.inv, run_id, facts, master_port=port, secret_keys=list(self.secret_vals),
                             strict=True, launch_token=secrets.token_hex(4),
                             gate_timeout=self.args.rendezvous_timeout + 60, trees=self.trees, direct=direct)
            if job.perseus is not None:
                perseus.attach(plan, self.perseus_port)
            return plan
        finally:
            job.args = saved

    def stage_files(self, cl: Cluster, plan: Plan) -> None:
        config = Path(plan.config_src).read_bytes() if plan.config_src else None
        secret_text = render_secrets_file(self.secret_vals).encode() if self.secret_vals else None

        def one(np: NodePlan) -> None:
            r = cl[np.node]
            r.makedirs(np.run_dir)
            if config is not None:
                r.put_bytes(np.config_file, config, 0o644)
            if secret_text is not None:
                r.makedirs(os.path.dirname(np.secrets_file), 0o700)
                r.put_bytes(np.secrets_file, secret_text, 0o600)
            if np.go_file:
                r.makedirs(os.path.dirname(np.go_file))

        for np_, _, err in cl.map(plan.nodes, one):
            if err:
                raise UserError(f"node {np_.node}: staging files in {np_.run_dir} failed: {err}")

    def clear_earlier_attempt(self, cl: Cluster, run_id: str) -> None:
        """Containers of this run from an earlier attempt: a node lost then may have come back
        with its container still running (same name: the new one could not be created). A run
        still running on every node is not a relaunch's to kill: that is `runner down`."""
        found = {n: run_containers(r, run_id) for n, r in cl.remotes.items()}
        if all(any(c.status == "running" for c in cs) for cs in found.values()):
            raise UserError(f"--resume {run_id}: the run is still running on every node; "
                            f"`runner down {run_id} -i {self.inv.path}` first, or follow it with `runner logs {run_id} -f`")
        stale, errors = stop_run(cl.remotes, run_id, grace=FAIL_STOP_GRACE_S, workers=cl.workers)
        if errors:
            raise UserError(f"run {run_id}: could not remove earlier containers on " + "; ".join(errors))
        if stale:
            log.warning("run %s: removed containers left by an earlier attempt on %s", run_id, ", ".join(stale))

    def launch_once(self, cl: Cluster, probes: dict[str, Probe], run_id: str, resume: bool) -> int:
        t0 = time.time()
        self.lost, self.lost_reclaimed = None, False
        # Chosen now, not at preflight: the push may have taken minutes, and other runs start meanwhile.
        port = choose_port(cl[self.inv.master.name], self.inv.job.master_port, run_id)
        if self.inv.job.perseus is not None:
            self.perseus_port = perseus.choose_port(cl[self.inv.master.name], self.inv.job.perseus, run_id, port)
        plan = self.make_plan(probes, run_id, resume, port)
        if resume:
            plan = self.prepare_resume(cl, probes, plan, port)
        log_dir = Path(self.args.logs_dir) / run_id
        master = plan.nodes[0]
        watcher: Watcher | None = None
        try:
            # Inside the try: a failure from here on removes what was staged (the secrets file too).
            self.stage_files(cl, plan)
            log.debug("files staged in %.2fs", time.time() - t0)
            if self.inv.job.perseus is not None:  # the ranks register with it as they start
                perseus.start(cl, plan, self.inv.job.perseus, self.perseus_port, self.args.rendezvous_timeout)
            create_container(cl[master.node], master).start()
            log.debug("master container started at %.2fs", time.time() - t0)
            # Gated workers start now: their gate imports torchrun while the master's comes up and
            # starts it on the go-file. The others are only created until the master listens.
            made = cl.map(plan.nodes[1:], lambda np: create_container(cl[np.node], np))
            for np_, _, err in made:
                if err:
                    raise UserError(f"node {np_.node}: creating container failed: {err}")
            gated = [(np_, c) for np_, c, _ in made if np_.go_file]
            held = [(np_, c) for np_, c, _ in made if not np_.go_file]
            start_all(cl, gated)
            if plan.nnodes > 1:  # nobody to hold back on a single node
                wait_listening(cl[master.node], master, int(plan.master_port), self.args.rendezvous_timeout)
            log.info("[%s/0] master listening on %s:%s after %.1fs", master.node, plan.master_addr,
                     plan.master_port, time.time() - t0)
            go = cl.map([np_ for np_, _ in gated], lambda np_: cl[np_.node].put_bytes(np_.go_file, b""))
            for np_, _, err in go:
                if err:
                    raise UserError(f"node {np_.node}: writing the go-file {np_.go_file} failed: {err}")
            start_all(cl, held)
            log.info("run %s: %d node(s) running after %.1fs", run_id, plan.nnodes, time.time() - t0)
            print(f"run {run_id} started on {', '.join(n.node for n in plan.nodes)}", flush=True)
            if self.args.detach:
                print(f"follow: runner logs {run_id} -f -i {self.inv.path}   stop: runner down {run_id} -i {self.inv.path}")
                return 0
            self.layout_started(cl, probes, run_id, resume)
            watcher = Watcher(cl.remotes, plan, log_dir, workers=cl.workers,
                              yield_to=self.el.back if self.el is not None else None,
                              hang_timeout_s=self.inv.job.hang_timeout)
            if (el := self.el) is not None and in_place_on(self.inv):  # the trainer regroups in place
                homes = {n: p.home for n, p in probes.items()}
                watcher.on_lost = lambda ev: el.regroup_in_place(cl, run_id, homes, ev)
                watcher.on_hung = lambda ev: el.hung_in_place(cl, run_id, homes, ev)
                watcher.on_back = lambda: el.rejoin_in_place(cl, run_id, homes, joiner(self, el, cl, probes, run_id),
                                                             news=watcher.news)
            failed = watcher.run()
            self.failed, self.stopped_at = failed, time.time()
        except KeyboardInterrupt as exc:
            sys.stderr.write(f"runner: {'terminated' if isinstance(exc, Terminated) else 'interrupted'}: "
                             f"stopping run {run_id} (grace {plan.grace_period:.0f}s)\n")
            stop_run(cl.remotes, run_id, plan.grace_period, workers=cl.workers)
            return interrupt_code(exc)
        except BaseException:
            stop_run(cl.remotes, run_id, grace=3, workers=cl.workers)  # never leave half a run behind
            raise
        if failed is not None and failed.yielded:
            return REGROW
        if failed is None:
            write_status(cl, plan, watcher, 0)
            stop_run(cl.remotes, run_id, grace=0, workers=cl.workers)  # exited containers: remove them
            print(f"run {run_id} finished: all {plan.nnodes} node(s) exited 0; collect: runner collect {run_id}")
            self._tell(cl, plan, f"run {run_id} finished: all {plan.nnodes} node(s) exited 0")
            return 0
        return self.failed_run(cl, plan, watcher, failed)

    def failed_run(self, cl: Cluster, plan: Plan, watcher: Watcher, failed) -> int:
        """A launch that failed: the failed node's last lines, status files where nodes answer,
        one error line, the notification's summary; a lost node reclaimed (not in elastic runs)."""
        run_id = plan.run_id
        what = failed.error or f"container exited with code {failed.exit_code}"
        for line in failed.last_lines:
            sys.stderr.write(f"  [{failed.node}/{failed.rank}] {line}\n")  # made visible when it was shown
        # Nodes not answering now get no status file: a write behind a cut link would hang.
        self.silent = {failed.node: failed.error or "lost"} if failed.lost else {}
        if failed.lost or self.el is not None:
            self.silent.update({n: w for n, w in cl.silent().items() if n not in self.silent})
        write_status(cl, plan, watcher, failed.exit_code or 1, skip=set(self.silent))
        where = "every node" if not failed.lost else f"the other nodes ({watcher.stopped_in or 0:.1f}s after the loss)"
        sys.stderr.write(f"runner: error: run {run_id}: node {failed.node} (rank {failed.rank}) failed: {printable(what)}; "
                         f"stopped the run on {where}\n")
        self._tell(cl, plan, f"run {run_id}: node {failed.node} (rank {failed.rank}) failed: {what}",
                   skip=set(self.silent))
        if failed.hung and self.el is not None and not failed.teardown:  # an elastic run goes on without it
            self.lost = failed.node
        if failed.lost:
            self.lost = failed.node
            if self.el is None:  # an elastic run goes on without it and retries it meanwhile
                self.lost_reclaimed = self.reclaim_lost(cl, failed.node, run_id)
        if failed.hung:
            return EXIT_HUNG
        return EXIT_JOB_FAILED  # the job's own code is in the line above and in `runner status`

    def layout_started(self, cl: Cluster, probes: dict[str, Probe], run_id: str, resume: bool) -> None:
        """An elastic run's layout event, once its containers run (nothing without job.elastic)."""
        if self.el is not None:
            self.el.started(cl, run_id, {n: probes[n].home for n in cl.remotes}, self.resumed_from if resume else None,
                            layout_split(self.inv), synced=self.synced_at if resume else None)

    def prepare_resume(self, cl: Cluster, probes: dict[str, Probe], plan: Plan, port: int) -> Plan:
        """What a resumed run needs before it starts: the earlier attempt's containers gone, its
        run dirs the SSH user's, and every node holding the newest checkpoint all can load."""
        run_id = plan.run_id
        self.clear_earlier_attempt(cl, run_id)
        hand_back_runs(cl, plan, probes)  # before the sync writes into it as the SSH user
        # Only once nothing of the run is left running (a stale container could still write).
        synced = sync_checkpoints(cl.remotes, {np.node: np.run_dir for np in plan.nodes},
                                  progress=lambda msg: log.info("resume: copied %s", msg))
        print(f"run {run_id}: {synced.summary()}", flush=True)
        self.resumed_from = synced.checkpoint
        self.synced_at = time.time()
        if synced.checkpoint and not synced.all_latest:
            # Some node's `latest` names another checkpoint: name the chosen one outright.
            plan = self.make_plan(probes, run_id, True, port, ["--resume", f"{OUT}/{CHECKPOINTS}/{synced.checkpoint}"])
        return plan

    def _tell(self, cl: Cluster, plan: Plan, summary: str, skip: set[str] = frozenset()) -> None:
        """The notification's summary and the run's last metrics record (read only when one is sent)."""
        if self.outcome is None:
            return
        self.outcome.summary = summary
        self.outcome.last_metrics = last_metrics(cl, [np for np in plan.nodes if np.node not in skip])

    def reclaim_lost(self, cl: Cluster, node: str, run_id: str) -> bool:
        """A lost node's container still runs on its engine (closing SSH stops nothing): keep
        trying to reach the node and remove it, for --reclaim-timeout seconds, so it is not orphaned."""
        again = f"runner down {run_id} -i {self.inv.path}"
        sys.stderr.write(f"runner: node {node}: trying for {self.args.reclaim_timeout:.0f}s to reach it and stop its "
                         f"container (Ctrl-C gives up; later: `{again}`)\n")
        cl[node].abandon()
        deadline = time.time() + self.args.reclaim_timeout
        last = ""
        try:
            while time.time() < deadline:
                try:
                    r = Remote(self.inv.node(node), self.args.accept_new_host_keys).connect()
                except UserError as exc:
                    last = str(exc)
                    time.sleep(1.0)
                    continue
                try:
                    gone = stop_node(r, run_id, grace=FAIL_STOP_GRACE_S)
                except Exception as exc:  # noqa: BLE001 - engine not answering yet: retry
                    last = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    r.close()
                    time.sleep(1.0)
                    continue
                cl.reconnected(node, r)
                sys.stderr.write(f"runner: node {node} is reachable again: "
                                 + ("stopped and removed its container\n" if gone else "no container of the run left\n"))
                return True
        except KeyboardInterrupt:
            last = "gave up (interrupted)"
        sys.stderr.write(f"runner: error: node {node} still unreachable ({printable(last[:300]) or 'no answer'}); its container of run "
                         f"{run_id} may still be running: `{again}` once it is back\n")
        return False




def start_all(cl: Cluster, made: list[tuple[NodePlan, object]]) -> None:
    """Start created containers in parallel; one error naming the first that failed."""
    for (np_, _), _, err in cl.map(made, lambda m: m[1].start()):
        if err:
            raise UserError(f"node {np_.node}: starting container {np_.container} failed: {err}")
