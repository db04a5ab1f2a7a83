"""vLLM prompt processing for GLM-5.3-Flash images: processor, placeholder expansion, budget.

vLLM's native GLM-5.3-Flash processor builds on transformers' ``Glm5NextProcessor``
(``AutoProcessor``), whose fast image and video processors need torchvision, which a CPU
install of vLLM does not have. The plugin needs only the image part, so it runs
transformers' PIL image processor, ``Glm5NextImageProcessorPil``, with the checkpoint's
settings (``preprocessor_config.json`` or ``processor_config.json``: patch, merge and
temporal patch sizes, ``min_image_tokens``/``max_image_tokens``, mean/std), overridden by
``--mm-processor-kwargs`` / a request's ``mm_processor_kwargs``.

A prompt names one image as ``<|begin_of_image|><|image|><|end_of_image|>`` (what
:data:`IMAGE_PLACEHOLDER` is and what the checkpoint's chat template renders for an image
part); vLLM replaces the single ``<|image|>`` by ``grid_t * grid_h * grid_w / merge**2``
``<|image|>`` tokens, as transformers' processor does, and those positions are the
image's placeholder range (the markers around them are ordinary tokens).

Video is not supported yet: a prompt with a video is refused with :data:`VIDEO_REFUSAL`
(an HTTP 400 from ``vllm serve``).

No tokenizer is needed (``--skip-tokenizer-init``, token-in/token-out workers behind a
router that tokenizes): the processor works on token ids only (its target and its
replacement are the ``image_token_id`` of the checkpoint's config, the text is never read),
so :class:`Glm5NextImageProcessing` says ``requires_tokenizer = False`` and builds its
profiling prompt from the config's image token ids. vLLM builds this processor in the API
server whenever multimodal inputs are possible, and vLLM 0.32 makes them possible on
every KV consumer (``VllmConfig._resolve_mm_embedding_inputs`` turns ``enable_mm_embeds``
on when ``kv_role`` is ``kv_consumer`` or ``kv_both``, even at ``--limit-mm-per-prompt
'{"image":0}'``), so with GlmCacheConnector and no tokenizer vLLM's default
(``requires_tokenizer = True``) stopped the engine at start-up ("Glm5NextImageProcessing
requires a tokenizer and cannot be initialized when `skip_tokenizer_init=True`"). Without a
tokenizer the chat API refuses every request (vLLM 0.32: a 500 with an empty message, the
reason in the log), so an image reaches the model only as token ids (its
``<|begin_of_image|><|image|><|end_of_image|>`` ids) with its data, through vLLM's offline
API or its token-in/token-out ``/inference/v1/generate`` route; the connector names it by
its processed tensors as with a tokenizer (:mod:`connector.media`). Checked by
``tests/engine/test_skip_tokenizer_init_e2e.py`` (the engine starts, token-id prompts resume
from glm-cache-server, the processor profiles an image without a tokenizer).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.parse import ImageSize
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
)

if TYPE_CHECKING:
    from transformers import Glm5NextImageProcessorPil
    from vllm.multimodal.processing import ProcessorInputs

logger = logging.getLogger("vllm.glm5next_plugin.multimodal")

IMAGE_PLACEHOLDER = "<|begin_of_image|><|image|><|end_of_image|>"
VIDEO_REFUSAL = (
    "glm5next plugin: video inputs are not supported yet (images are); send the frames as images"
)


@lru_cache(maxsize=8)
def _image_processor(path: str, revision: str | None, overrides: str):
    from transformers import Glm5NextImageProcessorPil

    try:
        proc = Glm5NextImageProcessorPil.from_pretrained(path, revision=revision)
    except OSError:  # no processor configuration in the checkpoint
        logger.warning(
            "glm5next plugin: %s has no image processor configuration (preprocessor_config.json); "
            "using transformers' Glm5NextImageProcessorPil defaults",
            path,
        )
        proc = Glm5NextImageProcessorPil()
    for key, value in json.loads(overrides).items():
        if hasattr(proc, key):
            setattr(proc, key, value)
    return proc


def _image_kwarg_names() -> set[str]:
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorKwargs

    # the names only (its base's annotations refer to types imported for type checking)
    return {name for cls in Glm5NextImageProcessorKwargs.__mro__ for name in getattr(cls, "__annotations__", {})}


class Glm5NextProcessingInfo(BaseProcessingInfo):
    """Geometry of image inputs: the image processor, token counts, the largest image."""

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}

    def validate_num_items(self, modality: str, num_items: int) -> None:
        if modality.startswith("video"):
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(VIDEO_REFUSAL, parameter=modality)
        super().validate_num_items(modality, num_items)

    def get_image_processor(self, **kwargs: object) -> Glm5NextImageProcessorPil:
        merged = self.ctx.get_merged_mm_kwargs(kwargs)
        names = _image_kwarg_names()
        overrides = {k: v for k, v in merged.items() if k in names}
        mc = self.ctx.model_config
        return _image_processor(str(mc.model), mc.revision, json.dumps(overrides, sort_keys=True, default=str))

    def get_hf_processor(self, **kwargs: object) -> Glm5NextImageProcessorPil:
        # transformers' Glm5NextProcessor needs torchvision (its video processor); the image
        # processor is all this plugin runs
        return self.get_image_processor(**kwargs)

    def get_supported_mm_processor_kwargs(self) -> dict[str, set[str]]:
        return {"text_kwargs": set(), "images_kwargs": _image_kwarg_names()}

    def _factor(self, proc) -> int:
        return proc.patch_size * proc.merge_size * getattr(proc, "patch_expand_factor", 1)

    def get_num_image_tokens(self, *, image_width: int, image_height: int,
                             processor: Glm5NextImageProcessorPil | None = None) -> int:
        proc = processor or self.get_image_processor()
        patches = proc.get_number_of_image_patches(image_height, image_width, {})
        return patches // proc.merge_size**2

    def get_image_size_with_most_features(self) -> ImageSize:
        """A canvas of exactly ``max_image_tokens`` tokens (the most even factorisation)."""
        proc = self.get_image_processor()
        tokens = int(proc.max_image_tokens)
        rows = math.isqrt(tokens)
        while tokens % rows:
            rows -= 1
        factor = self._factor(proc)
        return ImageSize(width=(tokens // rows) * factor, height=rows * factor)

    def get_max_image_tokens(self) -> int:
        size = self.get_image_size_with_most_features()
        return self.get_num_image_tokens(image_width=size.width, image_height=size.height)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        return {"image": self.get_max_image_tokens()} if mm_counts.get("image", 0) else {}


class Glm5NextDummyInputs(BaseDummyInputsBuilder[Glm5NextProcessingInfo]):
    """Profiling inputs: each image at the size with the most tokens."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMAGE_PLACEHOLDER * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int],
                          mm_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        size = self.info.get_image_size_with_most_features()
        options = (mm_options or {}).get("image") if mm_options else None
        return {
            "image": self._get_dummy_images(
                width=size.width, height=size.height, num_images=mm_counts.get("image", 0), overrides=options
            )
        }


