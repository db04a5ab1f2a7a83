"""The plugin's model without vLLM: ``Glm5NextModel`` plus ``lm_head``, for tests and tools.

It runs one whole fresh sequence per call (each layer's standalone path) and loads a
checkpoint's tensors by name with :func:`glm5next_plugin.weight_loading.load_by_name`, as the vLLM
entry class does. With ``vision=True`` it also builds the vision tower, and
:meth:`StandaloneLM.logprobs` takes an image prompt: the processor's ``pixel_values`` and
``image_grid_thw`` for the prompt's images, whose embeddings replace the ``<|image|>``
tokens in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .model import Glm5NextModel, merge_image_embeddings
from .weight_loading import load_by_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class StandaloneLM(nn.Module):
    """``model.language_model`` (and ``model.visual`` given ``vision_config``) and
    ``lm_head`` under the checkpoint's tensor names."""

    def __init__(
        self, text_config: PretrainedConfig, tie_word_embeddings: bool = False, vision_config: PretrainedConfig | None = None,
        image_token_id: int | None = None,
    ) -> None:
        super().__init__()
        self.model = Glm5NextModel(text_config, vision_config=vision_config)
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
        self.image_token_id = image_token_id
        if tie_word_embeddings:  # as Glm5NextForConditionalGeneration.__init__ ties them
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    def embeddings(
        self, ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Input embeddings ``[T, hidden]``: token embeddings, the ``<|image|>`` rows
        replaced by the images' embeddings."""
        embeds = self.model.language_model.embed_tokens(ids)
        if pixel_values is None:
            return embeds
        images = self.model.visual(pixel_values, image_grid_thw)
        return merge_image_embeddings(embeds, images, ids == self.image_token_id)

    def logprobs(self, ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                 image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """Next-token log-probs ``[T, vocab]`` of one sequence ``ids`` ``[T]`` (with the
        prompt's images, if any)."""
        if pixel_values is None:
            return self.lm_head(self.model.language_model(ids)).log_softmax(-1)
        embeds = self.embeddings(ids, pixel_values, image_grid_thw)
        return self.lm_head(self.model.language_model(None, embeds)).log_softmax(-1)


def load_standalone(ckpt: str | Path, text_config: PretrainedConfig | None = None, *, vision: bool = False) -> StandaloneLM:
    """The model of checkpoint directory ``ckpt`` (``text_config`` defaults to its config's),
    in eval mode; ``vision`` builds and loads the vision tower too."""
    from safetensors.torch import load_file

    config = None
    if text_config is None or vision:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(ckpt)
        text_config = text_config or config.text_config
    if vision:
        model = StandaloneLM(text_config, vision_config=config.vision_config, image_token_id=config.image_token_id)
    else:
        model = StandaloneLM(text_config)
    load_by_name(model, load_file(str(Path(ckpt) / "model.safetensors")).items(), text_config.num_hidden_layers)
    return model.eval()
