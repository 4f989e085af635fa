"""The config's shape: one dataclass per section with stated defaults, ConfigError, and how a key
is read and set (dotted keys, YAML files, type coercion). Imports nothing of the trainer."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(Exception):
    """An error the user can fix: printed as one line, exit code 2, no traceback. One line whatever
    it quotes: a control character or line separator of a quoted key, path or value (a YAML key
    holding a newline, an escape sequence in an argument) is shown escaped, and the message ends
    after MAX_MESSAGE characters."""

    def __init__(self, message: object = "") -> None:
        super().__init__(one_line(str(message)))


MAX_MESSAGE = 4000


def one_line(text: str) -> str:
    """text with C0/C1 controls (tab kept), DEL and U+2028/U+2029 escaped, at most MAX_MESSAGE characters."""
    out = "".join(c if c == "\t" or not (ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029")
                  else repr(c)[1:-1] for c in text[:MAX_MESSAGE])
    return out + ("..." if len(text) > MAX_MESSAGE else "")


@dataclass
class ModelConfig:
    preset: str = "tiny-llama"          # a name in contract/presets.py
    path: str | None = None             # local HF model dir: config (+ weights) loaded, never downloaded
    load_weights: bool = True           # with `path`: load its weights (False = its config, random init)
    num_hidden_layers: int | None = None  # override the preset's layer count
    hidden_size: int | None = None      # override the preset's hidden size
    num_attention_heads: int | None = None# override the preset's attention heads
    intermediate_size: int | None = None# override the preset's MLP width
    vocab_size: int | None = None       # default: the preset's, or the tokenizer's for text data
    attn_implementation: str = "sdpa"   # sdpa | eager (both deterministic on CPU in fp32)
    hf_overrides: dict = field(default_factory=dict)  # any other transformers config field


@dataclass
class DataConfig:
    source: str = "synthetic"           # synthetic | a .txt/.jsonl/.json/.parquet/.arrow file, a folder of them,
                                        # a `datasets` save_to_disk folder or a Hub dataset snapshot
    split: str = "train"                # the split to read (save_to_disk DatasetDict, Hub snapshot)
    seq_len: int = 128                  # tokens per sample (packed blocks of seq_len+1)
    tokenizer: str | None = None        # tokenizer dir/file | train (a BPE on the corpus); None = model.path's
                                        # own tokenizer, or a trained BPE without model.path (trainer/data/tokenizer.py)
    tokenizer_vocab_size: int = 4096    # for the trained BPE tokenizer
    text_field: str = "text"            # column holding text in jsonl/parquet/datasets
    chat_template: bool = False         # text_field holds conversations: render them with the tokenizer's template
    eval_fraction: float = 0.0          # fraction of packed blocks held out for eval (text data)
    mlm_probability: float = 0.15       # masked-LM (BERT) masking rate
    num_workers: int = 0                # accepted for the FSDP stub; data is made in-process


@dataclass
class TrainConfig:
    steps: int | None = None            # optimizer steps; None = one pass over text data
    seed: int = 0                       # seeds the weights and the data (synthetic tokens, order, masks)
    batch_size: int = 16                # samples per DP rank per forward/backward (Pi guide: "per rank")
    microbatch_num: int | None = None   # each batch is split into this many microbatches; default 4 with
                                        # pipeline stages (the Pi guide's), else 1 (no needless splitting)
    grad_acc_steps: int = 1             # batches accumulated per optimizer step
    dtype: str = "auto"                 # auto (bf16 on CUDA with native bf16, else fp32) | fp32 | bf16
    compile: str = "auto"               # auto (true on CUDA, false on CPU) | true | try | false: each block
                                        # compiled whole (fullgraph, static shapes); try: eager where it cannot
    compile_backend: str = "inductor"   # torch.compile backend: inductor | aot_eager | eager (tests, debugging)
    param_dtype: str = "auto"           # auto (bf16 when dtype is bf16 on CUDA, else fp32) | fp32 | bf16:
                                        # bf16 = bf16 weights in compute, fp32 master weights and optimizer
                                        # state (FSDP2 MixedPrecisionPolicy; one process: master_weights.py)
    activation_checkpointing: str = "none"  # none | selective (recompute all but matmuls/attention) | full
    loss_chunks: int | str = "auto"     # LM head + loss in N token chunks (no full logits); auto: as few
                                        # as keep each chunk's logits <= 2^28 elements (tokens x vocab)
    grad_clip: float = 1.0              # max grad norm; 0 = no clipping (the norm is logged anyway)
    eval_interval: int = 0              # evaluate every N steps (0 = never)
    eval_batches: int = 2               # batches per evaluation
    exit_interval: int = 0              # end the run after a step divisible by N, with a checkpoint
                                        # (Megatron's --exit-interval: time-boxed jobs; --resume latest)
    gc_interval: int | str = "auto"     # Python's cyclic GC off in the loop, young generations collected
                                        # after every N-th step; 0 = automatic; auto: 50 on CUDA, else 0


@dataclass
class OptimConfig:
    name: str = "adamw"                 # adamw | sgd (plain SGD: no momentum; weight_decay as L2)
    lr: float = 3e-4                    # peak learning rate
    beta1: float = 0.9                  # AdamW beta1
    beta2: float = 0.95                 # AdamW beta2
    eps: float = 1e-8                   # AdamW eps
    weight_decay: float = 0.0           # AdamW decoupled weight decay


@dataclass
class ScheduleConfig:
    warmup_steps: int = 0               # linear warmup; warmup_ratio (of train.steps) used when > 0
    warmup_ratio: float = 0.0           # warmup as a fraction of the horizon (beats warmup_steps when > 0)
    decay: str = "cosine"               # cosine | constant
    min_lr: float = 0.0                 # the LR at the end of the cosine decay
    total_steps: int | None = None      # cosine horizon; default train.steps; flat min_lr after it


@dataclass
class DiLoCoConfig:
    inner_steps: int = 50               # H: local steps of each replica between two syncs of a fragment
    outer_lr: float = 0.7               # outer SGD learning rate on the averaged pseudo-gradient
    outer_momentum: float = 0.9         # outer Nesterov momentum (0 = plain outer SGD)
    sync_dtype: str = "fp32"            # pseudo-gradient on the wire: fp32 | bf16 | int8 (per-tensor scale)
    fragments: int = 1                  # Streaming DiLoCo: blocks split in N fragments, one synced every H/N
                                        # steps in turn; N divides H and each rank's transformer blocks
    overlap_steps: int = 0              # a fragment's sync runs behind this many inner steps (< H/fragments)
    merge_alpha: float = 0.5            # with overlap: local = alpha x local + (1 - alpha) x new global


@dataclass
class ParallelConfig:
    sharding: str = "ddp"               # ddp | zero0 | zero2 | zero3 | zero2_hybrid | zero3_hybrid
    dp: int | None = None               # default world / (tp * pp)
    dp_shard: int | None = None         # hybrid: shard group size (default: ranks per node)
    tp: int = 1                         # tensor-parallel degree (DTensor)
    pp: int = 1                         # pipeline stages over ranks
    pp_schedule: str = "1f1b"           # gpipe (afab) | 1f1b | interleaved1f1b | zbv | ...
    partition: str = "uniform_transformer"# pipeline split: uniform_transformer | uniform | parameters | custom:a,b,... | weighted:w0,... | auto
    virtual_stages: int = 1             # stages per pipeline rank (interleaved schedules: 2 or more)
    device: str = "auto"                # auto (cuda if available) | cpu | cuda
    backend: str = "auto"               # auto (gloo on cpu, nccl on cuda) | gloo | nccl
    timeout_s: int | str = "auto"       # collectives' timeout, seconds: auto (the hang budget of contract/hang.py
                                        # + 50%, at least 60 s: minutes, not 30); N: N once the first steps are
                                        # timed, checkpoints and the first steps max(N, their budget)
    sequence_parallel: bool = True      # with tp > 1 (decoder families, pp 1): norms and residual stream
                                        # sharded over the sequence between TP regions (torchtitan's plan)
    dp_sync: str = "allreduce"          # allreduce (gradients every step) | diloco (replicas step alone and
                                        # average their change every parallel.diloco.inner_steps: docs/diloco.md)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)


@dataclass
class CheckpointConfig:
    interval: int = 0                   # every N steps (0 = only at the end when enabled)
    keep_last: int = 2                  # regular checkpoints kept (older ones deleted; 0 = keep all)
    format: str = "dcp"                 # dcp | full (also the FSDP stub's *_state_dict.pt files)
    prefix: str = ""                    # FSDP stub naming <prefix>.<timestamp>[.preempt]
    preempt_interval: int = 0           # a .preempt checkpoint every N steps (0 = only on a signal)
    dir: str | None = None              # default OUTPUT_DIR/checkpoints (relative: under OUTPUT_DIR)
    resume: str | None = None           # latest | PATH
    enabled: bool = False               # save at the end (also implied by interval/preempt_interval > 0)
    name: str = "step-{step}"           # directory name; "checkpoint-{step}" = minimal-3d naming
    async_save: bool = False            # dcp.async_save: write in the background, finalize next step
    on_signal: bool = True              # SIGTERM/SIGUSR1 -> .preempt checkpoint and exit 143
    verify: bool = True                 # check sizes + crc32 of every file before loading
    override_schedule: bool = False     # resume with another LR horizon: recompute the LR at the restored step
    replicas: int = 0                   # nodes without shared storage: copies of each node's files on the next N
                                        # nodes (1: losing any one node loses no checkpoint)


@dataclass
class ProfileConfig:
    batch: str = "0"                    # Pi guide PROFILE_BATCH: batch index (or list/range) to record
    format: str = "chrome"              # chrome | seed
    export_timing_csv: bool = False     # Perseus/Merak instructions-*.csv and time-energy-*.csv
    num_prof_steps: int = 0             # steps averaged into profile.csv; with perseus_url: per plan
    perseus_url: str | None = None      # Perseus server (Merak's --perseus_url): plans per num_prof_steps window
    gpu_clocks: str = "off"             # off (record plans only) | auto (NVML if permitted) | on (or fail)


@dataclass
class LoggingConfig:
    log_interval: int | str = "auto"    # auto: 1 on CPU, 10 on CUDA (a log step waits for the device)
    line: str = "picotron"              # console line: picotron (tokens/s, MFU, memory) | minimal-3d (samples/s)
    seed_line: bool = True              # also print the Pi guide's `[rank0] step N loss X.XXXX`
    peak_flops: float | None = None     # per-device peak for MFU; default GPU table / CPU matmul probe
    tensorboard: bool = False           # metrics.jsonl's records also as TensorBoard events in OUTPUT_DIR/tensorboard/
    wandb: str | None = None            # a W&B project: the records also to a W&B run in OUTPUT_DIR/wandb/
    wandb_mode: str = "offline"         # offline (nodes without internet; `wandb sync` it later) | online


@dataclass
class WatchConfig:
    heartbeat_s: float = 1.0            # OUTPUT_DIR/heartbeat/rank<R>.json rewritten this often (0: off);
                                        # the runner's hang watch and `runner status` read it (docs/contract.md)
    hang_timeout_s: int | str = "auto"  # no progress this long in a step is a hang; auto: max(120, 10 x the
                                        # median step) (runner --hang-timeout passes its own here)
    startup_timeout_s: int | str = "auto"  # the first steps' budget (rendezvous, build, compile, first
                                           # checkpoint); auto: 900, or 10 x the longest step seen
    straggler_factor: float = 1.5       # a rank computing this many times longer than the others' median
                                        # for watch.straggler_steps log steps in a row: one warning line
    straggler_steps: int = 5            # see watch.straggler_factor (0: no straggler warning)


@dataclass
class ElasticConfig:
    in_place: bool = False              # a node lost: the survivors regroup in their processes, stages from the
                                        # neighbours' in-memory replicas (docs/checkpoints.md); off: containers restart
    wait_s: float = 30.0                # after a failed step, how long to wait for the runner's regroup.json
                                        # before the error ends the process (the restart path then)
    replica_every: int = 1              # refresh the in-memory stage replicas every N steps (N-1 steps redone at most)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    output_dir: str = "outputs"         # where the run writes everything (env OUTPUT_DIR; the runner sets /out)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SHARDING = ("ddp", "zero0", "zero2", "zero3", "zero2_hybrid", "zero3_hybrid")
LOG_LINES = ("picotron", "minimal-3d")
DTYPES = {"auto": "auto", "fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}


# ---------------------------------------------------------------- key access and coercion


def config_keys(obj: Any = None, prefix: str = "") -> list[str]:
    """Every canonical dotted key (`train.steps`, ..., `output_dir`), in declaration order."""
    out: list[str] = []
    for f in dataclasses.fields(obj if obj is not None else Config):
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            out += config_keys(sub, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def unknown_key(key: str) -> ConfigError:
    """One line naming the key and the closest real one: a field of the same section
    (`train.step`), a seed spelling's key (`model.layers` -> model.num_hidden_layers, as
    --num-layers), a mistyped section (`trian.steps`), a field without its section (`lr`)."""
    from contract.suggest import close_matches
    from trainer.config.flags import FLAGS

    keys = config_keys()
    section, _, name = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in keys if section and k.startswith(section + ".")}
    seeds = {flag.lstrip("-"): a.canonical for flag, a in FLAGS.items()}
    bare: dict[str, str] = {}
    for k in keys:
        bare.setdefault(k.rpartition(".")[2], k)
    # The whole key is compared only when its section is no section: `parallel.zero` shares
    # `parallel.` with parallel.tp, which makes them look alike.
    whole = {} if siblings else {k: k for k in keys}
    for pool, word, cutoff in ((siblings, name, 0.6), (seeds, name, 0.75), (whole, key, 0.75), (bare, name, 0.75)):
        found = close_matches(word, pool, cutoff=cutoff)
        if found:
            return ConfigError(f"unknown config key '{key}' (did you mean {pool[found[0]]}?)")
    return ConfigError(f"unknown config key '{key}' (`trainer --print-config` lists every key)")


def _section_and_field(cfg: Config, key: str) -> tuple[Any, str]:
    parts = key.split(".")
    obj: Any = cfg
    for p in parts[:-1]:
        if not dataclasses.is_dataclass(obj) or p not in {f.name for f in dataclasses.fields(obj)}:
            raise unknown_key(key)
        obj = getattr(obj, p)
    name = parts[-1]
    if not dataclasses.is_dataclass(obj) or name not in {f.name for f in dataclasses.fields(obj)}:
        raise unknown_key(key)
    if dataclasses.is_dataclass(getattr(obj, name)):
        raise ConfigError(f"config key '{key}' is a section; set one of its fields")
    return obj, name


def _coerce(key: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) not in typing.get_args(tp):
                raise ConfigError(f"config key '{key}': a value is required, got {value!r}")
            return None
        if str in args and isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"  # `int | str` keys: a number, or auto
        try:
            return _coerce(key, args[0], value)
        except ConfigError:
            if str in args:
                raise ConfigError(f"config key '{key}': expected an integer or auto, got {value!r}") from None
            raise
    if isinstance(value, str) and tp is not str:
        try:
            # A value from the command line or the env is YAML too: the same limits as a file's.
            _check_shape(f"config key '{key}'", value)
            value = yaml.safe_load(value)
        except (yaml.YAMLError, ValueError, RecursionError):  # ValueError: an integer of over 4300 digits
            raise ConfigError(f"config key '{key}': cannot parse {value[:100]!r}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}': expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"config key '{key}': expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads `3e-4` and `1e9` (no dot) as strings; users write them all the time.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}': expected a number, got {value!r}")
        try:
            return float(value)
        except OverflowError:  # an integer past a float's range
            raise ConfigError(f"config key '{key}': {str(value)[:20]}... is past any number a float holds") from None
    if tp is str:
        if key == "profile.batch" and isinstance(value, list):  # YAML list of batch indices
            return ",".join(map(str, value))
        if isinstance(value, (dict, list)):
            raise ConfigError(f"config key '{key}': expected a string, got {value!r}")
        return str(value)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {value!r}")
        return dict(value)
    return value


def set_key(cfg: Config, key: str, value: Any) -> None:
    """Set a canonical dotted key, coercing to the field's declared type."""
    obj, name = _section_and_field(cfg, key)
    hints = typing.get_type_hints(type(obj))
    setattr(obj, name, _coerce(key, hints[name], value))


