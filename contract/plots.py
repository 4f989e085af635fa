"""The plots of a run, drawn from the contract's files: the pipeline Gantt chart of a timeline and the
loss / tokens-per-second curves of metrics.jsonl. Matplotlib with the Agg backend: no display
needed. `trainer plot` and `runner collect` both draw with these.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from contract import bounded_json

COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "backward_input": "#C44E52", "backward_weight": "#8172B3",
          "send_F": "#9fb8d8", "recv_F": "#9fb8d8", "send_B": "#f2c6a4", "recv_B": "#f2c6a4", "send": "#cccccc",
          "recv": "#cccccc", "dp_reduce": "#1B7837", "grad_norm": "#55A868", "optimizer": "#937860",
          "batch_input": "#8C8C8C"}
COMPUTE = ("forward", "backward", "backward_input", "backward_weight")
LEGEND = {"forward": "forward", "backward": "backward", "backward_input": "backward (input)",
          "backward_weight": "backward (weight)", "recv_F": "wait: activation send/recv",
          "recv_B": "wait: gradient send/recv", "dp_reduce": "DP gradient reduction", "grad_norm": "grad norm",
          "optimizer": "optimizer step", "batch_input": "batch input"}
# A Gantt chart's bounds. Its timeline is a file a job wrote, plotted on the user's machine by
# `runner collect` and `trainer plot`: the figure is 0.8 inch (88 pixels) tall per row, and before
# these bounds 4,000 distinct pids in a 0.24 MiB trace took 48 s and 3.9 GB to draw.
MAX_ROWS = 512        # one row per rank; a real pipeline has at most a few hundred. 512 rows: 45,000 px tall
                      # (~240 MB of image); past ~740 Agg refuses the figure anyway (65,536 px at most)
MAX_BARS = 50_000     # "X" slices drawn: a real batch has ranks x microbatches x ~6 (256 x 32 x 6 = 49,152 at
                      # most; a few thousand usually). Drawing is ~2 ms and ~20 KB a slice: 50,000 took 105 s, 1 GB
MAX_NAME = 100        # characters of a row's name kept (a real one: node/rankR/stageS, tens)
MAX_TITLE = 200       # characters of the title kept (a real one: ~100); both fit the figure's 12 inches


def keep_font_cache(environ: MutableMapping[str, str] | None = None) -> None:
    """Matplotlib keeps its font cache under ~/.config and ~/.cache; where those cannot be written
    (HOME is / or read-only, as for a container run as another uid) it makes a new temporary dir
    in every process, rebuilds the cache there (seconds) and prints two warnings each time. One
    dir of this user's under the temp dir (0700, owned by them) keeps a cache for every run."""
    import os
    import sys
    import tempfile

    env: MutableMapping[str, str] = os.environ if environ is None else environ
    if env.get("MPLCONFIGDIR") or "matplotlib" in sys.modules:
        return
    home = Path(env.get("HOME") or "/")
    for base in (env.get("XDG_CONFIG_HOME") or home / ".config", env.get("XDG_CACHE_HOME") or home / ".cache"):
        d = Path(base) / "matplotlib"
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            break
        if not os.access(d, os.W_OK):
            break
    else:
        return
    kept = Path(env.get("TMPDIR") or tempfile.gettempdir()) / f"matplotlib-{os.getuid()}"
    try:
        kept.mkdir(mode=0o700, exist_ok=True)
        st = kept.lstat()
    except OSError:
        return
    if st.st_uid == os.getuid() and st.st_mode & 0o077 == 0 and kept.is_dir() and not kept.is_symlink():
        env["MPLCONFIGDIR"] = str(kept)  # else (someone else's dir): matplotlib's own fallback


def _pyplot() -> Any:  # matplotlib.pyplot, imported on first use (seconds)
    keep_font_cache()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite(v: object) -> bool:
    """A JSON number (not a bool) that is finite as a float."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int past a float's range
        return False


def _scalar(v: object) -> bool:
    return v is None or (isinstance(v, (int, float, str)) and not isinstance(v, bool))


def _short(text: str, most: int) -> str:
    return text if len(text) <= most else text[:most - 1] + "\u2026"


def _gantt_rows(trace: dict[str, Any]) -> tuple[dict[int, str], dict[int, list[dict[str, Any]]]]:
    """({pid: row name}, {pid: [its "X" events, in trace order]}) of a Chrome trace, checked: a
    ValueError (what a caller reports for a bad file) for a malformed event, or past MAX_ROWS
    rows or MAX_BARS slices, before anything is drawn."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("timeline: no traceEvents list; not drawn")
    names: dict[int, str] = {}
    by_pid: dict[int, list[dict[str, Any]]] = {}
    rows: set[int] = set()
    bars = 0
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise ValueError(f"timeline: event {i} is not an object; not drawn")
        pid = e.get("pid")
        pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None  # an integer pid, or none
        if e.get("ph") == "X":
            args = e.get("args")
            if not (pid is not None and _finite(e.get("ts")) and _finite(e.get("dur")) and _finite(e["ts"] + e["dur"])
                    and isinstance(e.get("name"), str) and isinstance(args, dict)
                    and _scalar(args.get("stage")) and _scalar(args.get("microbatch"))):
                raise ValueError(f"timeline: event {i} is not a slice with an integer pid, numeric ts and dur, "
                                 "a name and args; not drawn")
            bars += 1
            if bars > MAX_BARS:
                raise ValueError(f"timeline: over {MAX_BARS:,} slices, more than a Gantt chart draws; not drawn")
            by_pid.setdefault(pid, []).append(e)
            rows.add(pid)
        if e.get("name") == "process_name":
            args = e.get("args")
            if not (pid is not None and isinstance(args, dict) and isinstance(args.get("name"), str)):
                raise ValueError(f"timeline: event {i} is a process_name without an integer pid and a name; not drawn")
            names[pid] = _short(args["name"], MAX_NAME)
            rows.add(pid)
        if len(rows) > MAX_ROWS:
            raise ValueError(f"timeline: over {MAX_ROWS:,} ranks (pids), more rows than a Gantt chart draws; not drawn")
    if not by_pid and not names:
        raise ValueError("timeline: no ranks (pids) to draw; not drawn")
    return names, by_pid


