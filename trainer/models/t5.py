"""T5 (encoder-decoder) for pretraining: `model(input_ids=x, targets=y)` returns the summed token
cross entropy of the decoder's predictions of y, the decoder reading y shifted right (T5's
`decoder_input_ids`: the start token, then y[:-1]; -100 read as padding), as Merak trains it.

The class is transformers' T5ForConditionalGeneration with the trainer's targets forward
(trainer/models/lm_loss.py: the head and the loss chunked over tokens); without targets it is
transformers' own forward. Same parameter names, same checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import T5ForConditionalGeneration as _T5

from trainer.models.lm_loss import LossForward, lm_loss_sum


def shift_right(targets: torch.Tensor, config: Any) -> torch.Tensor:
    """T5's decoder inputs for `targets` (transformers' `_shift_right`)."""
    shifted = targets.new_zeros(targets.shape)
    shifted[..., 1:] = targets[..., :-1]
    shifted[..., 0] = config.decoder_start_token_id
    return shifted.masked_fill(shifted == -100, config.pad_token_id)


def output_scale(config: Any) -> float | None:
    """T5 scales the decoder output by d_model^-0.5 before a head tied to the embeddings."""
    scale = getattr(config, "scale_decoder_outputs", None)
    if scale is None:  # transformers 4.x spelled it tie_word_embeddings
        scale = getattr(config, "tie_word_embeddings", True)
    return config.d_model ** -0.5 if scale else None


class T5ForConditionalGeneration(LossForward, _T5):
    """transformers' T5ForConditionalGeneration with the targets forward (see module doc)."""

    def forward(self, input_ids: torch.Tensor | None = None, targets: torch.Tensor | None = None, **kwargs: Any):
        if targets is None:
            return _T5.forward(self, input_ids=input_ids, **kwargs)
        encoded = self.encoder(input_ids=input_ids).last_hidden_state
        h = self.decoder(input_ids=shift_right(targets, self.config), encoder_hidden_states=encoded,
                         use_cache=False).last_hidden_state
        scale = output_scale(self.config)
        if scale is not None:
            h = h * scale
        return lm_loss_sum(self.lm_head, h, targets, self.loss_chunks)
