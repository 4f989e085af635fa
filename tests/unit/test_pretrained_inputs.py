"""Pretrained weights with their own tokenizer, and data as `datasets` and the Hub save it (issue 24).

Models are tiny pretrained models of each family with a tokenizer of that family's transformers
class, laid out as a Hub cache snapshot (links into ../../blobs/): tests/support/hub_fixtures.py. Asserted:
the ids the trainer packs equal `AutoTokenizer.from_pretrained(<the snapshot>)`'s with the EOS of
the model's config.json between documents; the vocabulary stays the weights'; each kind of data
source yields the same documents; each bad input is one line naming the path and what is missing,
exit 2, nothing trained."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests import REPO
from tests.support.hub_fixtures import (
    CHAT_TEMPLATE,
    CORPUS,
    corpus_dataset,
    hub_layout,
    paragraphs,
    pretrained,
    snapshot,
)
from trainer.config import ConfigError, resolve
from trainer.data.loader import build_data, load_texts, load_tokenizer, pack
from trainer.models import model_spec
from trainer.models.build import FAMILIES

TINY = str(REPO / "configs" / "tiny.yaml")
# Every family that reads text through a tokenizer (the image families have none).
TEXT_FAMILIES = sorted(f for f, fam in FAMILIES.items() if fam.task in ("causal_lm", "masked_lm", "seq2seq"))


def _cfg(**keys):
    return resolve(TINY, [(k.replace("__", "."), v) for k, v in keys.items()], environ={})


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_the_tokenizer_follows_the_weights(tmp_path, family):
    """model.path alone (the Hub repo folder): its snapshot's tokenizer, the config's EOS between
    documents, the weights' vocabulary (512 rows for a 400-id tokenizer), the weights loaded."""
    import json

    from transformers import AutoTokenizer

    from trainer.models import build_model

    repo = pretrained(tmp_path, family)
    snap = snapshot(repo)
    cfg = _cfg(model__path=str(repo), data__source=str(CORPUS), data__seq_len=16)
    assert cfg.model.path == str(snap)  # refs/main names the snapshot
    texts = load_texts(cfg.data)
    tok = load_tokenizer(cfg.data, texts, cfg.model)
    own = AutoTokenizer.from_pretrained(str(snap), local_files_only=True)
    config = json.loads((snap / "config.json").read_text())
    eos = next(i for i in (config.get("eos_token_id"), own.eos_token_id, own.sep_token_id) if i is not None)
    assert tok.source == str(snap) and tok.vocab_size == len(own) == 400 and tok.eos_id == eos
    spec = model_spec(cfg.model, tok.vocab_size)
    assert spec.hf_config.vocab_size == 512
    data = build_data(cfg.data, spec.task, spec.hf_config, 0, 4, 0, 1, tok, texts)
    ref = pack(own(texts, verbose=False)["input_ids"], eos, data.blocks.shape[1])
    assert torch.equal(data.blocks, ref[: data.blocks.shape[0]])
    model = build_model(spec, cfg.model, seed=99)  # another seed: the weights must come from the files
    saved = build_model(model_spec(cfg.model), cfg.model, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values(),
                                                     strict=True))


def test_eos_comes_from_the_models_config(tmp_path):
    """Qwen3-0.6B's config says <|im_end|> while its tokenizer's pad is <|endoftext|>: the config decides."""
    repo = pretrained(tmp_path, "qwen2", eos_token_id=2)  # <|im_end|>; the tokenizer's eos_token is id 0
    cfg = _cfg(model__path=str(repo), data__source=str(CORPUS))
    tok = load_tokenizer(cfg.data, load_texts(cfg.data), cfg.model)
    assert tok.hf.eos_token_id == 0 and tok.eos_id == 2


def test_training_a_new_tokenizer_for_pretrained_weights_only_when_asked(tmp_path):
    repo = pretrained(tmp_path, "qwen3", tokenizer=False)
    cfg = _cfg(model__path=str(repo), data__source=str(CORPUS))
    with pytest.raises(ConfigError) as err:
        load_tokenizer(cfg.data, load_texts(cfg.data), cfg.model)
    msg = str(err.value)
    assert "\n" not in msg and str(snapshot(repo)) in msg and "no tokenizer" in msg and "data.tokenizer train" in msg
    cfg = _cfg(model__path=str(repo), data__source=str(CORPUS), data__tokenizer="train",
               data__tokenizer_vocab_size=300)
    tok = load_tokenizer(cfg.data, load_texts(cfg.data), cfg.model)
    assert tok.vocab_size == 300 and tok.source.startswith("trained on")
    # Random init of the folder's architecture: a tokenizer of the corpus is right, no need to ask.
    cfg = _cfg(model__path=str(repo), model__load_weights=False, data__source=str(CORPUS))
    assert load_tokenizer(cfg.data, load_texts(cfg.data), cfg.model).source.startswith("trained on")