def gantt(trace: dict[str, Any], path: Path, title: str) -> Path:
    """Ranks as rows (rank 0 on top), one bar per action; gaps are idle time (white). A malformed
    trace, or one past MAX_ROWS ranks or MAX_BARS slices, is a ValueError and nothing is drawn."""
    names, by_pid = _gantt_rows(trace)
    plt = _pyplot()
    pids = sorted(by_pid.keys() | names.keys())
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.8 * len(pids)), dpi=110)
    seen: set[str] = set()
    stages: dict[int, set[object]] = {}
    for pid, es in by_pid.items():
        for e in es:
            if e["args"].get("stage") is not None:
                stages.setdefault(pid, set()).add(e["args"]["stage"])
    multi = {pid: len(s) > 1 for pid, s in stages.items()}
    span = max((e["ts"] + e["dur"] for es in by_pid.values() for e in es), default=1.0) / 1e3
    # While autoscaling is on, matplotlib rescales the view over every artist at each bar added (time
    # quadratic in the bars): off while adding them. Each bar still marks the view for a rescale, made
    # once at the next use of the view, as before.
    ax.set_autoscale_on(False)
    for row, pid in enumerate(pids):
        y = len(pids) - 1 - row
        for e in by_pid.get(pid, ()):
            act = e["name"].split(" ")[0]
            ms0, ms = e["ts"] / 1e3, e["dur"] / 1e3
            compute = act in COMPUTE
            label = LEGEND.get(act) if act not in seen and act in LEGEND else None
            seen.add(act)
            if e.get("tid", 0):  # overlaps the rank's own actions (DDP's bucket all-reduce): a strip below them
                ax.broken_barh([(ms0, ms)], (y - 0.5, 0.1), facecolors=COLORS.get(act, "#cccccc"), label=label)
                continue
            ax.broken_barh([(ms0, ms)], (y - (0.4 if compute else 0.2), 0.8 if compute else 0.4),
                           facecolors=COLORS.get(act, "#cccccc"), edgecolor="black" if compute else "none",
                           linewidth=0.4, label=label)
            mb = e["args"].get("microbatch")
            if compute and mb is not None:
                text = ("F" if act == "forward" else "B" if act == "backward" else act[9].upper()) + str(mb)
                if multi.get(pid):  # several stages on this rank (interleaved, V): say which
                    text += f"/s{e['args']['stage']}"
                if ms < span * 0.0055 * len(text):  # too narrow for its label at this width
                    continue
                ax.text(ms0 + ms / 2, y, text, ha="center", va="center", fontsize=7, color="white", clip_on=True)
    ax.set_autoscale_on(True)
    ax.set_yticks(range(len(pids)))
    ax.set_yticklabels([names.get(pid, f"rank{pid}") for pid in reversed(pids)], fontsize=8)
    ax.set_xlabel("time since the batch's first action (ms, rank 0's clock)")
    ax.set_title(_short(title, MAX_TITLE), fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.3 / len(pids)), ncol=5, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")  # keeps the legend below the axes in the picture
    plt.close(fig)
    return path


def metrics_plot(metrics: list[dict[str, Any]], path: Path) -> Path:
    plt = _pyplot()
    steps = [m["step"] for m in metrics]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6), dpi=110)
    a.plot(steps, [m["loss"] for m in metrics], marker=".", label="train loss")
    ev = [(m["step"], m["eval_loss"]) for m in metrics if "eval_loss" in m]
    if ev:
        a.plot(*zip(*ev, strict=True), marker="o", label="eval loss")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    b.plot(steps, [m.get("tokens_per_s", 0.0) for m in metrics], marker=".", color="#55A868")
    b.set_xlabel("step")
    b.set_ylabel("tokens / s")
    b.grid(alpha=0.3)
    for axis in (a, b):
        axis.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(f"{len(steps)} steps, final loss {metrics[-1]['loss']:.4f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def gantt_title(trace: dict[str, Any], batch: int, summary: Path | None = None) -> str:
    """`batch k: <schedule> pp=P microbatches=M[; bubble measured, theory][ (merged by ...)]`. The
    job's files: a field of the wrong shape, or a summary that does not read, is left out."""
    o = trace.get("otherData") if isinstance(trace, dict) else None
    o = o if isinstance(o, dict) else {}

    def word(key: str, default: str = "") -> str:
        v = o.get(key)
        return str(v) if _scalar(v) and v not in (None, "") else default

    title = (f"batch {batch}: " + (f"{word('schedule')} " if word("schedule") else "")
             + f"pp={word('pp', '?')} microbatches={word('microbatches', '?')}")
    if summary is not None and summary.is_file():
        try:
            s = bounded_json.read(summary)
        except ValueError:
            s = None
        if isinstance(s, dict) and _finite(s.get("measured_bubble")):
            theory = s.get("theoretical_bubble")
            title += f"; bubble {s['measured_bubble']:.2f} measured" + (f", {theory:.2f} theory" if _finite(theory) else "")
    if word("merged_by"):
        title += f" (merged by {word('merged_by')})"
    return title
