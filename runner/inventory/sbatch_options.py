"""`slurm.sbatch`: the sbatch options an inventory may add, a closed list, each value's form checked.

Why closed: the options are written as `#SBATCH` lines beside the runner's own, and sbatch takes
the later of two: `--output=/home/%u/.bashrc` appended the job's output to the user's shell
start-up file, `--export=ALL,PATH=...` chose the programs the batch step runs. sbatch also takes an
unambiguous prefix of a long option (`--out=` is `--output=`), so only names listed here, written
out in full, are taken. Options the runner sets itself (output, error, export, chdir, job name,
nodes and tasks, signal, requeue...) are never in the list; those the inventory has a field for
(`slurm.time`, `slurm.mem`, ...) point to the field, which the runner reads too (the preempt
signal from slurm.time, the sizing from slurm.mem). Values are plain words: no blank, quote, `#`
or `%` (sbatch expands %u, %j in file names), of a bounded length and, for numbers and sizes, range.
"""

from __future__ import annotations

import re
from collections.abc import Callable

MAX_OPTIONS = 64
MAX_VALUE = 256

# options with a slurm.* field of their own
FIELDS = {"--time": "slurm.time", "--mem": "slurm.mem", "--partition": "slurm.partition",
          "--account": "slurm.account", "--qos": "slurm.qos", "--cpus-per-task": "slurm.cpus_per_task",
          "--gpus-per-node": "slurm.gpus_per_node"}
# set by the runner itself (what the batch script and the run dir depend on), or that would
# change where the job runs or what its step inherits
RUNNER_OWN = {"--output", "--error", "--input", "--export", "--export-file", "--chdir", "--job-name", "--nodes",
              "--ntasks", "--ntasks-per-node", "--open-mode", "--signal", "--requeue", "--no-requeue", "--array",
              "--wrap", "--get-user-env", "--uid", "--gid", "--container", "--container-id", "--parsable", "--wait",
              "--kill-on-invalid-dep", "--propagate", "--batch", "--clusters", "--hold", "--test-only", "--quiet",
              "--verbose", "--help", "--usage", "--version", "--spread-job", "--use-min-nodes", "--ntasks-per-core",
              "--ntasks-per-socket", "--ntasks-per-gpu", "--distribution", "--profile", "--acctg-freq", "--power",
              "--priority", "--network", "--bb", "--bbf", "--burst-buffer", "--cluster-constraint"}

WORD = r"[A-Za-z0-9_.+-]"
NAME = re.compile(rf"[A-Za-z0-9]{WORD}{{0,127}}")
FEATURES = re.compile(r"[A-Za-z0-9_.,:&|!*()\[\]-]{1,256}")       # --constraint / --prefer expressions
GRES = re.compile(r"[A-Za-z0-9_.-]+(:[A-Za-z0-9_.-]+){0,2}(,[A-Za-z0-9_.-]+(:[A-Za-z0-9_.-]+){0,2})*")
LICENSES = re.compile(r"[A-Za-z0-9_.@-]+(:\d{1,6})?(,[A-Za-z0-9_.@-]+(:\d{1,6})?)*")
NODELIST = re.compile(r"[A-Za-z0-9_.,\[\]-]{1,256}")
EMAIL = re.compile(r"[A-Za-z0-9_.+-]{1,64}(@[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63})*)?")
COMMENT = re.compile(r"[A-Za-z0-9_.,:/@+=-]{1,200}")
SIZE = re.compile(r"(\d{1,9})([KMGT]?)")
TIME = re.compile(r"(\d{1,6}-)?\d{1,6}(:\d{1,2}){0,2}")
BEGIN = re.compile(r"now(\+\d{1,7}((second|minute|hour|day|week)s?)?)?|\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}(:\d{2})?)?"
                   r"|\d{1,2}:\d{2}(:\d{2})?|midnight|noon|teatime|today|tomorrow")
DEPENDENCY = re.compile(r"singleton|(after|afterany|afterburstbuffer|aftercorr|afternotok|afterok)"
                        r"(:\d{1,10}(\+\d{1,6})?){1,64}([,?](after|afterany|afternotok|afterok)(:\d{1,10}){1,64}){0,8}")
SWITCHES = re.compile(r"\d{1,4}(@(\d{1,6}-)?\d{1,6}(:\d{1,2}){0,2})?")
MAIL_TYPES = {"NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT", "TIME_LIMIT",
              "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS"}


def _rx(rx: re.Pattern, what: str) -> Callable[[str], str | None]:
    return lambda v: None if rx.fullmatch(v) else what


