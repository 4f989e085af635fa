"""Pretrained models and datasets as the Hub hands them to a user, made here with no network.

`pretrained(...)`: a tiny model of a family with a real tokenizer of that family's transformers
class (a BPE, WordPiece or Unigram model trained on the bundled corpus with `tokenizers`), both
saved with save_pretrained, then laid out as `hf download` leaves them in the cache:
`models--org--name/{blobs/<sha256>, refs/main, snapshots/<rev>/<file> -> ../../blobs/<sha256>}`.
`corpus_dataset(...)`: the corpus's paragraphs as a `datasets` DatasetDict saved with save_to_disk.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from tests import REPO

CORPUS = REPO / "trainer" / "corpus" / "corpus.txt"
REV = "0123456789abcdef0123456789abcdef01234567"
# A Qwen-style template (what Qwen3's chat_template.jinja writes for plain turns).
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# family -> (tokenizer model kind, special tokens, the transformers tokenizer class and its kwargs)
TOKENIZERS: dict[str, tuple[str, list[str], str, dict]] = {
    "qwen3": ("bpe", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "Qwen2Tokenizer",
              dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None, bos_token=None)),
    "qwen2": ("bpe", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "Qwen2Tokenizer",
              dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token=None, bos_token=None)),
    "llama": ("bpe", ["<unk>", "<s>", "</s>"], "PreTrainedTokenizerFast",
              dict(unk_token="<unk>", bos_token="<s>", eos_token="</s>")),
    "gpt2": ("bpe", ["<|endoftext|>"], "GPT2Tokenizer",
             dict(eos_token="<|endoftext|>", bos_token="<|endoftext|>", unk_token="<|endoftext|>")),
    "bloom": ("bpe", ["<unk>", "<s>", "</s>", "<pad>"], "PreTrainedTokenizerFast",
              dict(unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>")),
    "bert": ("wordpiece", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "BertTokenizer", {}),
    "t5": ("unigram", ["<pad>", "</s>", "<unk>"], "T5Tokenizer",
           dict(eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0)),
}


def paragraphs() -> list[str]:
    return [p for p in CORPUS.read_text().split("\n\n") if p.strip()]


def train_tokenizer(family: str, vocab: int = 400) -> Any:
    """A transformers tokenizer of the family's class around a model trained on the corpus."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    kind, specials, cls, kwargs = TOKENIZERS[family]
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer: Any = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False)
    else:
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab, special_tokens=specials, unk_token="<unk>",
                                          show_progress=False)
    tok.train_from_iterator(paragraphs(), trainer=trainer)
    hf = getattr(transformers, cls)(tokenizer_object=tok, **kwargs)
    if family.startswith("qwen"):
        hf.chat_template = CHAT_TEMPLATE
    return hf


def hub_layout(folder: Path, hub: Path, repo_id: str, kind: str = "models") -> Path:
    """Move `folder`'s files into a Hub cache repo under `hub` (blobs + relative links); the repo folder."""
    repo = hub / f"{kind}--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / REV
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = f.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / sha).write_bytes(data)
        rel = f.relative_to(folder)
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(repo / "blobs" / sha, (snap / rel).parent), snap / rel)
    shutil.rmtree(folder)
    return repo


def pretrained(tmp: Path, family: str, *, layers: int = 2, vocab: int = 512, tokenizer: bool = True,
               weights: bool = True, seed: int = 1234, **config: Any) -> Path:
    """A tiny pretrained `family` model (+ its tokenizer) in a Hub cache under tmp/hub; the repo folder.
    The model's config.json names the tokenizer's EOS/BOS/PAD ids, as a real model's does."""
    import transformers

    from trainer.config import ModelConfig
    from trainer.models import build_model, model_spec

    folder = tmp / f"save-{family}"
    mc = ModelConfig(preset=f"tiny-{family}", num_hidden_layers=layers, vocab_size=vocab)
    spec = model_spec(mc)
    if tokenizer:
        tok = train_tokenizer(family)
        for key in ("eos", "bos", "pad"):
            i = getattr(tok, f"{key}_token_id")
            if i is not None and hasattr(spec.hf_config, f"{key}_token_id"):
                setattr(spec.hf_config, f"{key}_token_id", i)
    for key, value in config.items():
        setattr(spec.hf_config, key, value)
    model = build_model(spec, mc, seed)
    model.config.use_cache = True
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(folder)
    if not weights:
        for f in folder.glob("*.safetensors"):
            f.unlink()
    if tokenizer:
        tok.save_pretrained(folder)
    return hub_layout(folder, tmp / "hub", f"local/tiny-{family}")


def snapshot(repo: Path) -> Path:
    return repo / "snapshots" / REV


def corpus_dataset(path: Path, test_docs: int = 20) -> Path:
    """The corpus's paragraphs as a DatasetDict (train, test) saved with save_to_disk."""
    import datasets

    docs = paragraphs()
    datasets.disable_progress_bars()
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:-test_docs]}),
                               "test": datasets.Dataset.from_dict({"text": docs[-test_docs:]})})
    dd.save_to_disk(str(path))
    return path
