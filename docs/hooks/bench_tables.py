"""MkDocs hook: the performance page's tables, rendered from `bench/results/*.json` when the site
is built, so a figure is typed once (by the benchmark that measured it) and never copied by hand.

A page asks for a table with a marker on a line of its own, `<!-- bench:NAME -->` or
`<!-- bench:NAME FILE.json -->`; NAME is a key of TABLES. A missing result file, an unknown NAME or
a field a table needs that the file lacks stops the build (mkdocs reports the hook's exception), so
a renamed benchmark field cannot leave a stale number on the site. The targets are the project's
goals, not measurements: they live here, beside the rows they judge.

`render(markdown)` is the whole transformation; tests call it without mkdocs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
MARK = re.compile(r"^<!-- bench:([\w-]+)(?: ([\w.-]+))? -->$", re.M)


class Results:
    """The result files, read once each."""

    def __init__(self, root: Path = RESULTS):
        self.root = root
        self._cache: dict[str, dict] = {}

    def __call__(self, name: str) -> dict:
        if name not in self._cache:
            path = self.root / name
            if not path.is_file():
                raise FileNotFoundError(f"bench table needs {path}: run its benchmark (python -m bench)")
            self._cache[name] = json.loads(path.read_text())
        return self._cache[name]


# --- formatting ---------------------------------------------------------------------------

def num(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def secs(x: float) -> str:
    return f"{x:.2f} s" if x < 10 else f"{x:.1f} s"


def ratio(x: float) -> str:
    return f"{x:.2f}x"


def pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def mib(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"


def kilo(x: float) -> str:
    return f"{x / 1000:.1f}K"


def met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def source(*files: str, command: str | None = None) -> str:
    where = ", ".join(f"`bench/results/{f}`" for f in files)
    return f"\n\nFrom {where}" + (f" (`{command}`)." if command else ".")


# --- CPU: the trainer ---------------------------------------------------------------------

def trainer_cpu(r: Results, _arg: str | None) -> str:
    tt = r("trainer_throughput.json")
    ours, plain = tt["results"]["trainer"], tt["results"]["plain transformers loop"]
    speed = ours["tokens_per_s"] / plain["tokens_per_s"]
    rows = [[f"trainer tokens/s, {tt['preset']}, {tt['batch_size']}x{tt['seq_len']}, {tt['threads']} threads",
             f"{num(ours['tokens_per_s'])} tok/s, MFU {pct(ours['mfu_vs_matmul_peak'])}",
             f"plain transformers loop {num(plain['tokens_per_s'])} tok/s, {pct(plain['mfu_vs_matmul_peak'])}",
             ratio(speed), f">= 1.0x, {met(speed >= 1.0)}"]]

    lm = r("lm_loss.json")
    res = lm["results"]
    mine, full, rec = res["chunks, head gradient in forward"], res["full logits"], res["chunks, recomputed"]
    s_full, s_rec = full["time_s"] / mine["time_s"], rec["time_s"] / mine["time_s"]
    m_full, m_rec = mine["peak_bytes"] / full["peak_bytes"], mine["peak_bytes"] / rec["peak_bytes"]
    rows.append([
        f"LM head + loss, forward + backward, {num(lm['tokens'])} tokens x hidden {lm['hidden']} -> vocab "
        f"{num(lm['vocab'])}, {lm['chunks']} chunks, {lm['dtype'].removeprefix('torch.')}, {lm['threads']} threads",
        f"head gradients in the forward: {secs(mine['time_s'])}, {mib(mine['peak_bytes'])} peak",
        f"full logits (transformers' loss) {secs(full['time_s'])}, {mib(full['peak_bytes'])}; chunks recomputed in "
        f"backward {secs(rec['time_s'])}, {mib(rec['peak_bytes'])}",
        f"{ratio(s_full)} / {ratio(s_rec)} speed, {ratio(m_full)} / {ratio(m_rec)} memory",
        f"within 5% of full logits' speed at half its memory, {met(s_full >= 0.95 and m_full <= 0.5)}"])

    op = r("optimizer_step.json")
    res = op["results"]
    mw, cf, pl = res["MasterAdamW"], res["cast + fused AdamW"], res["plain loop"]
    rows.append([
        f"optimizer phase of a bf16 step (clip, AdamW, the next forward's bf16 weights), {op['preset']}'s "
        f"{op['params'] / 1e6:.1f} M parameters, {op['device']}",
        f"`MasterAdamW` compiled: {mw['time_s'] * 1000:.1f} ms, {mw['bytes_per_param']} bytes/param",
        f"cast + torch's fused AdamW: {cf['time_s'] * 1000:.1f} ms, {cf['bytes_per_param']} bytes/param; the plain "
        f"loop's clip + fused AdamW + autocast casts: {pl['time_s'] * 1000:.1f} ms",
        ratio(cf["time_s"] / mw["time_s"]),
        "none on a CPU (an eager run keeps the fused kernel); the phase is memory-bound on a GPU"])
    return (table(["benchmark", "ours", "what a user would pick instead", "ratio", "target"], rows)
            + source("trainer_throughput.json", "lm_loss.json", "optimizer_step.json",
                     command="python -m bench trainer_throughput lm_loss optimizer_step"))


def pipeline(r: Results, _arg: str | None) -> str:
    ps = r("pipeline_schedules.json")
    cfg = ps["config"]
    rows = []
    for s in ps["schedules"]:
        name = s["schedule"] + (f" (v={s['virtual_stages']})" if s["virtual_stages"] > 1 else "")
        x = s["bubble_measured"] / s["bubble_theory"]
        saved = " / ".join(f"{m:,.0f}" for m in s["peak_saved_mb_per_rank"])
        rows.append([name, str(s["microbatches"]), f"{s['step_time_s']:.3f}", pct(s["bubble_measured"]),
                     pct(s["bubble_theory"]), ratio(x), f"<= 1.25x, {met(x <= 1.25)}", saved])
    sched = table(["schedule", "m", "step time (s)", "bubble, bottleneck stage", "theory (p-1)/(m+p-1)",
                   "x theory", "target", "peak saved activations per rank (MB)"], rows)
    one = ps["layouts"][0]
    lrows = [[lay["layout"], num(lay["tokens_per_s"]), ratio(lay["tokens_per_s"] / one["tokens_per_s"])]
             for lay in ps["layouts"]]
    lay = table(["layout (same global batch)", "tokens/s", f"relative to {one['layout']}"], lrows)
    m8 = {s["schedule"]: s for s in ps["schedules"] if s["microbatches"] == 8 and s["virtual_stages"] == 1}
    g, f = m8["gpipe"]["peak_saved_mb_per_rank"][0], m8["1f1b"]["peak_saved_mb_per_rank"][0]
    return (f"Model {cfg['preset']}, global batch {cfg['batch']} x {cfg['seq']} tokens, pp=2, {cfg['steps']} timed "
            "steps (median), 2 processes, gloo.\n\n" + sched + "\n\n" +
            f"Saved activations on stage 0 at m=8: 1F1B {f:,.0f} MB against GPipe's {g:,.0f} MB "
            f"({ratio(f / g)}; target 1F1B < GPipe, {met(f < g)}).\n\n" + lay +
            "\n\n(Two cores: no layout can speed up here; the table shows what each costs.)" +
            source("pipeline_schedules.json", command="python -m bench pipeline_schedules"))


# --- the runner ---------------------------------------------------------------------------

def launch(r: Results, _arg: str | None) -> str:
    la = r("launch.json")
    rows = [[str(x["nodes"]), secs(x["runner_s"]), secs(x["runner_nogate_s"]), secs(x["naive_s"]),
             ratio(x["runner_vs_1_node"]), ratio(x["naive_vs_1_node"])] for x in la["rows"]]
    return (table(["nodes", "`runner up`", "without the gate", "naive ssh + docker run script",
                   "runner vs 1 node", "naive vs 1 node"], rows)
            + f"\n\nSeconds {la['what'].removeprefix('seconds ')}." + source("launch.json", command="python -m bench launch"))


def runner(r: Results, _arg: str | None) -> str:
    rows = []
    la = {x["nodes"]: x for x in r("launch.json")["rows"]}
    x3, x1 = la[3], la[1]
    rows.append(["`runner up` until every rank runs, 3 nodes vs 1",
                 f"{secs(x3['runner_s'])} vs {secs(x1['runner_s'])}",
                 f"naive ssh + docker run script {secs(x3['naive_s'])} vs {secs(x1['naive_s'])}",
                 f"{ratio(x3['runner_vs_1_node'])} (naive {ratio(x3['naive_vs_1_node'])})",
                 f"<= 1.3x, {met(x3['runner_vs_1_node'] <= 1.3)}"])

    pr = r("push_relay.json")
    rel, direct, naive, floor = pr["relay"], pr["direct"], pr["naive"], pr["floor"]
    up = sorted({round(v["uplink_mb"]) for v in rel.values()})
    rows.append([
        f"first push of the {num(pr['image_mb'])} MB image over `--uplink {pr['config']['uplink']} --link "
        f"{pr['config']['link']}` (namespaced nodes), relay to 3 / 6 nodes vs 1",
        f"{secs(rel['3']['s'])} / {secs(rel['6']['s'])} vs {secs(rel['1']['s'])}; this machine's uplink carried "
        f"{up[0]}-{up[-1]} MB for any node count",
        f"plain parallel push (`--direct`) {secs(direct['3']['s'])} / {secs(direct['6']['s'])}, "
        f"{num(direct['3']['uplink_mb'])} / {num(direct['6']['uplink_mb'])} MB; naive sequential `docker save | ssh "
        f"docker load` to 3 nodes {secs(naive['3']['s'])}, {num(naive['3']['uplink_mb'])} MB",
        f"{ratio(rel['3']['x_one_node'])} / {ratio(rel['6']['x_one_node'])} (parallel "
        f"{ratio(direct['3']['x_one_node'])} / {ratio(direct['6']['x_one_node'])}, naive "
        f"{ratio(naive['3']['x_one_node'])})",
        f"<= 1.3x, {met(rel['6']['x_one_node'] <= 1.3)}; the loads alone, no network: "
        f"{secs(floor['1']['s'])} / {secs(floor['3']['s'])} / {secs(floor['6']['s'])} for 1 / 3 / 6 nodes"])

    pc = r("push_compress.json")
    for link, v in pc["links"].items():
        auto, on, off = v["auto"], v["true"], v["false"]
        worse = max(on["s"], off["s"])
        rows.append([
            f"first push of the {num(pc['image_mb'])} MB image to one namespaced node, `compress: auto` at "
            f"`--link {link}`",
            f"{secs(auto['s'])}, {num(auto['uplink_mb'])} MB (`{auto['decision']}`)",
            f"always `ssh -C`: {secs(on['s'])}; never: {secs(off['s'])}",
            f"{ratio(worse / auto['s'])} faster than the worse fixed choice; {ratio(auto['x_best_fixed'])} the better one",
            f"within 1.1x of the better fixed choice, {met(auto['x_best_fixed'] <= 1.1)}"])

    pu = r("push.json")
    rp, nr = pu["repush_code_change_3_nodes"], pu["naive_repush_3_nodes"]
    rows.append(["re-push after a code change, 3 nodes",
                 f"{rp['mb']:.2f} MB per node, {secs(rp['s'])}",
                 f"naive re-sends {num(nr['mb'] / 3)} MB per node, {secs(nr['s'])}",
                 f"{rp['pct_of_image_per_node']:.2f}% of the image",
                 f"<= 5%, {met(rp['pct_of_image_per_node'] <= 5)}"])

    co = r("collect.json")
    c = co["rows"]
    ru, sc, rs = c["runner"], c["scp"], c["rsync"]
    rows.append([
        f"collect {co['nodes']} nodes x {co['mb_per_node']} MB ({co['files_per_node']} files each), first / repeat / "
        "after appends",
        f"{secs(ru['first']['s'])} / {secs(ru['repeat']['s'])}, {ru['repeat']['mb']:.0f} bytes / "
        f"{secs(ru['after_append']['s'])}, {ru['after_append']['files']} files",
        f"`scp -r` {secs(sc['first']['s'])} each time ({sc['first']['mb']:.0f} MB); rsync {secs(rs['first']['s'])} / "
        f"{secs(rs['repeat']['s'])} / {secs(rs['after_append']['s'])}",
        f"a repeat moves {ru['repeat_pct_of_first']:.0f}% of the first",
        f"<= 1%, {met(ru['repeat_pct_of_first'] <= 1)}"])

    fo = r("fanout.json")
    dr, db = fo["dry_run"]["runner"], fo["dry_run"]["baseline"]
    rows.append(["`runner up --dry-run`, generated inventory of 1,000 / 10,000 nodes",
                 f"{secs(dr['1000_s'])} / {secs(dr['10000_s'])}",
                 f"the runner before its fan-out work: {secs(db['1000_s'])} / {secs(db['10000_s'])}",
                 f"10,000 = {ratio(dr['ratio_10000_to_1000'])} 1,000",
                 f"<= 10x and 1,000 < 0.5 s, {met(dr['ratio_10000_to_1000'] <= 10 and dr['1000_s'] < 0.5)}"])
    n = fo["nodes"]
    for verb in ("check", "status"):
        a, b = fo["check_status"]["runner"][verb], fo["check_status"]["baseline"][verb]
        rows.append([f"`runner {verb}`, {n} light sandbox nodes vs 1",
                     f"{secs(a[f'{n}_s'])} vs {secs(a['1_s'])}; the runner's own CPU {secs(a[f'runner_cpu_{n}_s'])} vs "
                     f"{secs(a['runner_cpu_1_s'])}",
                     f"before: {secs(b[f'{n}_s'])} vs {secs(b['1_s'])}",
                     f"{ratio(a['ratio'])} wall, {ratio(a['runner_cpu_ratio'])} runner CPU",
                     f"<= 2x, {met(a['ratio'] <= 2)} (wall)"])
    w, wb = fo["watch"]["runner"], fo["watch"]["baseline"]
    rows.append([f"`runner up` watching {n} nodes: threads / open files",
                 f"{w[str(n)]['threads']} / {w[str(n)]['fds']} ({w['threads_per_node']:.1f} / {w['fds_per_node']:.1f} per node)",
                 f"before: {wb[str(n)]['threads']} / {wb[str(n)]['fds']} ({wb['threads_per_node']:.1f} / "
                 f"{wb['fds_per_node']:.1f} per node)",
                 f"{ratio(w['threads_per_node'] / wb['threads_per_node'])} / {ratio(w['fds_per_node'] / wb['fds_per_node'])} "
                 "per node", "reported"])

    pa = r("partition.json")
    sb = pa["sandbox"]
    st = sb["step_s"]
    rows.append([
        f"`parallel.partition auto`: 3 sandbox nodes at {sb['nodes_cpus'].replace(',', ' / ')} CPU, reduced Pi model "
        f"at {sb['layers']} layers, pp=3, 1F1B, step time",
        f"auto `{sb['auto_split']}` {secs(st['auto'])}",
        f"`uniform` (`{sb['uniform_split']}`) {secs(st['uniform'])}; best of all {len(sb['sweep_s'])} contiguous "
        f"splits, each run (`{sb['best_split']}`) {secs(st['best'])}",
        f"{ratio(sb['auto_speedup_vs_uniform'])} uniform; {pct(sb['auto_vs_best'] - 1)} slower than the best",
        f">= 1.3x uniform and within 10% of the best, "
        f"{met(sb['auto_speedup_vs_uniform'] >= 1.3 and sb['auto_vs_best'] <= 1.1)}"])
    q = pa["qwen3_0.6b"]
    rows.append([
        "Qwen3-0.6B (28 layers) on a Pi 4 + Pi 5 + laptop, planned from a kept profile (predicted step)",
        f"auto `{q['auto']}` {secs(q['auto_step_s'])}",
        f"uniform `{q['uniform']}` {secs(q['uniform_step_s'])}; the Pi guide's hand split `{q['guide']}` "
        f"{secs(q['guide_step_s'])}",
        f"{ratio(q['uniform_step_s'] / q['auto_step_s'])} uniform, {ratio(q['guide_step_s'] / q['auto_step_s'])} the "
        "hand split", "printed (no Pi in the test machines)"])

    li = r("links.json")
    stops = li["partition_stop_s"]
    rows.append([
        "a node's link cut mid-run (`sandbox --netns`, `sandbox link node-2 down`), until the other nodes have stopped",
        " / ".join(secs(s) for s in stops) + f" (`runner up` watching, {len(stops)} cuts)",
        "the same run started without a watcher (`up --detach`, a hand-started torchrun): still running 30 s after "
        "the cut", "stopped vs not", f"<= 10 s, {met(max(stops) <= 10)}"])

    el = r("elastic.json")
    sh, rj = el["median"]["shrink"], el["median"]["rejoin"]
    rows.append([
        f"elastic run (`job.elastic`): {el['machine']}; node-2's link cut until the first step on 2 nodes, link back "
        f"until the first step on all 3 (median of {el['repeat']})",
        f"{secs(sh['cut_to_step_s'])} = detect {sh['detect_s']:.1f} + stop {sh['stop_s']:.1f} + re-plan "
        f"{sh['replan_s']:.1f} + file exchange {sh['exchange_s']:.1f} + restart {sh['restart_s']:.1f}; back: "
        f"{secs(rj['back_to_step_s'])} = reach {rj['reach_s']:.1f} + stop with preempt checkpoint {rj['stop_s']:.1f} + "
        f"exchange {rj['exchange_s']:.1f} + restart {rj['restart_s']:.1f}",
        "without elasticity the run stops and waits for a person: inventory edit, re-split, `up --resume`",
        "unattended vs by hand", f"cut to first step <= 60 s, {met(sh['cut_to_step_s'] <= 60)}"])
    if "in_place" in el:  # issue 58: the same cut, the survivors regrouped in their own processes
        ip = el["in_place"]["median"]
        rows.append([
            f"the same with `--elastic.in_place true`: the survivors regroup in their processes, stages from "
            f"memory (median of {el['in_place']['repeat']})",
            f"{secs(ip['cut_to_step_s'])} = detect {ip['detect_s']:.1f} + file {ip['file_s']:.1f} + regroup "
            f"{ip['regroup_s']:.1f} + first step {ip['first_step_s']:.1f}; {ip['steps_redone']:.0f} step(s) redone; "
            f"replicas {ip['replica_cost_pct']:.1f}% of a step",
            f"the restart path above: {secs(sh['cut_to_step_s'])}", ratio(sh["cut_to_step_s"] / ip["cut_to_step_s"]),
            f"<= 15 s, <= 1 step redone, replicas < 3%: {met(ip['cut_to_step_s'] <= 15 and ip['steps_redone'] <= 1 and ip['replica_cost_pct'] < 3)}"])
        jn = el["in_place"].get("rejoin") or {}
        if jn.get("median"):  # node-2 back, joined to the running ranks in place
            g = jn["median"]
            rows.append([
                f"node-2's link back, `--elastic.in_place true`: one container started, its stage from the running "
                f"ranks, the switch at a step boundary (joined in place in {jn['joined']} runs)",
                (f"{secs(g['back_to_step_s'])} = reach {g['reach_s']:.1f} + container up and `ready` "
                 f"{g['ready_s']:.1f} (the others training; of it the runner's launch {g['launch_s']:.1f}, imports "
                 f"{g['imports_s']:.1f}) + file {g['file_s']:.1f} + regroup {g['regroup_s']:.1f} + "
                 f"first step {g['first_step_s']:.1f}; the running ranks paused {g['pause_s']:.1f} s"
                 if "imports_s" in g else
                 f"{secs(g['back_to_step_s'])} = reach {g['reach_s']:.1f} + container up and `ready` "
                 f"{g['ready_s']:.1f} (the others training) + file {g['file_s']:.1f} + regroup {g['regroup_s']:.1f} + "
                 f"first step {g['first_step_s']:.1f}; the running ranks paused {g['pause_s']:.1f} s"
                 if "ready_s" in g else
                 f"{secs(g['back_to_step_s'])} = reach {g['reach_s']:.1f} + container started {g['start_s']:.1f} + "
                 f"regroup {g['regroup_s']:.1f} + first step {g['first_step_s']:.1f}"),
                f"the restart path's rejoin above: {secs(rj['back_to_step_s'])}",
                ratio(rj["back_to_step_s"] / g["back_to_step_s"]), f"<= 15 s: {met(g['back_to_step_s'] <= 15)}"])

    pi = li["pi_experiment"]
    fast, slow = pi["1gbit"], pi["100mbit"]

    def waits(x: dict) -> str:
        return " / ".join(f"{w:.0f}" for w in x["comm_wait_ms_per_stage"])

    rows.append([
        "reduced Pi experiment (3-stage 1F1B, 3 namespaced nodes) at `--link 1gbit` vs `--link 100mbit`",
        f"step {fast['step_time_s_median']:.3f} s, measured bubble {fast['measured_bubble']:.2f}, comm wait "
        f"{waits(fast)} ms per stage",
        f"100mbit: {slow['step_time_s_median']:.3f} s, bubble {slow['measured_bubble']:.2f}, {waits(slow)} ms (theory "
        f"{fast['theoretical_bubble']:.2f} both)",
        f"{ratio(slow['step_time_s_median'] / fast['step_time_s_median'])} slower at 100mbit", "reported"])
    return (table(["benchmark", "ours", "what a user would pick instead", "ratio", "target"], rows)
            + source("launch.json", "push_relay.json", "push_compress.json", "push.json", "collect.json",
                     "fanout.json", "partition.json", "links.json", "elastic.json",
                     command="python -m bench NAME"))


def startup(r: Results, _arg: str | None) -> str:
    """`runner --version`, `--help` and dry-runs from exec to exit, now and before, against the
    targets; then the tools alongside (the interpreter, git-class CLIs, other launchers')."""
    s = r("startup.json")
    rows, targets, heavy = s["rows"], s["targets"], s["heavy_imports"]

    def cell(name: str) -> str:  # milliseconds: git's 2 ms and SkyPilot's seconds in one column
        v = rows[name]
        return f"{v['median_s'] * 1000:,.0f} ms (min {v['min_s'] * 1000:,.0f} ms)"

    ours = [k for k in rows if k.startswith("runner ")]
    out = []
    for k in ours:
        before = f"before: {k}"
        target = targets.get(k)
        out.append([f"`{k}`", cell(k), cell(before) if before in rows else "-",
                    ", ".join(heavy.get(k, [])) or "none", ", ".join(heavy.get(before, [])) or "-",
                    f"median <= {target * 1000:.0f} ms, {met(rows[k]['median_s'] <= target)}" if target else "reported"])
    main = table(["command", "now: median (min)", "before", "heavy imports now", "before", "target"], out)
    others = [[f"`{k}`", cell(k)] for k in rows if not k.startswith(("runner ", "before: "))]
    versions = ", ".join(f"{k} {v}" for k, v in (s.get("versions") or {}).items())
    return (main + "\n\nAlongside, in the same rounds" + (f" ({versions}, each in a throwaway venv)" if versions else "")
            + ":\n\n" + table(["command", "median (min)"], others)
            + (f"\n\nBefore: {s['baseline']}." if s.get("baseline") else "")
            + f"\n\n{s['repeats']} rounds, every row once a round, on {s['cpus']} cores (load {s['load_at_start']} at the "
            f"start, {s['load_at_end']} at the end); Python {s['python']}."
            + source("startup.json", command="python -m bench startup --baseline DIR --torchx BIN --sky BIN"))


# --- GPU ----------------------------------------------------------------------------------

def gpu_throughput(r: Results, arg: str | None) -> str:
    name = arg or "gpu_throughput.json"
    g = r(name)
    rows = []
    for x in g["rows"]:
        if x.get("status") != "ok":
            rows.append([x["preset"], str(x["batch"]), x["name"], x.get("status", "?"), "", "", ""])
            continue
        rows.append([x["preset"], str(x["batch"]), x["name"],
                     f"{kilo(x['tokens_per_s'])} (spread {pct(x['spread'])})", pct(x["mfu"]),
                     f"{x['peak_memory_gib']:.1f} GiB", f"{x['graphs']} / {x['graph_breaks']}"])
    out = (f"{g['device']}, torch {g['torch']} (CUDA {g['cuda']}), transformers {g['transformers']}, seq "
           f"{g['seq_len']}, {g['dtype']}, median of {g['reps']} windows of {g['steps_per_window']} steps.\n\n"
           + table(["preset", "batch", "row", "tokens/s", "MFU", "peak allocated", "dynamo graphs / breaks"], rows))
    targets = g.get("targets") or {}
    trows = []
    for preset, t in targets.items():
        if "speed_vs_compiled" in t:
            trows.append([preset, f"vs {t['baseline']}", ratio(t["speed_vs_compiled"]) + f" ({met(t['speed_met'])})",
                          ratio(t["memory_vs_compiled"]) + f" ({met(t['memory_met'])})"])
        elif "mfu" in t:
            trows.append([preset, f"{t['row']}, batch {t['batch']}", f"MFU {pct(t['mfu'])} ({met(t['met'])})", ""])
    if trows:
        out += ("\n\n" + table(["preset", "against", "speed (target >= 1.10x; MFU >= 50%)",
                                "memory (target <= 0.8x; 1.0x for smollm-1.7b)"], trows))
    agree = g.get("loss_agreement") or {}
    if agree:
        out += "\n\nLoss at a common step, largest relative deviation between the rows of a preset: " + ", ".join(
            f"{p} {a['max_rel_dev']:.1e} (step {a['step']}, {a['rows']} rows)" for p, a in agree.items()) + "."
    skipped = [x for x in g.get("not_run") or []]
    if skipped:
        out += f"\n\n{len(skipped)} planned rows did not fit the session's time budget and were not run."
    return out + source(name)


def gpu_lm_loss(r: Results, _arg: str | None) -> str:
    rows = []
    files = sorted(p.name for p in r.root.glob("lm_loss-cuda-*.json"))
    for f in files:
        lm = r(f)
        res = lm["results"]
        full, rec, mine = res["full logits"], res["chunks, recomputed"], res["chunks, head gradient in forward"]

        def cell(x: dict) -> str:
            return f"{x['time_s'] * 1000:.1f} ms, {x['peak_bytes'] / 2**30:.2f} GiB"

        rows.append([f"{num(lm['tokens'])} tokens x {num(lm['hidden'])} -> {num(lm['vocab'])}, {lm['chunks']} chunks",
                     cell(full), cell(rec), cell(mine) + f" ({ratio(rec['time_s'] / mine['time_s'])} the recomputing "
                     "chunks)"])
    device = r(files[0])["device"] if files else "no CUDA run"
    return (f"{device}, bf16, inductor, forward + backward, median of 5.\n\n"
            + table(["shape", "full logits", "chunks recomputed in backward", "head gradients in the forward "
                     "(the trainer's default)"], rows) + source(*files, command="python bench/lm_loss.py --device cuda"))


def gpu_families(r: Results, _arg: str | None) -> str:
    g = r("gpu_families.json")
    rows = []
    for x in g["rows"]:
        shape = f"{x['batch']} x {x['seq']} tok" if x.get("seq") else f"{x['batch']} images"
        rows.append([x["preset"], shape, f"{x['samples_per_s']:.1f}", f"{x['step_time_s'] * 1000:.1f}",
                     pct(x["mfu"]), f"{x['peak_memory_gib']:.2f} GiB",
                     f"{x['estimate_gib']:.2f} GiB ({x['estimate_vs_peak']:.2f})"])
    return (f"{g['device']}, torch {g['torch']}, transformers {g['transformers']}, bf16, compile "
            f"{'on' if g['compile'] else 'off'}.\n\n"
            + table(["preset", "batch", "samples/s", "ms/step", "MFU", "peak", "`--dry-run` estimate (/ peak)"], rows)
            + source("gpu_families.json", command="PYTHONPATH=. python3 bench/gpu_families.py --out DIR"))


# --- DiLoCo over slow links ---------------------------------------------------------------

DILOCO_NAMES = {"ddp": "DDP (all-reduce every step)", "diloco_h20_fp32": "DiLoCo H=20, fp32",
                "diloco_h20_int8": "DiLoCo H=20, int8", "diloco_h50_fp32": "DiLoCo H=50, fp32",
                "diloco_h50_int8": "DiLoCo H=50, int8"}


def diloco(r: Results, _arg: str | None) -> str:
    d = r("diloco.json")
    s, ddp = d["setup"], d["runs"]["ddp"]
    rows = []
    for name, x in d["runs"].items():
        reached = x["reached_step"] is not None
        rows.append([DILOCO_NAMES.get(name, name),
                     str(x["reached_step"]) if reached else f"not in {x['steps']} steps",
                     secs(x["reached_s"]) if reached else "-",
                     ratio(ddp["reached_s"] / x["reached_s"]) if reached else "-",
                     f"{x['reached_bytes'] / 1e6:,.2f} MB" if reached else "-",
                     f"{x['final_loss10']:.3f} at step {x['steps']}, {secs(x['wall_s'])}",
                     f"{x['ddp_loss10_at_end']:.3f} (step {x['ddp_step_at_end']})",
                     f"{x['bytes_total'] / 1e6:,.2f} MB, {secs(x['sync_s_total'])}"])
    intro = (f"dp {s['nodes']} of {s['model']} over {s['link']} links ({s['where']}; {s['machine']}). Target: "
             f"DDP's mean loss over its last {s['loss_window']} steps at step {s['ddp_steps']}, "
             f"{d['target_loss10']:.3f}, reached in {secs(d['ddp_wall_s'])}. Losses are {s['loss_window']}-step "
             f"means. Bytes: what each rank handed to its data-parallel collectives (`dp_sync_bytes`); sync time: "
             f"`dp_sync_s`. DiLoCo outer {s['outer']}.\n\n")
    return (intro + table(["run", "reaches the target at step", "wall time", "speed-up", "bytes per rank there",
                           "loss at its end", "DDP's loss at the same wall time", "whole run: bytes, sync time"],
                          rows)
            + source("diloco.json", command="flock /tmp/heavy-tests.lock python -m bench.diloco"))


def heartbeat(r: Results, _arg: str | None) -> str:
    """The progress heartbeat's cost per step (bench/heartbeat.py), on and off inside each run."""
    hb = r("heartbeat.json")
    target, p = hb["target"], hb["parts"]
    rows = []
    for job, x in hb["results"].items():
        what = (f"{job}: {x['nproc']} process(es), {' '.join(x['args'])}, {x['marks_per_step']:.0f} marks a step")
        each = ", ".join(f"{100 * o:+.2f}%" for o in x["overheads"])
        # paired: each on block against its two off neighbours (bench/heartbeat.py `paired`); the
        # target is judged on the larger of it and the runs' median (they disagree on a loaded machine)
        measured = max(x.get("overhead_paired", x["overhead"]), x["overhead"])
        pairs = (f"{100 * x['overhead_paired']:+.2f}% (quartiles {100 * x['paired_quartiles'][0]:+.2f}%.."
                 f"{100 * x['paired_quartiles'][2]:+.2f}%, {x['pairs']} block pairs)" if "pairs" in x else "")
        rows.append([what, f"{x['step_off_s'] * 1e3:.2f} ms", f"{x['step_on_s'] * 1e3:.2f} ms", pairs or "-",
                     f"{100 * x['overhead']:+.2f}% (runs: {each})", pct(x["overhead_by_parts"], 3),
                     f"< {pct(target, 0)}, {met(measured < target and x['overhead_by_parts'] < target)}"])
    return (table(["job", "step, heartbeat off", "step, on", "measured, paired blocks", "median of runs",
                   "by its parts", "target"], rows)
            + f"\n\nOn and off every {hb['block']} steps inside each run ({hb['reps']} runs of {hb['steps']} steps, "
            f"median loop iteration after {hb['warmup']}), the file written every {hb['heartbeat_s']:g} s. "
            f"The parts: one mark {p['mark_ns']:.0f} ns ({p['mark_off_ns']:.0f} ns with no heartbeat), one "
            f"write of the file {p['write_us']:.0f} us, on {hb['cores']} cores (load {hb['load_avg'][0]:.1f})."
            + source("heartbeat.json", command="python -m bench heartbeat"))


TABLES: dict[str, Callable[[Results, str | None], str]] = {
    "trainer_cpu": trainer_cpu, "pipeline": pipeline, "launch": launch, "runner": runner,
    "gpu_throughput": gpu_throughput, "gpu_lm_loss": gpu_lm_loss, "gpu_families": gpu_families, "diloco": diloco,
    "startup": startup, "heartbeat": heartbeat,
}


def render(markdown: str, results: Results | None = None) -> str:
    """markdown with every bench marker replaced by its table."""
    res = results or Results()

    def one(m: re.Match) -> str:
        if m[1] not in TABLES:
            raise ValueError(f"<!-- bench:{m[1]} -->: no such table (known: {', '.join(sorted(TABLES))})")
        return TABLES[m[1]](res, m[2])

    return MARK.sub(one, markdown)


def on_page_markdown(markdown: str, **_kwargs) -> str:
    """MkDocs hook: fill the bench tables of any page that has markers."""
    return render(markdown) if "<!-- bench:" in markdown else markdown

