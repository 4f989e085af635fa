"""The plots of a run, drawn from the contract's files: the pipeline Gantt chart of a timeline and the
loss / tokens-per-second curves of metrics.jsonl. Matplotlib with the Agg backend: no display
needed. `trainer plot` and `runner collect` both draw with these.
"""

from __future__ import annotations

from pathlib import Path

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


def keep_font_cache(environ=None) -> None:
    """Matplotlib keeps its font cache under ~/.config and ~/.cache; where those cannot be written
    (HOME is / or read-only, as for a container run as another uid) it makes a new temporary dir
    in every process, rebuilds the cache there (seconds) and prints two warnings each time. One
    dir of this user's under the temp dir (0700, owned by them) keeps a cache for every run."""
    import os
    import sys
    import tempfile

    env = os.environ if environ is None else environ
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


def _pyplot():
    keep_font_cache()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def gantt(trace: dict, path: Path, title: str) -> Path:
    """Ranks as rows (rank 0 on top), one bar per action; gaps are idle time (white)."""
    plt = _pyplot()
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    pids = sorted({e["pid"] for e in xs} | set(names))
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.8 * len(pids)), dpi=110)
    seen: set[str] = set()
    stages: dict[int, set] = {}
    for e in xs:
        if e["args"].get("stage") is not None:
            stages.setdefault(e["pid"], set()).add(e["args"]["stage"])
    multi = {pid: len(s) > 1 for pid, s in stages.items()}
    span = max((e["ts"] + e["dur"] for e in xs), default=1.0) / 1e3
    for row, pid in enumerate(pids):
        y = len(pids) - 1 - row
        for e in (e for e in xs if e["pid"] == pid):
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
    ax.set_yticks(range(len(pids)))
    ax.set_yticklabels([names.get(pid, f"rank{pid}") for pid in reversed(pids)], fontsize=8)
    ax.set_xlabel("time since the batch's first action (ms, rank 0's clock)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.3 / len(pids)), ncol=5, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")  # keeps the legend below the axes in the picture
    plt.close(fig)
    return path


def metrics_plot(metrics: list[dict], path: Path) -> Path:
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


def gantt_title(trace: dict, batch: int, summary: Path | None = None) -> str:
    """`batch k: <schedule> pp=P microbatches=M[; bubble measured, theory][ (merged by ...)]`."""
    o = trace.get("otherData", {})
    title = (f"batch {batch}: " + (f"{o['schedule']} " if o.get("schedule") else "")
             + f"pp={o.get('pp', '?')} microbatches={o.get('microbatches', '?')}")
    if summary is not None and summary.is_file():
        s = bounded_json.read(summary)
        theory = s.get("theoretical_bubble")
        title += f"; bubble {s['measured_bubble']:.2f} measured" + (f", {theory:.2f} theory" if theory is not None else "")
    if o.get("merged_by"):
        title += f" (merged by {o['merged_by']})"
    return title