class Glm5NextImageProcessing(BaseMultiModalProcessor[Glm5NextProcessingInfo]):
    """Images through ``Glm5NextImageProcessorPil``; each ``<|image|>`` of the prompt
    becomes that image's number of ``<|image|>`` tokens."""

    # token ids in, token ids out: no step decodes or encodes text (module docstring)
    requires_tokenizer = False

    def get_dummy_inputs(self, seq_len: int, mm_counts: Mapping[str, int],
                         mm_options: Mapping[str, Any] | None = None) -> ProcessorInputs:
        inputs = super().get_dummy_inputs(seq_len, mm_counts, mm_options)
        if self.info.ctx.tokenizer is None:  # vLLM leaves the prompt empty: no placeholder to expand
            cfg = self.info.get_hf_config()
            names = ("image_start_token_id", "image_token_id", "image_end_token_id")
            marker = [int(getattr(cfg, n)) for n in names if getattr(cfg, n, None) is not None]
            inputs.prompt = marker * mm_counts.get("image", 0)
        return inputs

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]):
        data = dict(hf_data)
        if data.pop("videos", None):
            raise ValueError(VIDEO_REFUSAL)
        data.pop("text", None)
        images = data.pop("images", None)
        proc = self.info.get_image_processor(**hf_kwargs)
        return self.info.ctx.call_hf_processor(proc, {"images": images}, {})

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs: Mapping[str, object]):
        grid = hf_inputs.get("image_grid_thw", torch.empty((0, 3), dtype=torch.long))
        return {
            # every image's patches are one slice of the flat patch tensor
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", grid.prod(-1)),
            "image_grid_thw": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
        }

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs: Mapping[str, Any], out_mm_kwargs) -> Sequence:
        image_token_id = int(self.info.get_hf_config().image_token_id)
        merge = self.info.get_image_processor(**hf_processor_mm_kwargs).merge_size

        def image_tokens(item_idx: int) -> list[int]:
            grid = out_mm_kwargs["image"][item_idx]["image_grid_thw"].data
            return [image_token_id] * (int(grid.prod()) // merge**2)

        return [PromptReplacement(modality="image", target=[image_token_id], replacement=image_tokens)]