def _int(lo: int, hi: int) -> Callable[[str], str | None]:
    return lambda v: None if re.fullmatch(r"-?\d{1,10}", v) and lo <= int(v) <= hi else f"an integer in {lo}..{hi}"


def _size(v: str) -> str | None:
    m = SIZE.fullmatch(v)
    if not m or int(m[1]) * 1024 ** "MGT".find(m[2] or "M") > 1 << 30:  # in MiB: at most 1 PiB
        return "a size like 16000M, 64G or 1T (at most 1 PiB)"
    return None


def _choice(*allowed: str) -> Callable[[str], str | None]:
    return lambda v: None if v in allowed else f"one of {', '.join(allowed)}"


def _mail_types(v: str) -> str | None:
    return None if all(t in MAIL_TYPES for t in v.split(",")) else f"a comma list of {', '.join(sorted(MAIL_TYPES))}"


# option -> its value's check (None: a switch, no value)
ALLOWED: dict[str, Callable[[str], str | None] | None] = {
    "--constraint": _rx(FEATURES, "a feature expression like a100&ib (letters, digits, & | ! * , : [ ] ( ))"),
    "--prefer": _rx(FEATURES, "a feature expression like a100&ib"),
    "--gres": _rx(GRES, "a list like gpu:a100:2 or gpu:2,nvme:1"),
    "--licenses": _rx(LICENSES, "a list like matlab:2,comsol"),
    "--mail-type": _mail_types,
    "--mail-user": _rx(EMAIL, "a user name or an address like me@example.org"),
    "--reservation": _rx(NAME, "a reservation name (letters, digits, '.', '_', '+', '-')"),
    "--wckey": _rx(NAME, "a wckey name (letters, digits, '.', '_', '+', '-')"),
    "--comment": _rx(COMMENT, "up to 200 characters of letters, digits and _ . , : / @ + = -"),
    "--nice": _int(0, 10000),
    "--mem-per-cpu": _size, "--mem-per-gpu": _size, "--tmp": _size,
    "--mincpus": _int(1, 1 << 20), "--cpus-per-gpu": _int(1, 4096), "--gpus-per-task": _int(1, 64),
    "--sockets-per-node": _int(1, 64), "--cores-per-socket": _int(1, 4096), "--threads-per-core": _int(1, 64),
    "--exclude": _rx(NODELIST, "a node list like node[01-04],gpu7"),
    "--nodelist": _rx(NODELIST, "a node list like node[01-04],gpu7"),
    "--hint": _choice("compute_bound", "memory_bound", "multithread", "nomultithread"),
    "--begin": _rx(BEGIN, "a time like now+1hour, 16:00 or 2030-01-20T12:00"),
    "--time-min": _rx(TIME, "a Slurm time like 30, 04:00:00 or 1-00:00:00"),
    "--dependency": _rx(DEPENDENCY, "a dependency like afterok:123:456 or singleton"),
    "--switches": _rx(SWITCHES, "a count, optionally @max-time, like 1@10:00"),
    "--exclusive": None, "--contiguous": None, "--oversubscribe": None,
}
EXCLUSIVE_VALUES = ("user", "mcs", "topo")
OPTION_RE = re.compile(r"--[a-z][a-z0-9-]{0,40}")


def option_error(text: str) -> str | None:
    """Why `text` (one slurm.sbatch entry) is refused, or None: the reason names the option and
    what to write instead."""
    name, eq, value = text.partition("=")
    if not OPTION_RE.fullmatch(name):
        return f"{text[:60]!r}: use --option or --option=value, an option sbatch lists in full (not -x or a prefix)"
    if name in FIELDS:
        return f"{name}: use {FIELDS[name]} instead (the runner reads it too; sbatch would take the later of two)"
    if name in RUNNER_OWN:
        return (f"{name}: set by the runner itself or not passed through (the job's files, environment and "
                "place are the runner's); remove it")
    if name not in ALLOWED:
        return f"{name}: not an option the runner passes to sbatch (allowed: {', '.join(sorted(ALLOWED))})"
    check = ALLOWED[name]
    if name == "--exclusive":  # a switch that may also take a word
        return None if not eq or value in EXCLUSIVE_VALUES else f"{name}: give no value or one of user, mcs, topo"
    if check is None:
        return None if not eq else f"{name}: a switch; give it without '=...'"
    if not eq or not value:
        return f"{name}: needs a value ({name}=...)"
    if len(value) > MAX_VALUE or not re.fullmatch(r"[A-Za-z0-9_.,:/@+=&|!*()\[\]-]+", value):
        return f"{name}={value[:40]!r}: no blanks, quotes, '#', '%' or '$', at most {MAX_VALUE} characters"
    why = check(value)
    return None if why is None else f"{name}={value[:60]!r}: must be {why}"
