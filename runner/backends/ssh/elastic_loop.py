"""`runner up` of an elastic job: what happens between two launches when a node is lost or comes
back (the layouts themselves are runner/planning/elastic.py's).

A node lost (its link cut, its host gone: the watcher's heartbeat, or a failure after which the
node no longer answers): the others are stopped as for any failure, the layout is chosen again
over the nodes left, and the run resumes from the newest checkpoint they hold together (each node
keeps the next one's files: `--checkpoint.replicas 1` is added), with no one at the keyboard. Below
`min_nodes`, or with no layout that fits, it stops with one line.

Meanwhile a thread keeps trying the lost nodes. One that answers has its old container removed;
with `rejoin` the running layout is then stopped with its grace period (the trainer writes its
preempt checkpoint on SIGTERM) and the run resumes over every node again.

Each change is an event in `elastic.jsonl`, in the run dir of every node of the new layout and
in the local logs dir: `runner status` prints them as the run's layout history.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from contract.regroup import REGROUP_FILE, dumps
from runner.backends.ssh.node_runs import create_container, stop_node
from runner.backends.ssh.regroup_wait import wait_ready, wait_resumed
from runner.backends.ssh.watch import FAIL_STOP_GRACE_S
from runner.core.errors import UserError
from runner.core.redact import printable
from runner.inventory import Inventory
from runner.inventory.elastic_spec import ElasticSpec
from runner.planning.elastic import (
    ELASTIC_FILE,
    EVENTS_MAX,
    RULE_PARTITIONS,
    choose,
    event,
    job_layout,
    link_lines,
    parse_events,
    regroup_spec,
    replicas_args,
    sub_inventory,
)
from runner.planning.job_settings import job_settings
from runner.planning.paths import node_paths
from runner.planning.plan import container_name, hosts_of
from runner.transport.cluster import Cluster
from runner.transport.knock import answers
from runner.transport.rendezvous import pick_master_port
from runner.transport.ssh import Remote

log = logging.getLogger("runner.up")
RETRY_S = 1.0  # a lost node knocked at again (a TCP connect, transport/knock.py) every RETRY_S
# A lost node's old container, once reached, is killed at once: its ranks were cut out of the group,
# their collectives cannot finish, and the run's state lives on in the others (memory, checkpoints).
LOST_STOP_GRACE_S = 0
IN_PLACE_TIMEOUT_S = 60.0  # regroup.json written to every survivor's rank `resumed` (then: restart)


class ElasticRun:
    def __init__(self, full: Inventory, spec: ElasticSpec, accept_new: bool, log_dir: Path):
        self.full, self.spec, self.accept_new, self.log_dir = full, spec, accept_new, log_dir
        self.want = job_layout(full)
        self.layout = self.want
        self.base_args = [*full.job.args, *replicas_args(full)]
        self.lost: dict[str, str] = {}        # node -> why, while it does not answer
        self.back = threading.Event()         # a lost node answered again and `rejoin` is on
        self.returned: list[str] = []         # ... which ones
        self.stuck: set[str] = set()          # nodes whose rank hung (issue 57): back, but not taken again
        self.events: list[dict] = []
        self.pending: dict = {}               # what the next layout event says (why, steps seen)
        self.planned = 0.0                    # when the last layout was chosen (time.time())
        self.epoch = 0                        # the last regroup.json's epoch (in-place regroups)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- layouts -------------------------------------------------------------------------------
    def inventory(self) -> Inventory:
        """The current layout's nodes, with the trainer args that put the job in it."""
        sub = sub_inventory(self.full, self.layout.nodes, keep_order=True)  # a link-ordered pipeline's order
        extra = [] if self.layout == self.want else self.layout.args(self.want)
        sub.job.args = [*self.base_args, *extra]
        return sub

    @staticmethod
    def gone(lost: str | None, failed, silent: dict[str, str]) -> dict[str, str]:
        """The layout's nodes lost in the failed launch: the one the watcher lost, and any other
        that did not answer a ping after it (a node killed outright: the others failed first). Node -> why."""
        out = {lost: printable((failed.error if failed is not None and failed.node == lost and failed.error
                                else "unreachable")[:200])} if lost else {}
        out.update({n: printable(why) for n, why in silent.items() if n not in out})
        return out

    def after_failure(self, cl: Cluster, run_id: str, gone: dict[str, str], last_step: int | None,
                      failed=None, stopped: float | None = None) -> bool:
        """After a failed launch: True if the run goes on in a new layout (self.layout set), False
        if this failure lost no node (the caller handles it as any failure). UserError, one line,
        when the nodes left cannot go on."""
        if not gone:
            return False
        if failed is not None and getattr(failed, "hung", False):  # the hang watch's: out for this run
            self.stuck.add(failed.node)
        for node, why in gone.items():
            self.lost[node] = why
            cl[node].abandon()
            times = {"last_answer": failed.since, "detected": failed.detected, "stopped": stopped} \
                if failed is not None and failed.node == node else {}
            self.note(cl, run_id, event("lost", node=node, why=why, last_step=last_step, **times))
        alive = [n for n in self.layout.nodes if n not in self.lost]
        if len(alive) < self.spec.min_nodes:
            why = (f"{len(alive)} node(s) left ({', '.join(alive) or 'none'}), fewer than job.elastic.min_nodes "
                   f"{self.spec.min_nodes}; the last checkpoint stays in the run dirs (`runner up --resume {run_id}` "
                   f"once the nodes are back)")
            self.note(cl, run_id, event("stop", why=why))
            raise UserError(f"run {run_id}: lost {', '.join(gone)}: {why}")
        old = self.layout
        try:
            self.layout = choose(self.full, alive, self.want)
            self.planned = time.time()
        except UserError as exc:
            self.note(cl, run_id, event("stop", why=str(exc)))
            raise UserError(f"run {run_id}: lost {', '.join(gone)}; {exc}") from None
        self.pending = {"why": f"lost {', '.join(gone)}", "last_step": last_step}
        sys.stderr.write(f"runner: run {run_id}: lost {', '.join(gone)}: going on with {self.layout.shown} "
                         f"(was pp {old.pp} x dp {old.dp} x tp {old.tp})\n")
        self.say_links(run_id)
        self._watch(cl, run_id)
        return True

    def say_links(self, run_id: str) -> None:
        """The new layout's links as `runner check --links` cached them (runner/planning/link_use.py);
        a cache that cannot be read holds up no recovery."""
        try:
            lines = link_lines(self.full, self.layout)
        except (UserError, OSError, ValueError) as exc:
            log.debug("elastic: cached links not read: %s", exc)
            return
        for line in lines:
            sys.stderr.write(f"runner: run {run_id}: {line}\n")

    def regrow(self, run_id: str, last_step: int | None) -> None:
        """After the running layout was stopped for returning nodes: every node of the inventory
        that answers, in a layout chosen again."""
        with self._lock:
            back, self.returned = self.returned, []
            self.back.clear()
        alive = [n.name for n in self.full.ordered() if n.name not in self.lost and n.name not in self.stuck]
        self.layout = choose(self.full, alive, self.want)
        self.planned = time.time()
        self.pending = {"why": f"{', '.join(back)} back", "last_step": last_step}
        sys.stderr.write(f"runner: run {run_id}: {', '.join(back)} back: going on with {self.layout.shown}\n")
        self.say_links(run_id)

    # -- in place (the trainer's elastic.in_place) ------------------------------------------------
    def regroup_in_place(self, cl: Cluster, run_id: str, homes: dict[str, str | None], ev) -> bool:
        """A node lost while the others run: they regroup in their processes (trainer/parallel/
        stage_relayout.py) on the regroup.json written here into each one's run dir, and this waits
        for every rank's `resumed`. True: the run goes on (watched on without the node); False: the
        caller takes the restart path, nothing changed here (no layout, a write or a rank failed, late)."""
        alive = [n for n in self.layout.nodes if n != ev.node and n not in self.lost]
        if len(alive) < self.spec.min_nodes:
            return False
        try:
            layout = choose(self.full, alive, self.want)
            part = layout_split(self.inventory()) or str(job_settings(self.full.job)["parallel.partition"])
            if not part.startswith(RULE_PARTITIONS[:3]):
                return False  # `auto` is pinned per layout from the profiles: the restart path does that
            port = pick_master_port(cl[layout.nodes[0]].listening_ports(), f"{run_id}/regroup/{self.epoch + 1}")
            spec = regroup_spec(self.full, layout, self.epoch + 1, port, secrets.token_hex(8), part,
                                f"lost {ev.node}", timeout_s=IN_PLACE_TIMEOUT_S)
        except (UserError, ValueError, OSError) as exc:
            log.warning("elastic: in place not possible (%s); restarting instead", exc)
            return False
        runs = {n: node_paths(self.full.node(n), homes.get(n)).run(run_id) for n in alive}
        text = dumps(spec).encode()
        wrote = time.time()
        errors = [f"{n}: {err}" for n, _, err in cl.map(alive, lambda n: cl[n].put_bytes(f"{runs[n]}/{REGROUP_FILE}",
                                                                                          text)) if err]
        status = None if errors else wait_resumed(cl, runs, spec, {n: len(spec.ranks[n]) for n in alive})
        if status is None or isinstance(status, str):
            log.warning("elastic: in-place regroup epoch %d failed (%s); restarting instead", spec.epoch,
                        "; ".join(errors) or status or "?")
            return False
        self.epoch, old, self.layout, self.planned = spec.epoch, self.layout, layout, wrote
        why = printable((ev.error or "unreachable")[:200])
        self.lost[ev.node] = why
        cl[ev.node].abandon()
        self.note(cl, run_id, event("lost", node=ev.node, why=why, last_answer=ev.since, detected=ev.detected))
        self.note(cl, run_id, in_place_layout(layout, status, part, f"lost {ev.node}", spec.epoch, wrote), homes)
        sys.stderr.write(f"runner: run {run_id}: lost {ev.node}: regrouped in place as {layout.shown} "
                         f"(was pp {old.pp} x dp {old.dp} x tp {old.tp})\n")
        self.say_links(run_id)
        self._watch(cl, run_id)
        return True

    def hung_in_place(self, cl: Cluster, run_id: str, homes: dict[str, str | None], ev) -> bool:
        """A rank the hang watch named hung (its stacks taken): its node's container killed, the others
        regroup in place without it as for a loss (regroup_in_place), and the node is not taken back
        (its rank hung, not its link). False: the restart path (which drops the node as well)."""
        try:
            stop_node(cl[ev.node], run_id, grace=LOST_STOP_GRACE_S)
        except Exception as exc:  # noqa: BLE001 - unreachable as well: the regroup goes on without it
            log.warning("elastic: %s's container not stopped (%s)", ev.node, printable(str(exc))[:200])
        with self._lock:
            self.stuck.add(ev.node)
        return self.regroup_in_place(cl, run_id, homes, ev)

    def rejoin_in_place(self, cl: Cluster, run_id: str, homes: dict[str, str | None], start,
                        news: Callable[[], bool] = lambda: False) -> list | None:
        """Lost nodes back while the others run (the trainer's elastic.in_place): one container started
        on each (`start(node, epoch)`: its NodePlan; its trainer waits to join, with no weights), the
        regroup.json of the larger layout written to every node of it with `at_step` 0 (the running
        ranks switch after the step they are in: trainer/parallel/stage_relayout.py BoundaryCallback),
        and every rank's `resumed` waited for. The new nodes' plans: the run goes on, watched with them;
        None: the caller takes the restart path (why: one line). `news()` true while the newcomer
        starts (the watch has an event of the running layout): the newcomer stopped, [] returned."""
        with self._lock:
            back = list(self.returned)
        begun = time.time()
        why = self._rejoin_refused(back)
        layout = None
        if why is None:
            alive = [n.name for n in self.full.ordered() if n.name not in self.lost and n.name not in self.stuck]
            try:
                layout = choose(self.full, alive, self.want)
                part = layout_split(self.inventory()) or str(job_settings(self.full.job)["parallel.partition"])
                kept = [n for n in self.layout.nodes if n not in layout.nodes]
                if kept:
                    why = f"the new layout {layout.shown} leaves out the running {', '.join(kept)}"
                elif not part.startswith(RULE_PARTITIONS[:3]):
                    why = f"partition {part} is pinned per layout from the profiles"
                else:
                    port = pick_master_port(cl[layout.nodes[0]].listening_ports(), f"{run_id}/regroup/{self.epoch + 1}")
                    spec = regroup_spec(self.full, layout, self.epoch + 1, port, secrets.token_hex(8), part,
                                        f"{', '.join(back)} back", at_step=0, timeout_s=IN_PLACE_TIMEOUT_S)
            except (UserError, ValueError, OSError) as exc:
                why = printable(str(exc))[:200]
        if why is not None or layout is None:
            sys.stderr.write(f"runner: run {run_id}: {', '.join(back)} back: not joined in place ({why}); "
                             "restarting every node instead\n")
            return None
        new = [n for n in layout.nodes if n not in self.layout.nodes]
        try:
            plans = [start(n, spec.epoch) for n in new]
            launched = time.time()
        except Exception as exc:  # noqa: BLE001 - any: the restart path still works
            sys.stderr.write(f"runner: run {run_id}: starting {', '.join(new)} failed ({printable(str(exc))[:200]}); "
                             "restarting every node instead\n")
            return None
        runs = {n: node_paths(self.full.node(n), homes.get(n)).run(run_id) for n in layout.nodes}
        # The file only once every newcomer has imported torch and waits: the running ranks train on
        # through its start-up (a Pi's torch import: a minute) and pause for the switch alone.
        late, ended = wait_ready(cl, {n: runs[n] for n in new}, spec.epoch, {n: len(spec.ranks[n]) for n in new},
                                 {n: container_name(run_id, n) for n in layout.nodes}, set(self.layout.nodes),
                                 news=news)
        if late is not None and ended:  # the running layout ended meanwhile (its last step, or a failure):
            for n in new:               # the watch takes its outcome as it is; the newcomer is stopped
                stop_node(cl[n], run_id, grace=FAIL_STOP_GRACE_S)
            with self._lock:
                self.returned = [n for n in self.returned if n not in back]
                self.back.clear()
            sys.stderr.write(f"runner: run {run_id}: {', '.join(new)} not joined: {late} before it was ready\n")
            return []
        if late is not None:
            sys.stderr.write(f"runner: run {run_id}: {', '.join(new)} not ready to join in place ({late}); "
                             "restarting every node instead\n")
            return None
        text = dumps(spec).encode()
        wrote = time.time()
        errors = [f"{n}: {err}" for n, _, err in cl.map(list(layout.nodes), lambda n: cl[n].put_bytes(
            f"{runs[n]}/{REGROUP_FILE}", text)) if err]
        status = None if errors else wait_resumed(cl, runs, spec, {n: len(spec.ranks[n]) for n in layout.nodes})
        if status is None or isinstance(status, str):
            sys.stderr.write(f"runner: run {run_id}: in-place rejoin epoch {spec.epoch} failed "
                             f"({'; '.join(errors) or status or '?'}); restarting every node instead\n")
            return None
        with self._lock:
            self.returned = [n for n in self.returned if n not in back]
            self.back.clear()
        self.epoch, old, self.layout, self.planned = spec.epoch, self.layout, layout, wrote
        self.note(cl, run_id, in_place_layout(layout, status, part, f"{', '.join(back)} back", spec.epoch, wrote,
                                           begun=begun, launched=launched), homes)
        sys.stderr.write(f"runner: run {run_id}: {', '.join(back)} back: joined in place as {layout.shown} "
                         f"(was pp {old.pp} x dp {old.dp} x tp {old.tp})\n")
        return plans

    def _rejoin_refused(self, back: list[str]) -> str | None:
        """Why the nodes back cannot join the running layout in place (None: they can). The running
        ranks hand the newcomers their stages from the stage replicas, kept only for pp > 1, tp 1."""
        if not back:
            return "no node back"
        if self.layout.pp < 2 or self.layout.tp != 1:
            return (f"the running layout (pp {self.layout.pp}, tp {self.layout.tp}) keeps no stage replicas to "
                    "hand over; in place needs pp > 1 and tp 1")
        return None

    # -- events --------------------------------------------------------------------------------
    def started(self, view: Cluster, run_id: str, homes: dict[str, str | None], checkpoint: str | None,
                split: str | None, synced: float | None = None) -> None:
        """A layout's launch is under way: its event, with the checkpoint it resumes from."""
        step = int(m[1]) if checkpoint and (m := re.match(r"step-(\d+)", checkpoint)) else None
        last = self.pending.get("last_step")
        ev = event("layout", layout=self.layout.as_dict(), from_step=step, split=split,
                   why=self.pending.get("why", "start"),
                   steps_lost=(last - step) if last is not None and step is not None else None,
                   planned=self.planned if self.pending else None, synced=synced)
        self.pending = {}
        self.note(view, run_id, ev, homes)

    def load_history(self, master: Remote, run_dir: str) -> None:
        """The events an earlier `up` of this run wrote (read from the master, bounded, only JSON
        objects kept), so the history of a resumed run goes on rather than starting over."""
        try:
            text = master.read_text(f"{run_dir}/{ELASTIC_FILE}", limit=EVENTS_MAX) or ""
        except UserError as exc:
            log.warning("elastic: %s; the layout history starts again", exc)
            return
        self.events.extend(parse_events(text))
        # The next regroup.json must be newer than the last one the ranks saw (they pass over the rest).
        self.epoch = max([e["epoch"] for e in self.events if type(e.get("epoch")) is int] + [self.epoch])

    def note(self, cl: Cluster, run_id: str, ev: dict, homes: dict[str, str | None] | None = None) -> None:
        """Append the event; write the whole history to the layout's nodes and the logs dir."""
        self.events.append(ev)
        body = "".join(json.dumps(e) + "\n" for e in self.events).encode()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / ELASTIC_FILE).write_bytes(body)
        if homes is None:
            return

        def one(node: str) -> None:
            r = cl[node]
            run = node_paths(r.node, homes.get(node)).run(run_id)
            r.makedirs(run)
            r.put_bytes(f"{run}/{ELASTIC_FILE}", body)

        for node, _, err in cl.map([n for n in self.layout.nodes if n not in self.lost], one):
            if err:
                log.warning("elastic: could not write %s on %s: %s", ELASTIC_FILE, node, err)

    # -- lost nodes coming back ----------------------------------------------------------------
    def _watch(self, cl: Cluster, run_id: str) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._retry, args=(cl, run_id), daemon=True, name="elastic-rejoin")
            self._thread.start()

    def _retry(self, cl: Cluster, run_id: str) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            for node in list(self.lost):
                if not answers(self.full.node(node), timeout=RETRY_S):
                    continue
                try:
                    r = Remote(self.full.node(node), self.accept_new).connect()
                except UserError:
                    continue
                try:
                    gone = stop_node(r, run_id, grace=LOST_STOP_GRACE_S)
                except Exception:  # noqa: BLE001 - the engine not answering yet: next round
                    r.close()
                    continue
                cl.reconnected(node, r)  # in the launch's view and the run's cluster: the next view has it
                sys.stderr.write(f"runner: node {node} is reachable again"
                                 + (": stopped and removed its container" if gone else "") + "\n")
                with self._lock:
                    del self.lost[node]
                    self.events.append(event("back", node=node))
                    if self.spec.rejoin and node not in self.stuck:
                        self.returned.append(node)
                        self.back.set()
            # a knock that went unanswered has waited RETRY_S already; one refused at once waits the rest
            self._stop.wait(max(0.0, RETRY_S - (time.monotonic() - began)))

    def stop_retrying(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def close(self) -> None:
        self.stop_retrying()
        if self.lost:
            shown = ", ".join(f"{n} ({printable(w[:200])})" for n, w in self.lost.items())
            sys.stderr.write(f"runner: warning: still unreachable: {shown}; a container of the run may still run "
                             f"there: `runner down -i {self.full.path}` once it is back\n")


def joiner(launcher, el: ElasticRun, cl: Cluster, probes: dict, run_id: str):
    """`start(node, epoch)` for ElasticRun.rejoin_in_place: the node's container of this run, its trainer
    started as the container's process where the node runs one rank (else a torchrun of its own: one
    node, its own port), which joins regroup epoch `epoch` of the running ranks (ELASTIC_JOIN_EPOCH:
    no group and no weights until then). Returns its NodePlan."""
    def start(node: str, epoch: int):
        sub = sub_inventory(el.full, [node])
        sub.job.args = list(el.inventory().job.args)  # its layout comes from regroup.json: the job's args parse
        port = pick_master_port(cl[node].listening_ports(), f"{run_id}/join/{epoch}")
        saved, launcher.inv = launcher.inv, sub
        try:
            plan = launcher.make_plan({node: probes[node]}, run_id, False, port, direct=True)  # one rank: no torchrun
        finally:
            launcher.inv = saved
        np = plan.nodes[0]
        np.env["ELASTIC_JOIN_EPOCH"] = str(epoch)
        # every node of the job in its /etc/hosts, not only its own: it meets the running ranks' store
        np.hosts = hosts_of(el.full.ordered(), {n: p.facts() for n, p in probes.items()})
        launcher.stage_files(cl, plan)
        create_container(cl[node], np).start()
        return np
    return start


def in_place_layout(layout, status: dict, split: str, why: str, epoch: int, planned: float, **times: float) -> dict:
    """The `layout` event of an in-place switch: from the earliest step a rank resumed at, the file's
    time (`planned`), the last rank's `resumed` and, for a rejoin, when the runner `begun` it and had
    `launched` the newcomers' containers (bench/elastic.py reads them)."""
    steps = [s.get("step") for s in status.values() if isinstance(s.get("step"), int)]
    return event("layout", layout=layout.as_dict(), from_step=min(steps) if steps else None, split=split, why=why,
                 in_place=True, epoch=epoch, planned=planned,
                 resumed=max(float(s["times"].get("resumed", 0)) for s in status.values()), **times)


def last_step(view: Cluster, nodes: list, probes: dict, run_id: str) -> int | None:
    """The newest step in the nodes' metrics.jsonl (the logging rank's node has it), or None."""
    from runner.backends.ssh.node_runs import node_progress

    def one(n) -> int | None:
        got = node_progress(view[n.name], node_paths(n, probes[n.name].home).run(run_id))[0]
        step = json.loads(got).get("step") if got else None
        return step if isinstance(step, int) else None

    steps = [v for _, v, err in view.map(nodes, one) if err is None and v is not None]
    return max(steps) if steps else None


def layout_split(inv: Inventory) -> str | None:
    """The partition spec the launch passes (the last --parallel.partition of the job's args)."""
    args = inv.job.args
    idx = [i for i, a in enumerate(args) if a == "--parallel.partition" and i + 1 < len(args)]
    return args[idx[-1] + 1] if idx else None
