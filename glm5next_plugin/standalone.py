"""The plugin's model without vLLM: ``Glm5NextModel`` plus ``lm_head``, for tests and tools.

It runs one whole fresh sequence per call (each layer's standalone path) and loads a
checkpoint's tensors by name with :func:`glm5next_plugin.model.load_by_name`, as the vLLM
entry class does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .model import Glm5NextModel, load_by_name


class StandaloneLM(nn.Module):
    """``model.language_model`` and ``lm_head`` under the checkpoint's tensor names."""

    def __init__(self, text_config, tie_word_embeddings: bool = False) -> None:
        super().__init__()
        self.model = Glm5NextModel(text_config)
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
        if tie_word_embeddings:  # as Glm5NextForConditionalGeneration.__init__ ties them
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    def logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token log-probs ``[T, vocab]`` of one sequence ``ids`` ``[T]``."""
        return self.lm_head(self.model.language_model(ids)).log_softmax(-1)


def load_standalone(ckpt: str | Path, text_config=None) -> StandaloneLM:
    """The model of checkpoint directory ``ckpt`` (``text_config`` defaults to its config's),
    in eval mode."""
    from safetensors.torch import load_file

    if text_config is None:
        from transformers import AutoConfig

        text_config = AutoConfig.from_pretrained(ckpt).text_config
    model = StandaloneLM(text_config)
    load_by_name(model, load_file(str(Path(ckpt) / "model.safetensors")).items(), text_config.num_hidden_layers)
    return model.eval()
