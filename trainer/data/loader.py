"""Training data: synthetic tokens/images, local text/jsonl/parquet tokenised and packed, or an
image folder (one subdirectory per class, as ImageNet's train/ is laid out).

Per task: causal LM (inputs, inputs shifted by one), masked LM, T5's seq2seq (a block of 2 x seq_len
tokens: the first half is the encoder's input, the second the labels; the model feeds the decoder
the labels shifted right), ViT-MAE images + masking noise, and image classification (3 x size x size
images and class labels: synthetic images are a class's fixed pattern plus noise, so the loss falls).

Every sample has a global index; sample i is a pure function of (seed, i). A step's global
batch is samples [c, c + G) with G = batch_size x grad_acc_steps x dp, and DP rank r takes the
contiguous slice [c + r*L, c + (r+1)*L), L = G / dp. So sample i of a global batch is the same
whatever the DP layout, and the only position to save for resume is c (`consumed`).

`prefetch()` builds the next batch ahead of time (the trainer calls it once the step's device work
is queued, so the host prepares it while the device computes) into pinned memory on CUDA hosts, so
its copy to the device does not wait for the host. It is keyed by position: a resume (a new
`consumed`) simply discards it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config import ConfigError, DataConfig
from trainer.data.text_sources import load_texts
from trainer.data.tokenizer import Tokenizer, load_tokenizer

__all__ = ["DataStream", "Tokenizer", "build_data", "load_texts", "load_tokenizer", "pack"]
log = logging.getLogger("trainer")

_EVAL_OFFSET = 1 << 40  # synthetic eval samples live far from training indices


def _gen(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (1 << 63))


# ---------------------------------------------------------------- text corpus


def pack(token_lists: list[list[int]], eos_id: int, block: int) -> torch.Tensor:
    """Concatenate documents separated by EOS and cut into [n, block] (remainder dropped). A
    document the tokenizer already ended with EOS (T5's `</s>`, BERT's `[SEP]`) gets no second one."""
    flat: list[int] = []
    for ids in token_lists:
        flat.extend(ids)
        if not ids or ids[-1] != eos_id:
            flat.append(eos_id)
    n = len(flat) // block
    return torch.tensor(flat[: n * block], dtype=torch.long).view(n, block)


# ---------------------------------------------------------------- image folder

IMAGE_EXT = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
# torchvision's ImageNet normalisation
_MEAN, _STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass
class ImageFolder:
    """`root/<class>/<image>` (ImageNet's layout): classes are the sorted subdirectory names."""

    classes: list[str]
    train_files: list[tuple[str, int]]
    eval_files: list[tuple[str, int]]
    channels: int

    @classmethod
    def scan(cls, root: str, seed: int, eval_fraction: float, num_classes: int, channels: int) -> ImageFolder:
        base = Path(root)
        if not base.is_dir():
            raise ConfigError(f"data.source: '{root}' must be a directory of class subdirectories of images")
        classes = sorted(d.name for d in base.iterdir() if d.is_dir())
        if not classes:
            raise ConfigError(f"data.source: '{root}' has no class subdirectories (expected root/<class>/<image>)")
        if len(classes) > num_classes:
            raise ConfigError(f"data.source: '{root}' has {len(classes)} classes but the model has {num_classes}; "
                              f"set model.hf_overrides.num_classes {len(classes)}")
        files = [(str(f), i) for i, c in enumerate(classes) for f in sorted((base / c).iterdir())
                 if f.suffix.lower() in IMAGE_EXT]
        if not files:
            raise ConfigError(f"data.source: no {'/'.join(IMAGE_EXT)} images under '{root}'/<class>/")
        order = torch.randperm(len(files), generator=_gen(seed, -(1 << 20))).tolist()
        files = [files[i] for i in order]  # held-out images drawn from every class
        n_eval = int(round(len(files) * eval_fraction))
        return cls(classes, files[: len(files) - n_eval], files[len(files) - n_eval:], channels)

    def load(self, item: tuple[str, int], size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The image resized (shorter side to `size`), centre-cropped to size x size, normalised."""
        import numpy as np
        from PIL import Image

        path, label = item
        try:
            with Image.open(path) as im:
                im = im.convert("RGB" if self.channels == 3 else "L")
                w, h = im.size
                scale = size / min(w, h)
                im = im.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BILINEAR)
                w, h = im.size
                left, top = (w - size) // 2, (h - size) // 2
                im = im.crop((left, top, left + size, top + size))
                x = torch.from_numpy(np.asarray(im, dtype=np.float32).copy()) / 255.0
        except (OSError, Image.DecompressionBombError) as e:  # the bomb error is not an OSError
            raise ConfigError(f"data.source: cannot read image '{path}': {e}") from None
        x = x.permute(2, 0, 1) if x.dim() == 3 else x.unsqueeze(0)
        if self.channels == 3:
            x = (x - torch.tensor(_MEAN).view(3, 1, 1)) / torch.tensor(_STD).view(3, 1, 1)
        return x, torch.tensor(label)


# ---------------------------------------------------------------- the stream


class DataStream:
    """Per-rank batches for each optimizer step, resumable from `consumed` global samples."""

    def __init__(self, kind: str, dcfg: DataConfig, seed: int, local_batch: int, dp_rank: int, dp_size: int, *,
                 vocab_size: int = 0, mask_id: int | None = None, blocks: torch.Tensor | None = None,
                 eval_blocks: torch.Tensor | None = None, image: tuple[int, int, int, int] | None = None,
                 images: ImageFolder | None = None):
        self.kind, self.dcfg, self.seed = kind, dcfg, seed
        self.images = images             # classification: an image folder (None: synthetic images)
        self.local_batch, self.dp_rank, self.dp_size = local_batch, dp_rank, dp_size
        self.global_batch = local_batch * dp_size
        self.vocab_size, self.mask_id = vocab_size, mask_id
        self.blocks, self.eval_blocks, self.image = blocks, eval_blocks, image
        self.consumed = 0
        self.pin = False                 # pinned host memory (set by the trainer on CUDA devices)
        self._ahead: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, permutation of the blocks)

    # --- one sample as (input, label) tensors
    def _token_block(self, index: int, evaluation: bool) -> torch.Tensor:
        s = self.block_len
        if self.blocks is None:
            # Learnable synthetic text: a random start and stride per sample, tokens (start + k*stride) mod V.
            # The loss can fall far below ln V, so runs show learning, yet every sample is fresh.
            hi = self.vocab_size - (1 if self.kind == "masked_lm" else 0)  # keep the synthetic [MASK] id out
            g = _gen(self.seed, index + (_EVAL_OFFSET if evaluation else 0))
            start = int(torch.randint(0, hi, (1,), generator=g))
            stride = int(torch.randint(1, 17, (1,), generator=g))
            return (start + stride * torch.arange(s)) % hi
        blocks = self.eval_blocks if evaluation else self.blocks
        n = blocks.shape[0]
        epoch, pos = divmod(index, n)
        if evaluation:
            return blocks[pos]
        return blocks[self._permutation(epoch, n)[pos]]

    def _permutation(self, epoch: int, n: int) -> torch.Tensor:
        """The epoch's shuffle of the blocks, drawn once per epoch (randperm of 1M blocks takes ~19 ms)."""
        if self._perm is None or self._perm[0] != epoch:
            perm = torch.randperm(n, generator=_gen(self.seed, -1 - epoch)) if n > 1 else torch.zeros(1, dtype=torch.long)
            self._perm = (epoch, perm)
        return self._perm[1]

    @property
    def block_len(self) -> int:
        """Tokens per sample block: seq_len + 1 (shifted LM targets), T5: seq_len in + seq_len out."""
        return 2 * self.dcfg.seq_len if self.kind == "seq2seq" else self.dcfg.seq_len + 1

    def sample(self, index: int, evaluation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "image":
            return self._image(index, evaluation)
        if self.kind == "seq2seq":
            block = self._token_block(index, evaluation)
            return block[: self.dcfg.seq_len], block[self.dcfg.seq_len:]
        if self.kind == "mae":
            c, h, w, patches = self.image  # type: ignore[misc]
            g = _gen(self.seed, index + (_EVAL_OFFSET if evaluation else 0))
            return torch.randn(c, h, w, generator=g), torch.rand(patches, generator=g)
        block = self._token_block(index, evaluation)
        if self.kind == "masked_lm":
            ids = block[:-1].clone()
            g = _gen(self.seed + 7, index)
            masked = torch.rand(ids.shape, generator=g) < self.dcfg.mlm_probability
            masked[0] |= not bool(masked.any())  # every sample contributes at least one target
            labels = torch.where(masked, ids, torch.full_like(ids, -100))
            ids[masked] = self.mask_id  # type: ignore[assignment]
            return ids, labels
        return block[:-1], block[1:]

    def _image(self, index: int, evaluation: bool) -> tuple[torch.Tensor, torch.Tensor]:
        c, h, w, classes = self.image  # type: ignore[misc]
        if self.images is not None:
            files = self.images.eval_files if evaluation else self.images.train_files
            epoch, pos = divmod(index, len(files))
            if not evaluation:
                pos = int(self._permutation(epoch, len(files))[pos])
            return self.images.load(files[pos], h)
        g = _gen(self.seed, index + (_EVAL_OFFSET if evaluation else 0))
        label = int(torch.randint(0, classes, (1,), generator=g))
        # The class's pattern (a function of the seed and the class only) under per-sample noise.
        pattern = torch.randn(c, h, w, generator=_gen(self.seed + 11, label))
        return pattern + 0.5 * torch.randn(c, h, w, generator=g), torch.tensor(label)

    def _batch(self, start: int, evaluation: bool) -> tuple[torch.Tensor, torch.Tensor]:
        first = start + self.dp_rank * self.local_batch
        pairs = [self.sample(first + k, evaluation) for k in range(self.local_batch)]
        x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        return (x.pin_memory(), y.pin_memory()) if self.pin else (x, y)

    def prefetch(self) -> None:
        """Build the batch `next_batch` will return, now (see module doc)."""
        if self._ahead is None or self._ahead[0] != self.consumed:
            self._ahead = (self.consumed, self._batch(self.consumed, False))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ahead, self._ahead = self._ahead, None
        batch = ahead[1] if ahead is not None and ahead[0] == self.consumed else self._batch(self.consumed, False)
        self.consumed += self.global_batch
        return batch

    def eval_batch(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.blocks is not None and (self.eval_blocks is None or len(self.eval_blocks) == 0):
            raise ConfigError("data.eval_fraction must be > 0 to evaluate on text data")
        if self.images is not None and not self.images.eval_files:
            raise ConfigError("data.eval_fraction must be > 0 to evaluate on an image folder")
        return self._batch(j * self.global_batch, True)

    @property
    def steps_per_epoch(self) -> int | None:
        if self.images is not None:
            return len(self.images.train_files) // self.global_batch
        return None if self.blocks is None else self.blocks.shape[0] // self.global_batch

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ConfigError(f"train.seed {self.seed} differs from the checkpoint's data seed {state['seed']}")
        self.consumed = int(state["consumed"])


def reads_text(dcfg: DataConfig, task: str) -> bool:
    """Whether the run tokenises a text corpus (images are read by build_data itself)."""
    return dcfg.source != "synthetic" and task not in ("image", "mae")


def build_data(dcfg: DataConfig, task: str, hf_config: Any, seed: int, local_batch: int, dp_rank: int,
               dp_size: int, tokenizer: Tokenizer | None = None, texts: list[str] | None = None) -> DataStream:
    if task == "image":
        c, size, classes = hf_config.num_channels, hf_config.image_size, hf_config.num_classes
        folder = None
        if dcfg.source != "synthetic":
            folder = ImageFolder.scan(dcfg.source, seed, dcfg.eval_fraction, classes, c)
            if len(folder.train_files) < local_batch * dp_size:
                raise ConfigError(f"data.source: {len(folder.train_files)} training images in '{dcfg.source}' are "
                                  f"fewer than one global batch ({local_batch * dp_size})")
            log.info("data: %d training images in %d classes (%d held out), %dx%d", len(folder.train_files),
                     len(folder.classes), len(folder.eval_files), size, size)
        return DataStream(task, dcfg, seed, local_batch, dp_rank, dp_size, image=(c, size, size, classes),
                          images=folder)
    if task == "mae":
        if dcfg.source != "synthetic":
            raise ConfigError("data.source: ViT-MAE trains on synthetic images only (data.source: synthetic)")
        c, size, patch = hf_config.num_channels, hf_config.image_size, hf_config.patch_size
        return DataStream(task, dcfg, seed, local_batch, dp_rank, dp_size, image=(c, size, size, (size // patch) ** 2))
    vocab = int(hf_config.vocab_size)
    if dcfg.source == "synthetic":
        return DataStream(task, dcfg, seed, local_batch, dp_rank, dp_size, vocab_size=vocab, mask_id=vocab - 1)
    assert tokenizer is not None and texts is not None
    block = 2 * dcfg.seq_len if task == "seq2seq" else dcfg.seq_len + 1
    blocks = pack(tokenizer.encode_batch(texts), tokenizer.eos_id, block)
    n_eval = int(round(blocks.shape[0] * dcfg.eval_fraction))
    train_blocks, eval_blocks = blocks[: blocks.shape[0] - n_eval], blocks[blocks.shape[0] - n_eval:]
    if train_blocks.shape[0] < local_batch * dp_size:
        raise ConfigError(f"data.source: {train_blocks.shape[0]} blocks of {block} tokens are fewer than "
                          f"one global batch ({local_batch * dp_size}); use more text or a smaller batch/seq_len")
    if task == "masked_lm" and tokenizer.mask_id is None:
        raise ConfigError("data.tokenizer: a masked LM needs a [MASK] token in the tokenizer")
    log.info("data: %d training blocks of %d tokens (%d held out), vocab %d", train_blocks.shape[0],
             block, n_eval, tokenizer.vocab_size)
    return DataStream(task, dcfg, seed, local_batch, dp_rank, dp_size, vocab_size=vocab, mask_id=tokenizer.mask_id,
                      blocks=train_blocks, eval_blocks=eval_blocks)