def get_key(cfg: Config, key: str) -> Any:
    obj, name = _section_and_field(cfg, key)
    return getattr(obj, name)


# ---------------------------------------------------------------- YAML


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        # dict-valued fields (model.hf_overrides, FSDP stub's model.hf_config) stay whole.
        if isinstance(v, dict) and key not in DICT_KEYS:
            out += _flatten(v, key + ".")
        else:
            out.append((key, v))
    return out


DICT_KEYS = {"model.hf_overrides", "model.hf_config"}


MAX_CONFIG_BYTES = 1 << 20  # the configs/ files are a few KB
MAX_DEPTH = 32


def _check_shape(path: str | Path, text: str) -> None:
    """Anchors, aliases and deep nesting are refused from the parser's events, before anything is
    built, as the runner refuses them in its YAML (runner/inventory/schema.py): 575 bytes of nested
    aliases flattened to a million keys (5 s, 1.1 GB; each level more doubles both), and 100,000
    brackets took seconds to reach a RecursionError. A checkpoint's config.yaml is a job's output.
    libyaml's parser (a state machine, no recursion) when PyYAML has it."""
    try:
        _check_events(path, yaml.parse(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
    except yaml.YAMLError as e:
        if "nesting" in str(e) or "flow level" in str(e):  # libyaml's own limit (1000) met while scanning ahead
            raise ConfigError(f"config file '{path}' is nested more than {MAX_DEPTH} levels deep; a trainer "
                              "config is sections of keys") from None
        raise


def _check_events(path: str | Path, events) -> None:
    depth = 0
    for ev in events:
        if isinstance(ev, yaml.AliasEvent) or getattr(ev, "anchor", None) is not None:
            raise ConfigError(f"{path}:{ev.start_mark.line + 1}: YAML anchors and aliases (&name, *name, <<: *name) "
                              "are not accepted in a trainer config: write the values out")
        if isinstance(ev, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(f"{path}:{ev.start_mark.line + 1}: nested more than {MAX_DEPTH} levels deep; "
                                  "a trainer config is sections of keys")
        elif isinstance(ev, yaml.CollectionEndEvent):
            depth -= 1


def apply_yaml(cfg: Config, path: str | Path) -> None:
    from trainer.config.flags import YAML_ALIASES, YAML_IGNORED

    p = Path(path)
    try:
        if not p.is_file():
            raise ConfigError(f"config file '{str(path)[:200]}' not found")
        size = p.stat().st_size
    except (OSError, ValueError) as e:  # a name too long, a NUL byte: pathlib raises instead of saying False
        raise ConfigError(f"config file '{str(path)[:200]}' cannot be read ({getattr(e, 'strerror', None) or e})") \
            from None
    if size > MAX_CONFIG_BYTES:  # refused unread
        raise ConfigError(f"config file '{path}' is {size} bytes; a trainer config is at most "
                          f"{MAX_CONFIG_BYTES} (sections of keys, not data)")
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)  # a file that grew since the stat is still bounded
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file '{path}' is over {MAX_CONFIG_BYTES} bytes; a trainer config is "
                              "sections of keys, not data")
        text = raw.decode("utf-8-sig")  # whatever the locale: YAML is UTF-8
        _check_shape(path, text)
        data = yaml.safe_load(text) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{path}' is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {str(e).splitlines()[0]}") from e
    except ValueError as e:  # an integer of over 4300 digits (Python's int limit)
        raise ConfigError(f"config file '{path}': {str(e)[:120]}") from None
    except RecursionError:
        raise ConfigError(f"config file '{path}' is nested too deep to be a config") from None
    except OSError as e:
        raise ConfigError(f"config file '{path}' cannot be read: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must be a mapping of sections")
    for key, value in _flatten(data):
        if key in YAML_IGNORED:
            continue
        alias = YAML_ALIASES.get(key)
        if alias is not None:
            key, value = alias.canonical, alias.convert(value)
        try:
            set_key(cfg, key, value)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
