"""Speculative decoding and the cache: a drafter's rows look ahead (issue 23).

An EAGLE/MTP layer writes its cache row at position p from the target's hidden state at p
and token p + 1, and vLLM keeps that layer in the target's sparse-MLA KV group, so the
row at a chunk's last position depends on the first token after the chunk. Its key (a
hash of the prefix up to the chunk's end) must cover that token, or two prompts forking
exactly at a chunk boundary would share a row computed from the other continuation. The
draft also joins the namespace; n-gram drafts cache nothing of theirs and change nothing.

A real glm-cache-server process; the scheduler side is built without an engine from
hand-made vLLM configs and real vLLM requests (testing/sched_harness.py); saves are
planned by the real scheduler side and stored as the worker side would store them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from blake3 import blake3

from cache_server.chunk_keys import chunk_hashes
from connector.drafts import check_nameable, draft_identity
from connector.geometry import strict_prefix_chunks
from testing import sched_harness as harness
from testing.sched_harness import Blocks, drafts, request, step, store
from testing.vllm_keys import vllm_chunk_keys

C = 256  # the shared server fixture's minimum chunk (conftest.py)
SCHEMES = ("lmcache", "vllm")  # the token chain, vLLM's block hashes



def _req(req_id, tokens, salt, scheme):
    return request(req_id, tokens, salt, hash_block=C if scheme == "vllm" else None)


def _plain(tokens, salt, scheme):
    """The drafts-off keys of the whole chunks of ``tokens``."""
    if scheme == "vllm":
        return vllm_chunk_keys(tokens, C, C, salt)
    return chunk_hashes(tokens, C, salt)


def _lookahead(plain_key: bytes, after: list[int]) -> bytes:
    """The documented formula, written out: blake3(tag || uint32_be(L) || key || tokens)."""
    data = b"glm-cache-lookahead:" + len(after).to_bytes(4, "big") + plain_key
    return blake3(data + b"".join(t.to_bytes(4, "big") for t in after)).digest()


def _answer(side, req, computed=0):
    first = side.get_num_new_matched_tokens(req, computed)
    if first[0] is not None:
        return first
    side._requests[req.request_id].lookup.future.result()
    return side.get_num_new_matched_tokens(req, computed)


# A prompt of 1100 tokens and another forking from it exactly at the end of its third
# chunk (token 768): their first three chunks are the same tokens.
BASE = list(range(10_000, 11_100))
FORK = BASE[:3 * C] + list(range(20_000, 20_332))
SAME_NEXT = BASE[:3 * C + 1] + list(range(30_000, 30_331))  # forks one token later


@pytest.mark.parametrize("scheme", SCHEMES)
def test_lookahead_keys_name_the_token_after_the_chunk(sides, scheme):
    """With MTP, chunk j's key is the formula over its drafts-off key and token (j+1)C:
    it differs for a prompt whose next token differs and matches one whose next token is
    the same. The control: the drafts-off keys of the fork are the same at that chunk, so
    without the rule the fork would share the chunk's draft row."""
    side = sides(chunk_keys=scheme, speculative=drafts("mtp", 1))
    assert side.keys.lookahead == 1 and (side.keys.scheme.span is not None) == (scheme == "vllm")
    keys = {name: side.request_keys(_req(name, tokens, "s", scheme), 4)
            for name, tokens in (("base", BASE), ("fork", FORK), ("same", SAME_NEXT))}
    plain = _plain(BASE, "s", scheme)
    assert keys["base"] == [_lookahead(plain[j], [BASE[(j + 1) * C]]) for j in range(4)]
    assert keys["fork"][:2] == keys["base"][:2]  # tokens 256 and 512 are the same
    assert keys["fork"][2] != keys["base"][2]  # token 768 differs
    assert keys["same"][:3] == keys["base"][:3]  # token 768 is the same
    assert keys["same"][3] != keys["base"][3]
    # the control: the plain keys cannot tell the fork apart at its third chunk
    assert _plain(FORK, "s", scheme)[:3] == plain[:3]
    assert not set(keys["base"]) & set(plain)  # never the drafts-off keys


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("rule", [True, False], ids=["lookahead", "rule-removed"])
def test_a_fork_at_a_chunk_boundary_never_resumes_from_the_other_continuation(sides, server, rule, scheme):
    """A writer saves its prompt (attention chunks, and the KDA state at 768, where vLLM
    snapshots it with MTP); a prompt forking exactly there asks for four chunks. With the
    lookahead it resumes nowhere: the chunk ending at 768 holds a draft row computed from
    the writer's token 768. One forking a token later resumes at 768. With the rule
    removed (keys without the lookahead) the fork resumes at 768 too: the bug."""
    salt = f"fork-{rule}-{scheme}"
    writer, reader = (sides(chunk_keys=scheme, speculative=drafts("mtp", 1)) for _ in range(2))
    if not rule:
        writer.keys.lookahead = reader.keys.lookahead = 0
    _save_prompt(writer, server, "w", BASE, salt, [3 * C], scheme)
    assert _answer(reader, _req("fork", FORK, salt, scheme)) == ((0, False) if rule else (3 * C, True))
    assert _answer(reader, _req("same", SAME_NEXT, salt, scheme)) == (3 * C, True)