def test_data_sources_as_datasets_and_the_hub_save_them(tmp_path):
    """The same documents from a save_to_disk DatasetDict, a Hub dataset snapshot of parquet files
    (the split from the file names) and a jsonl file; the text field by name; conversations through
    the model's chat template, ids as apply_chat_template gives them."""
    import datasets
    from transformers import AutoTokenizer

    docs = paragraphs()
    train = docs[:-20]
    saved = corpus_dataset(tmp_path / "saved")
    assert load_texts(_cfg(data__source=str(saved)).data) == train
    assert load_texts(_cfg(data__source=str(saved), data__split="test").data) == docs[-20:]

    raw = tmp_path / "raw" / "plain_text"
    raw.mkdir(parents=True)
    datasets.Dataset.from_dict({"body": train, "n": list(range(len(train)))}).to_parquet(
        str(raw / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_dict({"body": docs[-20:], "n": list(range(20))}).to_parquet(
        str(raw / "test-00000-of-00001.parquet"))
    repo = hub_layout(tmp_path / "raw", tmp_path / "hub", "local/corpus", kind="datasets")
    config_dir = snapshot(repo) / "plain_text"
    assert all(p.is_symlink() for p in config_dir.iterdir())
    assert load_texts(_cfg(data__source=str(config_dir), data__text_field="body").data) == train

    jsonl = tmp_path / "docs.jsonl"
    datasets.Dataset.from_dict({"text": train}).to_json(str(jsonl))
    assert load_texts(_cfg(data__source=str(jsonl)).data) == train

    chats = [[{"role": "user", "content": d[:80]}, {"role": "assistant", "content": d[80:200]}] for d in train[:64]]
    chat_dir = tmp_path / "chat"
    datasets.Dataset.from_dict({"messages": chats}).save_to_disk(str(chat_dir))
    model = pretrained(tmp_path, "qwen3")
    cfg = _cfg(model__path=str(model), data__source=str(chat_dir), data__text_field="messages",
               data__chat_template=True)
    rows = load_texts(cfg.data)
    tok = load_tokenizer(cfg.data, rows, cfg.model)
    own = AutoTokenizer.from_pretrained(str(snapshot(model)), local_files_only=True)
    want = [own.apply_chat_template(c, tokenize=True) for c in chats[:3]]
    want = [w["input_ids"] if isinstance(w, dict) or hasattr(w, "keys") else w for w in want]
    assert tok.encode_batch(rows[:3]) == want and want[0][0] == own.convert_tokens_to_ids("<|im_start|>")


def _bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str, str]]:
    """case -> (argv, a path the line must name, what it must say is missing)."""
    import json

    import datasets

    ok = pretrained(tmp / "ok", "qwen3")
    no_weights = pretrained(tmp / "nw", "qwen3", weights=False)
    broken = pretrained(tmp / "broken", "qwen3")
    link = snapshot(broken) / "model.safetensors"
    blob = Path(os.path.realpath(link))
    blob.unlink()  # an interrupted download: the link is there, its blob is not
    # Neither the model's config nor its tokenizer names an end token (a plain tokenizers backend:
    # Qwen2Tokenizer would default to <|endoftext|>).
    no_eos = pretrained(tmp / "noeos", "llama")
    snap = snapshot(no_eos)
    for name, key in (("config.json", "eos_token_id"), ("tokenizer_config.json", "eos_token")):
        doc = json.loads((snap / name).read_text())
        assert doc.pop(key) is not None
        (snap / name).unlink()
        (snap / name).write_text(json.dumps(doc))
    small = pretrained(tmp / "small", "qwen3", vocab=300)  # its tokenizer has 400 ids
    no_field = tmp / "nofield"
    datasets.Dataset.from_dict({"body": paragraphs()[:50]}).save_to_disk(str(no_field))
    corpus = ["--data.source", str(CORPUS)]
    return {
        "model folder without weights": (["--model.path", str(no_weights), *corpus], str(snapshot(no_weights)),
                                         "no weights"),
        "snapshot with a broken link": (["--model.path", str(broken), *corpus], str(link), "does not exist"),
        "pretrained weights without a tokenizer": (["--model.path", str(pretrained(tmp / "nt", "qwen3", tokenizer=False)),
                                                    *corpus], "snapshots", "no tokenizer"),
        "tokenizer without an EOS token": (["--model.path", str(no_eos), *corpus], str(snap), "no EOS token"),
        "tokenizer larger than the embedding": (["--model.path", str(small), *corpus], str(snapshot(small)),
                                                "400 ids but the model's embedding has 300 rows"),
        "dataset without the text field": (["--model.path", str(ok), "--data.source", str(no_field)], str(no_field),
                                           "no column 'text'"),
    }


