"""Speculative decoding and the cache: what a drafter puts into the cached bytes.

A drafter whose layers write cache rows (EAGLE, MTP, a draft model) joins the identity with
its method, draft length, lookahead and weights (the target's, for MTP layers shipped in
its checkpoint; otherwise the draft's own, named the same way as the target's:
:mod:`connector.identity`), and its lookahead joins the chunk keys
(:class:`connector.keys.ChunkKeys`). Drafters that cache nothing (n-gram, suffix) leave the
namespace as it is without drafts; the rest is refused (:func:`check_nameable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from connector.identity import Unnameable, UnnamedWeights, config_digest, model_dir, overrides_text, weights_digest

# How far a drafter's cache rows look past their own position (the lookahead L), by
# ``--speculative-config`` method. The hidden-state drafters (EAGLE, EAGLE-3, MTP) compute
# their row at position p from the target's hidden state at p and the embedding of token
# p + 1 (vLLM shifts the draft's input ids by one: ``SpecDecodeBaseProposer
# .set_inputs_first_pass``), and vLLM puts a draft layer whose cache spec equals the
# target's in the target's KV group, so its rows are in our attention objects. A separate
# draft model (``draft_model``) reads unshifted ids, so its prompt rows depend on tokens up
# to p only; it is given L = 1 anyway, which never shares a row wrongly (it only keeps
# prompts that fork exactly at a chunk boundary apart) and, like every drafter with rows,
# refuses decode-time saves (its decode rows are written from draft tokens).
_LOOKAHEAD_DRAFTERS = {"eagle": 1, "eagle3": 1, "mtp": 1, "draft_model": 1}
# Drafters that write nothing into the KV cache: the cached bytes are the target's alone,
# exactly as with drafts off, so neither the keys nor the namespace change.
_CACHELESS_DRAFTERS = frozenset({"ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator"})
# Everything else is refused (not cached): ``custom_class`` (arbitrary proposer code),
# ``extract_hidden_states``, ``dflash`` and ``dspark`` (fill-in drafting: rows at slots
# written from mask tokens, a lookahead not analysed here), and any method vLLM adds later.


@dataclass(frozen=True)
class Drafts:
    """What the engine's speculative decoding puts into the cached bytes.

    ``lookahead`` (L) is how many tokens after its position a draft row depends on: chunk
    keys then cover the L tokens after each chunk (:class:`connector.keys.ChunkKeys`).
    ``draft_model`` is the draft's model config where its weights are not the target's
    (None: no draft model, or the target's own MTP layers)."""

    method: str | None = None
    num_speculative_tokens: int = 0
    lookahead: int = 0
    writes_rows: bool = False  # draft rows land in the cached groups
    draft_model: Any = None


NO_DRAFTS = Drafts()


def _mtp_lookahead(spec: Any, k: int) -> int:
    """One MTP module reads the next token; a chain of several (``num_nextn_predict_layers``
    > 1, used up to k deep) reads up to k tokens ahead, as vLLM's
    ``num_prefill_lookahead_tokens`` says."""
    hf = getattr(getattr(spec, "draft_model_config", None), "hf_config", None)
    modules = int(getattr(hf, "num_nextn_predict_layers", 1) or 1)
    return k if min(modules, k) > 1 else 1


def _is_target(draft: Any, target: Any) -> bool:
    """The draft model config names the target's own checkpoint (MTP layers shipped in it)."""
    if draft is None:
        return True
    if target is None:
        return False
    if (str(draft.model), getattr(draft, "revision", None)) == (str(target.model), getattr(target, "revision", None)):
        return True
    try:
        return model_dir(draft) == model_dir(target)
    except UnnamedWeights:
        return False


def _padded_rows_exact(vllm_config: Any) -> bool:
    """Whether vLLM's padded drafter batch writes the draft row at a partial prefill's end
    from the next prompt token here (GLM-5.3-Flash with the plugin's fix installed)."""
    try:
        from glm5next_plugin.draft_rows import exact_rows
    except ImportError:
        return False
    return exact_rows(vllm_config)


def check_nameable(vllm_config: Any) -> Drafts:
    """What speculative decoding puts into the cached bytes (:class:`Drafts`); raises
    :class:`Unnameable` for what the namespace cannot name: the methods listed above as
    refused, a hidden-state drafter with a separate model that has no config, EAGLE/MTP
    with ``disable_eagle_block_drop`` (vLLM's local hits then keep blocks whose last draft
    row came from another continuation, and the connector would save those rows under keys
    that claim this request's next token), and a lookahead drafter on vLLM's padded drafter
    batch (its default). There, for a request whose prompt is still being prefilled, the
    drafter's input at the step's last position is the request's last known token
    (``prepare_next_token_ids_padded``: ``get_token_id(num_tokens_no_spec - 1)``, the
    prompt's last token), not the token after the step, so the draft row at every partial
    prefill's end depends on how the prompt that computed it ends. Measured on the tiny
    checkpoint: two prompts equal for 2 chunks stored different MTP rows at position 127
    (up to 2.8 apart), and a prompt resumed from the other's chunk drafted differently from
    its cold run at step 54 of 64. ``disable_padded_drafter_batch`` takes vLLM's other path
    (``prepare_next_token_ids_cpu``: the next prompt token), whose rows the lookahead key
    names; SGLang fixed the same defect in its EAGLE worker (sgl-project/sglang#26329). For
    GLM-5.3-Flash the plugin gives the padded path that token too
    (:mod:`glm5next_plugin.draft_rows`), so there vLLM's default batch is cached as well."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return NO_DRAFTS
    method = getattr(spec, "method", None) or type(spec).__name__
    k = int(getattr(spec, "num_speculative_tokens", None) or 0)
    if method in _CACHELESS_DRAFTERS:
        return Drafts(method, k)
    if method not in _LOOKAHEAD_DRAFTERS:
        raise Unnameable(f"speculative decoding ({method}) is not in the cache identity (its draft rows' "
                         f"dependence on later tokens is not known; named: {sorted(_LOOKAHEAD_DRAFTERS)} "
                         f"and, with nothing cached, {sorted(_CACHELESS_DRAFTERS)})")
    if method != "draft_model" and getattr(spec, "disable_eagle_block_drop", False):
        raise Unnameable(f"speculative decoding ({method}) with disable_eagle_block_drop: vLLM's local prefix "
                         "hits keep draft rows computed from another continuation")
    if not getattr(spec, "disable_padded_drafter_batch", False) and not _padded_rows_exact(vllm_config):
        raise Unnameable(
            f"speculative decoding ({method}) with vLLM's padded drafter batch: the draft row at the end of "
            "each partial prefill step is computed from the prompt's last token, not the next one "
            "(prepare_next_token_ids_padded's backup token), so a chunk's rows depend on the rest of the "
            "prompt that computed them; add \"disable_padded_drafter_batch\": true to --speculative-config")
    draft = getattr(spec, "draft_model_config", None)
    target = getattr(vllm_config, "model_config", None)
    if method == "mtp":
        draft = None if _is_target(draft, target) else draft
        lookahead = _mtp_lookahead(spec, k)
    else:
        if draft is None:
            raise Unnameable(f"speculative decoding ({method}) without a draft model config: its weights "
                             "cannot be named")
        draft = None if _is_target(draft, target) else draft
        lookahead = _LOOKAHEAD_DRAFTERS[method]
    return Drafts(method, k, lookahead, True, draft)


def draft_identity(drafts: Drafts) -> dict[str, Any] | None:
    """The namespace's part for the draft: None where nothing of it is cached (drafts off,
    n-gram and other cacheless drafters: the same namespace as without drafts). Raises
    :class:`UnnamedWeights` where a separate draft model's weights cannot be named."""
    if not drafts.writes_rows:
        return None
    draft = drafts.draft_model
    return {
        "method": drafts.method,
        "num_speculative_tokens": drafts.num_speculative_tokens,
        "lookahead": drafts.lookahead,
        # MTP layers in the target's checkpoint: named by the target's weights already
        "weights": "target" if draft is None else weights_digest(model_dir(draft)),
        "config": None if draft is None else config_digest(draft),
        "quantization": None if draft is None else str(getattr(draft, "quantization", None)),
        "hf_overrides": None if draft is None else overrides_text(getattr(draft, "hf_overrides", None)),
    }

