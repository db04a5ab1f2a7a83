"""A cached object is shared only with engines whose weights, model config and engine
(vLLM version, device family) are the same: all of it is in the namespace."""

from __future__ import annotations

import gc
import shutil
import time
from types import SimpleNamespace

import pytest

import glm5next_tiny
from cache_server.client import CacheClient
from connector.identity import UnnamedWeights, engine_identity, weights_digest
from testing.engines import connector_engine, generate_one, random_prompt, stop_engine

C = 256


def _checkpoint(path, seed):
    glm5next_tiny.main([str(path), "--seed", str(seed)])
    return path


def test_weights_are_named_by_their_content_not_their_path(tmp_path):
    """Two checkpoints of one shape (the same config, index and headers) at one path get
    different digests; the same bytes written again get the same one."""
    a = weights_digest(_checkpoint(tmp_path / "m", 3))
    shutil.rmtree(tmp_path / "m")
    b = weights_digest(_checkpoint(tmp_path / "m", 4))
    shutil.rmtree(tmp_path / "m")
    assert a != b
    assert weights_digest(_checkpoint(tmp_path / "m", 3)) == a
    assert weights_digest(_checkpoint(tmp_path / "copy", 3)) == a  # the path is not the name


def test_a_fine_tune_of_one_tensor_changes_the_digest(tmp_path):
    """A training step changes nearly every element of a tensor it touches: the samples at
    every tensor's start, middle and end see an update of any single tensor."""
    from safetensors.torch import load_file, save_file

    ckpt = _checkpoint(tmp_path / "m", 3)
    (path,) = sorted(ckpt.glob("*.safetensors"))
    before = weights_digest(ckpt)
    tensors = load_file(str(path))
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name] * 1.001 + 1e-6
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert weights_digest(ckpt) != before


def _model_config(path, **fields):
    hf = fields.pop("hf", {})
    config = {"model": str(path), "revision": None, "quantization": None, "hf_overrides": None,
              "code_revision": None, **fields}
    return SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: {"model_type": "glm5_next", **hf}), **config)


def test_the_identity_names_config_quantization_overrides_and_the_engine(tmp_path):
    ckpt = _checkpoint(tmp_path / "m", 3)
    base = engine_identity(_model_config(ckpt))
    import vllm

    assert base["vllm"] == vllm.__version__ and base["device"][0] == "cpu"
    assert engine_identity(_model_config(ckpt)) == base
    for changed in (_model_config(ckpt, hf={"rope_theta": 5e5}), _model_config(ckpt, hf_overrides={"rope_theta": 5e5}),
                    _model_config(ckpt, quantization="fp8")):
        assert engine_identity(changed) != base


def test_weights_that_cannot_be_named_are_not_cached(tmp_path, server, monkeypatch):
    """No weight files where the model should be: the identity cannot name them, so the
    engine serves without the external cache (never under a partial name)."""
    import testing.sched_harness as harness

    with pytest.raises(UnnamedWeights):
        engine_identity(_model_config(tmp_path))
    named = harness.scheduler_side(server.url, block=C)
    assert named.remote.usable() and named.namespace
    named.shutdown()
    monkeypatch.setattr(harness, "weights_dir", lambda: tmp_path)
    unnamed = harness.scheduler_side(server.url, block=C)
    try:
        assert not unnamed.remote.usable() and unnamed.namespace == ""
    finally:
        unnamed.shutdown()


def test_drafts_are_cached_under_their_own_name_and_unnameable_drafters_are_refused(server):
    """MTP's draft rows (in the attention objects) depend on the token after a chunk: an
    engine with MTP drafts is cached under a namespace of its own (the identity names the
    method, draft length and lookahead; the MTP layers are the target's weights), and its
    keys cover that token. n-gram drafts write no cache rows: the drafts-off namespace and
    keys. A drafter the identity cannot name (``custom_class``: any code; ``dflash``:
    fill-in drafting) serves without the external cache rather than under a partial
    name. (Keys and the rest: tests/server/test_connector_drafts.py.)"""
    import testing.sched_harness as harness

    made = []

    def side(**kw):
        made.append(harness.scheduler_side(server.url, block=C, **kw))
        return made[-1]

    try:
        plain = side()
        mtp, ngram = side(speculative=harness.drafts("mtp", 1)), side(speculative=harness.drafts("ngram", 3))
        assert plain.remote.usable() and plain.namespace
        assert mtp.remote.usable() and mtp.namespace not in ("", plain.namespace)
        assert (plain.keys.lookahead, mtp.keys.lookahead, ngram.keys.lookahead) == (0, 1, 0)
        assert ngram.remote.usable() and ngram.namespace == plain.namespace
        for method in ("custom_class", "dflash"):
            refused = side(speculative=harness.drafts(method, 2))
            assert not refused.remote.usable() and refused.namespace == ""
    finally:
        for s in made:
            s.shutdown()


def _objects(url: str) -> int:
    with CacheClient(url, timeout_s=60) as c:
        return c.stats()["objects"]


@pytest.mark.engine
def test_new_weights_at_the_same_path_never_resume_from_the_old_ones(tmp_path, server):
    """An operator replaces the checkpoint at a mounted path with another of the same shape
    and restarts vLLM: the new engine finds none of the old engine's objects, and its
    output is its own cold run's."""
    ckpt = _checkpoint(tmp_path / "model", 3)
    prompt = random_prompt(1500, 21)
    args = dict(dtype="float32", max_num_batched_tokens=C, prefix_cache_retention_interval=C, seed=0)

    llm = connector_engine(ckpt, server.url, **args)
    old, _, _ = generate_one(llm, prompt, "weights", 16)
    deadline = time.monotonic() + 60
    while _objects(server.url) < 1500 // C and time.monotonic() < deadline:
        time.sleep(0.2)  # its saves leave from a background thread
    held = _objects(server.url)
    assert held >= 1500 // C, f"the old engine's prefix is not on the server after 60 s ({held} objects)"
    stop_engine(llm)
    del llm
    gc.collect()

    shutil.rmtree(ckpt)
    _checkpoint(ckpt, 4)
    llm = connector_engine(ckpt, server.url, **args)
    try:
        new, _, cached = generate_one(llm, prompt, "weights", 16)
        assert cached == 0  # nothing resumed from the old weights' objects
        llm.reset_prefix_cache()
        cold, _, cold_cached = generate_one(llm, prompt, "weights-cold", 16)
        assert cold_cached == 0
        assert new == cold
        assert new != old  # the weights differ enough that a resume would have shown
    finally:
        stop_engine(llm)
        del llm
        gc.collect()