def test_bad_inputs_are_one_line_and_nothing_trains(tmp_path, capsys, monkeypatch):
    """Through the trainer's CLI entry point (in this process: the same code as `trainer ...`)."""
    from trainer.cli import main

    monkeypatch.setenv("PROFILE_BATCH", "0")  # run() exports it; keep it this test's
    cases = _bad_inputs(tmp_path)
    capsys.readouterr()
    for case, (argv, path, missing) in cases.items():
        out = tmp_path / "out" / case.replace(" ", "-")
        rc = main(["--config", TINY, "--train.steps", "1", "--data.seq_len", "16", *argv, "--output-dir", str(out)])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (case, err)
        assert path in lines[0] and missing in lines[0], (case, lines[0])
        assert not (out / "metrics.jsonl").exists() and not (out / "config.yaml").exists(), case
        assert not (out / "checkpoints").exists(), case


def test_fine_tuned_model_exports_to_transformers(tmp_path):
    """The recipe at reduced size, in one process: a Hub snapshot of a Qwen3 with its tokenizer and
    a save_to_disk dataset in, 3 steps, `trainer export`, then AutoModelForCausalLM + AutoTokenizer
    on the export: the ids the trainer fed are that tokenizer's, the logits are the trainer's final
    weights' (1e-5, and not the pretrained ones'), greedy generation gives the trainer model's argmax
    continuation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.checkpoint.export import export
    from trainer.parallel.mesh import ParallelDims
    from trainer.runtime.dist_env import DistEnv
    from trainer.train import Trainer

    repo = pretrained(tmp_path, "qwen3")
    data = corpus_dataset(tmp_path / "dataset")
    out = tmp_path / "run"
    out.mkdir()
    cfg = _cfg(model__path=str(repo), data__source=str(data), data__seq_len=32, train__steps=3, optim__lr=1e-2,
               checkpoint__enabled=True, checkpoint__on_signal=False, profile__batch="none", output_dir=str(out))
    trainer = Trainer(cfg, DistEnv(), ParallelDims.from_config(cfg.parallel, 1, 1), torch.device("cpu"), "gloo")
    try:
        trainer.fit()
    finally:
        trainer.close()
    final = trainer.par.model_parts[0].eval()
    assert trainer.step == 3

    ids_text = ["The model reads this sentence."]
    original = AutoModelForCausalLM.from_pretrained(str(snapshot(repo)), local_files_only=True).eval()
    shutil.rmtree(tmp_path / "hub")  # exported elsewhere: the run's model.path is a node's, not here
    hf_dir = tmp_path / "hf"
    assert export([str(out / "checkpoints"), str(hf_dir)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    texts = load_texts(cfg.data)
    fed = pack(tok(texts, verbose=False)["input_ids"], trainer.tokenizer.eos_id, trainer.data.blocks.shape[1])
    assert torch.equal(trainer.data.blocks, fed[: trainer.data.blocks.shape[0]])

    assert tok.eos_token == "<|im_end|>" and tok.chat_template == CHAT_TEMPLATE  # the snapshot's, not a bare file's
    ids = tok(ids_text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = final(input_ids=ids).logits
        got = hf(input_ids=ids).logits
        assert (got - want).abs().max().item() <= 1e-5
        assert (original(input_ids=ids).logits - want).abs().max().item() > 1e-3  # it was trained
        gen = hf.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                          pad_token_id=trainer.tokenizer.eos_id)
        greedy = ids
        for _ in range(6):
            greedy = torch.cat([greedy, final(input_ids=greedy).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(gen, greedy)