def _save_prompt(side, server, req_id, tokens, salt, state_boundaries, scheme):
    """Admit ``tokens`` cold, run its prefill in one step with vLLM offering the states at
    ``state_boundaries``, and store the planned saves; returns the request and its blocks."""
    req = _req(req_id, tokens, salt, scheme)
    blocks = Blocks().bind(side)
    assert _answer(side, req) == (0, False)
    alloc = blocks.allocate(req_id, -(-len(tokens) // C))
    side.update_state_after_alloc(req, alloc, 0)
    offers = [(0, alloc.blocks[0][b // C - 1].block_id, b) for b in state_boundaries]
    meta = step(side, {req_id: (0, len(tokens))}, {req_id: offers})
    assert set(store(server.url, side.namespace, meta.saves)) <= {"stored"}
    return req, blocks, meta


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_prompt_ending_on_a_chunk_end_saves_that_chunk_once_the_next_token_is_known(sides, server, scheme):
    """A 768-token prompt: its third chunk's draft row at 767 is computed from the first
    generated token, so that chunk has no key during prefill, is not saved, and no lookup
    needs it (strict prefix: chunks strictly before token 767). The step after the token
    is sampled saves it, under a key covering that token; nothing else (save_decode off)."""
    side = sides(chunk_keys=scheme, speculative=drafts("mtp", 1))
    tokens = BASE[:3 * C]
    salt = f"end-{scheme}"
    req, blocks, meta = _save_prompt(side, server, "end", tokens, salt, [], scheme)
    plain = _plain(tokens, salt, scheme)
    assert [m.chunk_hash for m in meta.saves] == [_lookahead(plain[j], [tokens[(j + 1) * C]]) for j in range(2)]
    assert side.keys.known_chunks(req, C) == 2 and len(side.request_keys(req, 3)) == 2
    # The lookup asks only chunks that have keys: the strict prefix (2 chunks) is all of them.
    resend = _req("resend", tokens, salt, scheme)
    assert _answer(side, resend) == (0, False)  # no state saved: no resume point
    asked = side._requests["resend"].lookup.question[3]
    assert asked == strict_prefix_chunks(len(tokens), C) == side.keys.known_chunks(resend, C) == 2

    req.append_output_token_ids(77)  # the first generated token
    meta = step(side, {"end": (3 * C, 1)})
    assert [m.chunk_hash for m in meta.saves] == [_lookahead(plain[2], [77])]
    assert meta.saves[0].parent == _lookahead(plain[1], [tokens[2 * C]])
    for t in range(78, 78 + C + 1):  # a whole generated chunk and its next token: not saved
        req.append_output_token_ids(t)
    assert step(side, {"end": (3 * C + 1, C + 1)}).saves == []


@pytest.mark.parametrize("scheme", SCHEMES)
def test_ngram_drafts_keep_the_drafts_off_keys_and_namespace(sides, scheme):
    """n-gram drafting writes no cache rows: the bytes are the target's, so keys and
    namespace are the drafts-off ones (its engines share objects with drafts-off ones)."""
    off, ngram = sides(chunk_keys=scheme), sides(chunk_keys=scheme, speculative=drafts("ngram", 4))
    assert ngram.keys.lookahead == 0 and ngram.namespace == off.namespace
    expected = _plain(BASE, "n", scheme)
    assert ngram.request_keys(_req("a", BASE, "n", scheme), 4) == off.request_keys(_req("b", BASE, "n", scheme), 4)
    assert ngram.request_keys(_req("c", BASE, "n", scheme), 4) == expected
    assert ngram.request_keys(_req("d", BASE[:3 * C], "n", scheme), 3) == expected[:3]  # no lookahead wait


def _draft_weights(path, seed):
    import torch
    from safetensors.torch import save_file

    path.mkdir()
    save_file({"w": torch.arange(64, dtype=torch.float32) * seed}, str(path / "model.safetensors"))
    return path


def test_namespaces_differ_across_draft_method_length_lookahead_and_weights(sides, tmp_path):
    """Every draft setting the bytes may depend on is in the namespace: the method, the
    draft length, the lookahead (a chain of two MTP modules reads two tokens ahead) and a
    separate draft model's weights (by content); MTP layers of the target are named by the
    target's weights. Drafts off, n-gram: the one drafts-off namespace."""
    a, b = _draft_weights(tmp_path / "a", 1), _draft_weights(tmp_path / "b", 2)
    target = SimpleNamespace(model=str(harness.weights_dir()), revision=None)
    two_modules = drafts("mtp", 2, draft_model_config=SimpleNamespace(
        model=target.model, revision=None, hf_config=SimpleNamespace(num_nextn_predict_layers=2)))
    configs = {
        "off": None,
        "mtp1": drafts("mtp", 1),
        "mtp2": drafts("mtp", 2),
        "mtp2-two-modules": two_modules,
        "eagle-a": drafts("eagle", 2, draft_model=a),
        "eagle-b": drafts("eagle", 2, draft_model=b),
        "eagle3-a": drafts("eagle3", 2, draft_model=a),
        "draft_model-a": drafts("draft_model", 2, draft_model=a),
    }
    made = {name: sides(speculative=spec) for name, spec in configs.items()}
    assert all(s.namespace for s in made.values())
    assert len({s.namespace for s in made.values()}) == len(configs)
    assert {name: s.keys.lookahead for name, s in made.items()} == {
        "off": 0, "mtp1": 1, "mtp2": 1, "mtp2-two-modules": 2, "eagle-a": 1, "eagle-b": 1, "eagle3-a": 1,
        "draft_model-a": 1,
    }
    assert sides(speculative=drafts("ngram", 5)).namespace == made["off"].namespace

    def identity(spec):
        return draft_identity(check_nameable(SimpleNamespace(model_config=target, speculative_config=spec)))

    assert identity(None) is None and identity(drafts("ngram", 5)) is None
    assert identity(configs["mtp1"]) == {"method": "mtp", "num_speculative_tokens": 1, "lookahead": 1,
                                         "weights": "target", "config": None, "quantization": None,
                                         "hf_overrides": None}
    assert identity(configs["eagle-a"])["weights"] not in ("target", identity(configs["eagle-b"])["weights"])


@pytest.mark.parametrize("spec", [
    drafts("custom_class", 2),
    drafts("dflash", 4),
    drafts("extract_hidden_states", 1),
    drafts("mtp", 1, disable_eagle_block_drop=True),
    drafts("eagle", 2),  # a separate draft without a model config: its weights cannot be named
    # vLLM's default drafter batch: a partial prefill's last draft row comes from the prompt's
    # last token (tests/engine/test_connector_drafts_e2e.py measures what that does to a fork)
    drafts("mtp", 2, disable_padded_drafter_batch=False),
], ids=["custom_class", "dflash", "extract_hidden_states", "mtp-no-block-drop", "eagle-unnamed", "mtp-padded-batch"])
def test_drafters_identity_cannot_name_serve_without_the_cache(sides, spec):
    side = sides(speculative=spec)
    assert not side.remote.usable() and side.namespace == ""


def test_glm_on_the_padded_drafter_batch_is_cached_when_its_rows_are_exact(sides):
    """GLM-5.3-Flash's padded-batch draft rows come from the next prompt token once the
    plugin's fix is installed (glm5next_plugin.draft_rows, installed by the plugin in every
    vLLM process; tests/engine/test_connector_drafts_e2e.py shows the rows): the default batch is
    cached there, under the same namespace as vLLM's other (non-padded) path, whose rows
    are the same. Another model on the padded batch still serves without the cache."""
    from glm5next_plugin.draft_rows import install

    assert install()
    glm = ("Glm5NextForConditionalGeneration",)
    padded = sides(speculative=drafts("mtp", 2, disable_padded_drafter_batch=False), architectures=glm)
    unpadded = sides(speculative=drafts("mtp", 2), architectures=glm)
    assert padded.remote.usable() and padded.keys.lookahead == 1
    assert padded._fingerprint == unpadded._fingerprint
    other = sides(speculative=drafts("mtp", 2, disable_padded_drafter_batch=False), architectures=("Qwen3NextForCausalLM",))
    assert not other.remote.usable()


def test_with_drafts_the_start_up_line_names_the_retention_flag(sides, caplog):
    """vLLM keeps a drafter's prompt states one block early; only its retention keeps one at
    every chunk: without it, the start-up line says which flag gives hits at the strict prefix."""
    import logging
    import time

    def handshake(side):
        deadline = time.monotonic() + 60
        while not side._ready():
            assert time.monotonic() < deadline, "no handshake"
            time.sleep(0.01)

    with caplog.at_level(logging.WARNING, logger="vllm.glm_cache_connector"):
        for retention, warned in ((0, True), (2 * C, True), (None, False), (C, False)):
            caplog.clear()
            side = sides(speculative=drafts("mtp", 1), retention=retention)
            handshake(side)
            said = any("--prefix-cache-retention-interval" in r.getMessage() for r in caplog.records)
            assert said == warned, retention
        caplog.clear()
        handshake(sides(retention=0))  # drafts off: the states are where the strict prefix needs them
        assert not any("--prefix-cache-retention-interval" in r.getMessage() for r in caplog.records)


def test_save_decode_with_mtp_is_refused_at_start_up(sides):
    """Decode-time draft rows are written from draft tokens (and overwritten later): a
    decode chunk's bytes match no key, so the combination stops the engine at start-up
    with an error naming both settings. n-gram drafts write no rows: allowed."""
    for spec in (drafts("mtp", 1), drafts("eagle", 1, draft_model=harness.weights_dir())):
        with pytest.raises(ValueError, match=r"save_decode=true .*--speculative-config method '(mtp|eagle)'"):
            sides(speculative=spec, save_decode=True)
    assert sides(speculative=drafts("ngram", 3), save_decode=True).remote.usable()
    assert sides(speculative=drafts("mtp", 1)).remote.usable()


@pytest.mark.parametrize("length", [1100, 1024], ids=["unaligned", "aligned"])
def test_hits_land_where_vllm_snapshots_states_under_the_eagle_block_drop(sides, server, length):
    """With EAGLE/MTP vLLM snapshots a prompt's KDA state one block before where it would
    without drafts (its prefill checkpoint and replay boundaries, computed here by vLLM's
    own functions); those are the states the connector is offered. A resend asks for the
    strict prefix and resumes at the deepest chunk with a state: one chunk before the
    strict-prefix checkpoint for an unaligned prompt, at it for an aligned one. vLLM does
    not drop a block of our hit: the tokens returned are the whole hit, and the load puts
    every chunk's attention and the state at the resume point into the blocks vLLM gave."""
    from vllm.v1.core.kv_cache_coordinator import replay_boundaries
    from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

    tokens = BASE[:length]
    salt = f"eagle-{length}"
    side = sides(speculative=drafts("mtp", 1))
    boundaries = sorted({get_mamba_prefill_checkpoint_position(length, C, True),
                         *(b // C * C for b in replay_boundaries(length, C, use_eagle=True))} - {0})
    strict = strict_prefix_chunks(length, C) * C
    assert boundaries[-1] == (strict - C if length % C else strict)
    assert get_mamba_prefill_checkpoint_position(length, C, False) == strict  # drafts off: at the strict prefix
    _save_prompt(side, server, f"w{length}", tokens, salt, boundaries, "vllm")

    resend = _req(f"r{length}", tokens, salt, "vllm")
    resume = boundaries[-1]
    assert _answer(side, resend) == (resume, True)
    blocks = Blocks().bind(side)
    alloc = blocks.allocate(resend.request_id, resume // C)  # vLLM allocates for the whole hit
    side.update_state_after_alloc(resend, alloc, resume)
    (job,) = step(side, {}).loads
    assert job.refused is None
    keys = side.request_keys(resend, resume // C)
    attn = [(m.chunk_hash, m.block_ids) for m in job.objects if m.group_id == 1]
    assert attn == [(keys[k], [alloc.blocks[1][k].block_id]) for k in range(resume // C)]
    assert [(m.chunk_hash, m.block_ids) for m in job.objects if m.group_id == 0] == [
        (keys[resume // C - 1], [alloc.blocks[0][resume // C - 1].block_id])]
