"""Image prompts: the plugin's vision tower and full model against transformers, and image
prompts through a real vLLM engine (split across prefill steps, resumed from the local
prefix cache inside an image) against the plugin's standalone model.

One engine for the module: float32, prefix caching (align-mode KDA snapshots on the
128-token block), ``max_num_batched_tokens`` 128 so a 64-token image placed after 100 text
tokens is split between the first two prefill steps, and up to 2 images a prompt.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import glm5next_tiny
from testing.engines import random_prompt, stop_engine

# float32 on both sides; measured max |logit diff| 6.2e-4 (one position inside the second image;
# median 3.5e-5) over the 153-token two-image prompt below.
FP32_LOGIT_TOL = 1e-3
# engine (paged, chunked) vs standalone (one pass), float32; as tests/engine/test_plugin_engine.py
FP32_LOGPROB_TOL = 1e-3
BLOCK = 128  # the unified block of the seed-3 checkpoint on CPU (test_plugin_engine checks the grid)
BEGIN, IMAGE, END = 10, 14, 11  # <|begin_of_image|>, <|image|>, <|end_of_image|> in the tiny vocabulary


def _image(seed: int, width: int = 112, height: int = 112) -> Image.Image:
    rs = np.random.RandomState(seed)
    return Image.fromarray(rs.randint(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def processor(ckpt):
    from transformers import Glm5NextImageProcessorPil

    return Glm5NextImageProcessorPil.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def standalone(ckpt):
    from glm5next_plugin.standalone import load_standalone

    return load_standalone(ckpt, vision=True)


def _expand(ids: list[int], processor, images) -> tuple[list[int], dict]:
    """``ids`` with each single ``<|image|>`` expanded to its image's token count, and the
    processed images."""
    px = processor(images=images, return_tensors="pt")
    counts = iter((px["image_grid_thw"].prod(-1) // processor.merge_size**2).tolist())
    out = []
    for t in ids:
        out.extend([IMAGE] * next(counts) if t == IMAGE else [t])
    return out, dict(px)


def _prompt(prefix: int, seed: int, n_images: int = 1, suffix: int = 20) -> list[int]:
    ids = random_prompt(prefix, seed)
    for i in range(n_images):
        ids += [BEGIN, IMAGE, END] + (random_prompt(5, seed + 100 + i) if i + 1 < n_images else [])
    return ids + random_prompt(suffix, seed + 1)


# --- without vLLM ------------------------------------------------------------------------


def test_checkpoint_ships_the_image_processor_and_renders_image_parts(ckpt, processor):
    from transformers import AutoTokenizer

    px = processor(images=[_image(0)], return_tensors="pt")
    assert tuple(px["pixel_values"].shape) == (64, 1176)
    assert px["image_grid_thw"].tolist() == [[1, 8, 8]]  # 16 tokens after the 2x2 merge
    big = processor(images=[_image(1, 1000, 1000)], return_tensors="pt")["image_grid_thw"]
    assert int(big.prod()) // 4 == glm5next_tiny.MAX_IMAGE_TOKENS == 256
    tok = AutoTokenizer.from_pretrained(ckpt)
    content = [{"type": "text", "text": "what is"}, {"type": "image"}, {"type": "image_url", "image_url": {"url": "x"}}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    assert text == "[gMASK]<sop><|user|>\nwhat is" + 2 * "<|begin_of_image|><|image|><|end_of_image|>" + "<|assistant|>\n"
    assert tok("<|begin_of_image|><|image|><|end_of_image|>", add_special_tokens=False)["input_ids"] == [BEGIN, IMAGE, END]


def test_vision_tower_matches_transformers(ckpt):
    """Images of several shapes and a two-frame item, packed in one call: each frame attends
    only to itself, rows come out in the processor's order."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    from glm5next_plugin.vision import VisionTower

    cfg = AutoConfig.from_pretrained(ckpt).vision_config
    weights = {k[len("model.visual."):]: v for k, v in load_file(str(ckpt / "model.safetensors")).items()
               if k.startswith("model.visual.")}
    theirs = Glm5NextVisionModel._from_config(cfg).eval()
    theirs.load_state_dict(weights, strict=True)
    ours = VisionTower(cfg).eval()
    ours.load_state_dict(weights, strict=True)
    grid = torch.tensor([[1, 8, 8], [1, 4, 6], [2, 4, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 1176, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(pixels, grid_thw=grid).pooler_output
        got = ours(pixels, grid)
    assert got.shape == (16 + 6 + 8, cfg.out_hidden_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # the per-frame segments matter: attention across the two frames gives other rows
    with torch.no_grad():
        joined = ours(pixels, [[1, 8, 8], [1, 4, 6], [1, 8, 4]])
    assert (joined[22:] - want[22:]).abs().max() > 1e-2


def test_image_prompt_logits_match_transformers(ckpt, processor, standalone):
    """Two images (16 and 88 tokens) in a prompt: the plugin's float32 logits against
    ``transformers.Glm5NextForConditionalGeneration``'s."""
    from transformers import Glm5NextForConditionalGeneration

    theirs = Glm5NextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    images = [_image(0), _image(1, 300, 200)]
    ids, px = _expand(_prompt(20, seed=1, n_images=2), processor, images)
    assert ids.count(IMAGE) == 16 + 88  # 8x8 and 16x22 patches
    x = torch.tensor(ids)
    with torch.no_grad():
        want = theirs(input_ids=x[None], pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"]).logits[0]
        embeds = standalone.embeddings(x, px["pixel_values"], px["image_grid_thw"])
        got = standalone.lm_head(standalone.model.language_model(None, embeds))
        text_only = theirs(input_ids=x[None]).logits[0]
    diff = (got - want).abs().max().item()
    print(f"image prompt parity: max |logit diff| = {diff:.3g} over {len(ids)} positions")
    assert diff < FP32_LOGIT_TOL
    assert (text_only - want).abs().max() > 1.0  # the images are in the comparison


def test_different_images_give_clearly_different_next_token_logits(processor, standalone):
    ids = _prompt(12, seed=2)
    out = []
    for img in (_image(10), _image(11), Image.new("RGB", (112, 112), (255, 0, 0))):
        full, px = _expand(ids, processor, [img])
        with torch.no_grad():
            out.append(standalone.logprobs(torch.tensor(full), px["pixel_values"], px["image_grid_thw"])[-1])
    for a in range(3):
        for b in range(a + 1, 3):
            assert (out[a] - out[b]).abs().max() > 1.0
    # image embeddings are about as large as token embeddings (the checkpoint's merger gain)
    full, px = _expand(ids, processor, [_image(10)])
    with torch.no_grad():
        rows = standalone.model.visual(px["pixel_values"], px["image_grid_thw"])
    assert 0.5 < rows.std().item() < 2.0


def test_merge_replaces_exactly_the_marked_rows_in_order():
    from glm5next_plugin.model import merge_image_embeddings

    embeds = torch.zeros(6, 2)
    mask = torch.tensor([False, True, True, False, True, False])
    parts = [torch.tensor([[1.0, 1.0], [2.0, 2.0]]), torch.tensor([[3.0, 3.0]])]
    got = merge_image_embeddings(embeds, parts, mask)
    assert got[:, 0].tolist() == [0, 1, 2, 0, 3, 0]
    assert embeds.abs().sum() == 0  # the token embeddings are not written in place
    with pytest.raises(ValueError, match="2 image embeddings"):
        merge_image_embeddings(embeds, parts[:1], mask)


# --- inside a vLLM engine ----------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(ckpt):
    from vllm import LLM

    engine = LLM(
        model=str(ckpt),
        dtype="float32",
        gpu_memory_utilization=0.15,
        max_model_len=4096,
        max_num_batched_tokens=BLOCK,
        enable_prefix_caching=True,
        limit_mm_per_prompt={"image": 2},
        seed=0,
    )
    yield engine
    stop_engine(engine)
    del engine


def _generate(llm, ids, images, **params):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, ignore_eos=True, **{"max_tokens": 6, **params})
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
    return llm.generate([prompt], sp, use_tqdm=False)[0]


@pytest.mark.engine
def test_engine_is_multimodal_with_the_tower(llm):
    cfg = llm.llm_engine.vllm_config
    assert cfg.model_config.is_multimodal_model
    assert cfg.cache_config.mamba_cache_mode == "align"
    assert cfg.scheduler_config.max_num_batched_tokens == BLOCK
    assert not cfg.scheduler_config.disable_chunked_mm_input


@pytest.mark.engine
def test_image_split_across_prefill_steps_matches_standalone(llm, processor, standalone):
    """100 text tokens, then a 224x224 image (64 tokens at positions 101..164): the first
    128-token step holds 27 of its tokens, the second the other 37. Prompt log-probs at
    every position and the greedy continuation equal the one-pass standalone model's."""
    ids = _prompt(100, seed=5)
    img = _image(20, 224, 224)
    out = _generate(llm, ids, [img], prompt_logprobs=1, logprobs=1)
    full, px = _expand(ids, processor, [img])
    assert out.prompt_token_ids == full
    start = full.index(IMAGE)
    assert (start, full.count(IMAGE)) == (101, 64) and start < BLOCK < start + 64
    seq = list(full)
    with torch.no_grad():
        ref = standalone.logprobs(torch.tensor(seq), px["pixel_values"], px["image_grid_thw"])
    diffs = [abs(lp.logprob - ref[pos, tok].item()) for pos, entry in enumerate(out.prompt_logprobs[1:])
             for tok, lp in entry.items()]
    assert len(diffs) >= len(full) - 1 and max(diffs) < FP32_LOGPROB_TOL
    # the images are in it: the text-only model gives other log-probs on the image's positions
    with torch.no_grad():
        text_only = standalone.logprobs(torch.tensor(seq))
    assert (text_only[start:] - ref[start:]).abs().max() > 1.0
    c = out.outputs[0]
    for tok, lp in zip(c.token_ids, c.logprobs):
        with torch.no_grad():
            step = standalone.logprobs(torch.tensor(seq), px["pixel_values"], px["image_grid_thw"])[-1]
        assert tok == int(step.argmax())
        assert abs(lp[tok].logprob - step[tok].item()) < FP32_LOGPROB_TOL
        seq.append(tok)


@pytest.mark.engine
def test_prefix_cache_hit_resumes_inside_the_image(llm, processor):
    """The same image prompt twice: the second resumes from the local cache at the block
    boundary 128, 27 tokens into the image (vLLM gathers the image's embeddings from 128 on),
    with the same tokens and log-probs; the same text with another image does not hit."""
    ids = _prompt(100, seed=6)
    img = _image(30, 224, 224)
    first = _generate(llm, ids, [img], logprobs=1, max_tokens=8)
    second = _generate(llm, ids, [img], logprobs=1, max_tokens=8)
    assert (first.num_cached_tokens or 0) == 0
    assert second.num_cached_tokens == BLOCK
    start = first.prompt_token_ids.index(IMAGE)
    assert start < BLOCK < start + 64
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    a = [lp[t].logprob for t, lp in zip(first.outputs[0].token_ids, first.outputs[0].logprobs)]
    b = [lp[t].logprob for t, lp in zip(second.outputs[0].token_ids, second.outputs[0].logprobs)]
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    other = _generate(llm, ids, [_image(31, 224, 224)], logprobs=1, max_tokens=8)
    assert (other.num_cached_tokens or 0) == 0  # the first block holds image tokens
    assert other.outputs[0].token_ids != first.outputs[0].token_ids or max(
        abs(lp[t].logprob - x) for t, lp, x in zip(other.outputs[0].token_ids, other.outputs[0].logprobs, a)
    ) > 1e-2


@pytest.mark.engine
def test_two_images_in_one_prompt_match_standalone_and_a_third_is_refused(llm, processor, standalone):
    ids = _prompt(30, seed=7, n_images=2)
    images = [_image(40), _image(41, 300, 200)]
    out = _generate(llm, ids, images, prompt_logprobs=1, max_tokens=1)
    full, px = _expand(ids, processor, images)
    assert out.prompt_token_ids == full
    with torch.no_grad():
        ref = standalone.logprobs(torch.tensor(full), px["pixel_values"], px["image_grid_thw"])
    diffs = [abs(lp.logprob - ref[pos, tok].item()) for pos, entry in enumerate(out.prompt_logprobs[1:])
             for tok, lp in entry.items()]
    assert max(diffs) < FP32_LOGPROB_TOL
    with pytest.raises(Exception, match="At most 2 image"):
        _generate(llm, _prompt(10, seed=8, n_images=3), [_image(1), _image(2), _image(3)])


@pytest.mark.engine
def test_video_is_refused_clearly(llm):
    from vllm import SamplingParams

    video = np.zeros((4, 56, 56, 3), dtype=np.uint8)
    prompt = {"prompt_token_ids": [12, IMAGE, 13] + random_prompt(5, 9), "multi_modal_data": {"video": [video]}}
    with pytest.raises(Exception, match="video inputs are not supported"):
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
