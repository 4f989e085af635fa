"""The tokenizer a run feeds its model: the one that came with the weights, or a BPE trained on the corpus.

Which one (`tokenizer_source`):
- `data.tokenizer DIR|FILE`: that tokenizer (a folder `AutoTokenizer` reads, or a tokenizer.json);
- `data.tokenizer train`: a byte-level BPE trained on the corpus (deterministic), asked for explicitly;
- neither, with `model.path`: the model folder's own tokenizer. Pretrained weights without one are
  refused: a tokenizer trained here would feed them ids that mean other tokens;
- neither, without `model.path` (a preset, random init): a BPE trained on the corpus.

Folders are read with `AutoTokenizer` (offline), exactly as a user loads the model afterwards:
transformers may apply its own pre-tokenizer for a family (Qwen2's regex), so reading
tokenizer.json with `tokenizers` alone can give other ids. Each document is encoded as
`tokenizer(text)` would (the tokenizer's own BOS/EOS/CLS included); documents are packed with the
model's EOS between them (data.pack). EOS, BOS and PAD come from the model's config.json, else
from the tokenizer. A tokenizer whose ids exceed the model's embedding rows is refused (`check_fits`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, DataConfig, ModelConfig
from trainer.config.bounds import MODEL_SIZES

log = logging.getLogger("trainer")

TRAIN = "train"                          # data.tokenizer value asking for a BPE trained on the corpus
SPECIAL_TOKENS = ["<|endoftext|>", "[MASK]", "[PAD]"]
# Files from which AutoTokenizer builds a tokenizer (any one is enough).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model",
                   "tokenizer.model")
# What a bare tokenizer.json (no config) may call its end-of-text token.
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")
# A tokenizer's files are read whole: each at most this big (the largest real tokenizer.json, Gemma's,
# is ~34 MB), and its ids at most the model vocabulary's bound (trainer/config/bounds.py).
MAX_TOKENIZER_FILE = 256 << 20


@dataclass
class Tokenizer:
    vocab_size: int                      # ids it can produce (added tokens included)
    eos_id: int                          # between packed documents
    mask_id: int | None
    hf: Any                              # a transformers tokenizer
    source: str                          # where it came from (messages)
    bos_id: int | None = None
    pad_id: int | None = None
    chat: bool = False                   # documents are message lists, rendered by the chat template

    def encode_batch(self, docs: list[Any]) -> list[list[int]]:
        """Token ids of each document, as the tokenizer itself encodes it."""
        if self.chat:
            # The template writes its own special tokens: the tokenizer must not add them again.
            texts = [self.hf.apply_chat_template(m, tokenize=False) for m in docs]
            return self.hf(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return self.hf(docs, verbose=False)["input_ids"]

    def save(self, out: Path) -> None:
        """tokenizer.json, tokenizer_config.json (+ chat template): what AutoTokenizer reads."""
        self.hf.save_pretrained(str(out))

    def check_fits(self, embedding_rows: int) -> None:
        if self.vocab_size > embedding_rows:
            raise ConfigError(f"data.tokenizer: '{self.source}' has {self.vocab_size} ids but the model's embedding "
                              f"has {embedding_rows} rows; use the tokenizer the weights were trained with")


def tokenizer_source(dcfg: DataConfig, mcfg: ModelConfig | None) -> str | None:
    """The tokenizer folder/file to read, or None to train a BPE on the corpus (module doc)."""
    if dcfg.tokenizer == TRAIN:
        return None
    if dcfg.tokenizer:
        return dcfg.tokenizer
    if mcfg is None or mcfg.path is None:
        return None
    from trainer.config.hub_layout import snapshot_dir

    d = snapshot_dir(mcfg.path, "model.path")
    if any((d / f).is_file() for f in TOKENIZER_FILES):
        return str(d)
    if not mcfg.load_weights:
        return None  # an architecture trained from scratch: a tokenizer of its corpus is right
    raise ConfigError(f"model.path: '{d}' has no tokenizer ({', '.join(TOKENIZER_FILES[:2])}); pretrained weights "
                      "need the tokenizer they were trained with: set data.tokenizer DIR, or data.tokenizer train "
                      "to train a new one (its ids would mean other tokens to these weights)")


def load_tokenizer(dcfg: DataConfig, texts: list[Any], mcfg: ModelConfig | None = None) -> Tokenizer:
    source = tokenizer_source(dcfg, mcfg)
    if source is None:
        if dcfg.chat_template:
            raise ConfigError("data.chat_template: a tokenizer trained on the corpus has no chat template; use the "
                              "model's own tokenizer (model.path or data.tokenizer DIR)")
        tok = _train_bpe(dcfg, texts)
    else:
        tok = _read(source, _model_config(mcfg) if mcfg is not None and mcfg.path is not None else None)
    if dcfg.chat_template:
        if not getattr(tok.hf, "chat_template", None):
            raise ConfigError(f"data.chat_template: the tokenizer at '{tok.source}' has no chat template")
        tok.chat = True
    return tok


def _model_config(mcfg: ModelConfig) -> dict:
    import json

    from trainer.config.hub_layout import snapshot_dir

    try:
        return json.loads((snapshot_dir(mcfg.path, "model.path") / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # unreadable here: build.py names the file's problem
        return {}


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):  # Llama 3 lists several end tokens; the first is its end of text
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _read(source: str, config: dict | None) -> Tokenizer:
    """A tokenizer folder through AutoTokenizer (offline), or a bare tokenizer.json file."""
    import transformers

    transformers.logging.set_verbosity_error()  # no advice about unrelated files in the folder
    p = Path(source)
    if p.is_file():
        _check_sizes([p])
        try:
            hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(p))
        except Exception as e:  # noqa: BLE001 - the tokenizers library's parse errors (Exception): one line
            raise ConfigError(f"data.tokenizer: cannot read '{p}' as a tokenizer.json: "
                              f"{' '.join(str(e).split())[:300]}") from None
        named = next((t for t in EOS_NAMES if hf.convert_tokens_to_ids(t) not in (None, hf.unk_token_id)), None)
        if named is not None:
            hf.eos_token = named
    elif p.is_dir():
        from trainer.config.hub_layout import check_links, snapshot_dir

        p = snapshot_dir(p, "data.tokenizer")
        check_links(p, "data.tokenizer")
        if not any((p / f).is_file() for f in TOKENIZER_FILES):
            raise ConfigError(f"data.tokenizer: '{p}' has none of {', '.join(TOKENIZER_FILES)}")
        _check_sizes([p / f for f in (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json",
                                     "merges.txt", "chat_template.jinja", "chat_template.json")])
        try:
            hf = transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers' and tokenizers' parse errors of any kind: one line
            raise ConfigError(f"data.tokenizer: cannot read the tokenizer at '{p}': "
                              f"{' '.join(str(e).split())[:300]}") from None
    else:
        raise ConfigError(f"data.tokenizer: '{source}' does not exist (a tokenizer folder or tokenizer.json)")
    _, most = MODEL_SIZES["vocab_size"]
    if len(hf) > most:
        raise ConfigError(f"data.tokenizer: '{p}' has {len(hf)} ids; a model vocabulary is at most {most}")
    config = config or {}
    eos = _first_id(config.get("eos_token_id"))
    eos = eos if eos is not None else (hf.eos_token_id if hf.eos_token_id is not None else hf.sep_token_id)
    if eos is None:
        raise ConfigError(f"data.tokenizer: '{p}' has no EOS token (no eos_token_id in the model's config.json, "
                          "no eos_token or sep_token in the tokenizer): documents could not be separated; add "
                          "eos_token to its tokenizer_config.json")
    bos = _first_id(config.get("bos_token_id"))
    pad = _first_id(config.get("pad_token_id"))
    tok = Tokenizer(len(hf), eos, hf.mask_token_id, hf, str(p), bos if bos is not None else hf.bos_token_id,
                    pad if pad is not None else hf.pad_token_id)
    for name, i in (("EOS", tok.eos_id), ("BOS", tok.bos_id), ("PAD", tok.pad_id)):
        if i is not None and i >= tok.vocab_size:
            raise ConfigError(f"data.tokenizer: {name} id {i} (model config.json) is not an id of the tokenizer at "
                              f"'{p}' ({tok.vocab_size} ids): the two do not belong together")
    log.info("tokenizer: %s (%d ids; EOS %s, BOS %s, PAD %s)", p, tok.vocab_size, tok.eos_id, tok.bos_id, tok.pad_id)
    return tok


def _check_sizes(files: list[Path]) -> None:
    """Each tokenizer file that is there at most MAX_TOKENIZER_FILE bytes (they are read whole)."""
    for f in files:
        try:
            size = f.stat().st_size if f.is_file() else 0
        except OSError:
            continue
        if size > MAX_TOKENIZER_FILE:
            raise ConfigError(f"data.tokenizer: '{f}' is {size} bytes; a tokenizer file is at most "
                              f"{MAX_TOKENIZER_FILE} (the largest real ones are ~34 MB)")


def _train_bpe(dcfg: DataConfig, texts: list[Any]) -> Tokenizer:
    """A byte-level BPE of data.tokenizer_vocab_size tokens trained on the corpus (deterministic)."""
    import transformers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if texts and not isinstance(texts[0], str):
        raise ConfigError(f"data.text_field: '{dcfg.text_field}' holds {type(texts[0]).__name__}s, not text; "
                          "for chat messages set data.chat_template true with the model's own tokenizer")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=dcfg.tokenizer_vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0],
                                              mask_token=SPECIAL_TOKENS[1], pad_token=SPECIAL_TOKENS[2])
    src = f"trained on {dcfg.source}"
    return Tokenizer(len(hf), hf.eos_token_id, hf.mask_token_id, hf, src, None, hf.pad_token_id)

