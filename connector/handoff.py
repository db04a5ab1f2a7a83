"""Prefill/decode disaggregation through glm-cache-server: the hand-off of one prompt.

vLLM's PD convention (its NIXL connector and its disaggregation proxy): a proxy sends the
prompt to a prefill instance with ``kv_transfer_params {"do_remote_decode": true}`` and
``max_tokens`` 1, then sends it to a decode instance with what the prefill response's
``kv_transfer_params`` returned (here ``{"glm_handoff": true}``; ``do_remote_prefill``
also marks a decode-side request). Through this connector both
instances share one server, so the decode instance resumes from the chunks the prefill
saved; what a hand-off adds is the part a strict-prefix chunk hit leaves to recompute.

What vLLM lets a connector do, and what it does not (vLLM 0.32 and 0.33):

* The decode instance always computes at least the prompt's last token: a load that covers
  the whole prompt is cut one token short (``Scheduler._update_waiting_for_remote_kv``), to
  get that token's logits. A recurrent state cannot take that token twice, so the decode
  side needs the KDA state *before* the last prompt token, at ``N - 1``.
* A connector cannot make vLLM end a prefill step one token before the prompt's end, and
  vLLM snapshots recurrent states only where a step ends (align mode). So the prefill
  instance must be given the prompt without its last token: the proxy sends it ``T[:-1]``
  (``validation/pd_proxy.py``). The prefill then ends at ``M = N - 1`` with the state there.
* A resume may end inside a block: vLLM reads a resumed request's recurrent state from the
  block holding its last computed token (``(M - 1) // block``, ``preprocess_mamba``), and
  attention rows past ``M`` are written by the decode step before they are read.

The hand-off of a prompt of ``M`` tokens is one more link after its ``F = M // C`` whole
chunks: key :func:`handoff_key` (the key of chunk ``F - 1``, or the salt, and the ``M - F*C``
tail token ids), objects as a chunk's: per attention group the pages of the blocks holding
the tail (a chunk's size: blocks past the tail repeat the last one and are never loaded),
per state group the state at ``M``. A lookup of the chain ``[k_0 .. k_{F-1}, handoff]``
answers ``F + 1`` when the hand-off is there, and the decode instance loads ``M`` tokens
and computes one. When it is missing (not saved, evicted, another namespace) the lookup
answers at most ``F``: a strict-prefix resume, computed cold past it, never a wait.

The hand-off is an ordinary object under LRU (not pinned: a decode that comes late finds it
evicted and recomputes the tail). Not made (the decode side resumes at the strict prefix):
with a drafter whose cache rows look ahead (the draft row at ``M - 1`` is computed from the
prefill's own sampled token, which names nothing of the decode's prompt), for requests with
images, when the tail has no tokens (``M`` on the grid: the state there is a chunk's).
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connector.requests import RequestState

HANDOFF_TAG = b"glm5next-handoff-v1\0"
# The prefill instance's answer in ``kv_transfer_params`` (its only key: beside a transfer
# connector in vLLM's MultiConnector, ``do_remote_prefill`` and the rest are that one's,
# and vLLM refuses a key two children return): true when it saved a hand-off.
HANDOFF_PARAM = "glm_handoff"
# ... and how deep a chain (whole chunks, then the hand-off) it planned to save. Its saves
# travel after its response (vLLM answers as the step ends, the worker sends from a thread),
# so the decode instance's lookup may come first: it asks again, for at most the
# connector's ``timeout_s``, until the server answers this deep, then resumes from what is
# there.
CHUNKS_PARAM = "glm_chunks"
MAX_CHUNKS_CLAIMED = 1 << 20
HANDOFF_RETRY_S = 0.02  # before the decode side's first repeated lookup; doubling after each
HANDOFF_RETRY_MAX_S = 0.5  # the longest wait between two of them
MAX_HANDOFF_RETRIES = 12  # repeated lookups of one request, whatever its timeout_s (a client sets glm_chunks)


def handoff_retry_delay(retries: int) -> float | None:
    """How long the decode side waits before repeating a hand-off lookup for the
    ``retries``-th time (0: the first repeat), or None once it has repeated
    :data:`MAX_HANDOFF_RETRIES` times: an API client's ``glm_chunks`` cannot make one request
    ask the server every 20 ms for ``timeout_s`` (12 repeats cover about 4 s)."""
    if retries >= MAX_HANDOFF_RETRIES:
        return None
    return min(HANDOFF_RETRY_MAX_S, HANDOFF_RETRY_S * (1 << min(retries, 16)))


def prefill_saves_pending(state: RequestState, depth: int, asked: int, timeout_s: float) -> bool:
    """A decode-side request whose prefill instance planned saves ``glm_chunks`` deep
    got a shallower answer (``depth`` chunks of the ``asked``): those saves may still be on
    their way (they travel after the prefill's response). Ask again shortly (backing off, at
    most :data:`MAX_HANDOFF_RETRIES` times), for at most ``timeout_s``
    from the first answer (its admission restarts with each answer, so this deadline is the
    request's), then resume from what is there."""
    if not state.remote_prefill or depth >= min(asked, state.prefill_chunks):
        return False
    now = time.monotonic()
    if state.prefill_wait_until is None:
        state.prefill_wait_until = now + timeout_s
    delay = handoff_retry_delay(state.prefill_retries)
    if now >= state.prefill_wait_until or delay is None:
        return False
    state.prefill_retries += 1
    state.prefill_retry_at = now + delay
    return True


def handoff_key(prefix_key: bytes | None, tail: Sequence[int], salt: str | None) -> bytes:
    """The 32-byte key of the hand-off after chunk key ``prefix_key`` (None: the prompt is
    shorter than a chunk, and the salt, which every chunk key already carries, names it)."""
    h = hashlib.blake2b(HANDOFF_TAG, digest_size=32)
    if prefix_key is not None:
        h.update(b"k" + prefix_key)
    else:  # the salt's length first: no two (salt, tail) pairs give the same bytes
        salt_bytes = (salt or "").encode("utf-8", "surrogatepass")
        h.update(b"s" + len(salt_bytes).to_bytes(8, "little") + salt_bytes)
    h.update(array("q", tail).tobytes())
    return h.digest()


def handoff_span(tokens: int, chunk_size: int) -> tuple[int, int]:
    """``(whole chunks, tail tokens)`` of a hand-off of ``tokens`` (the prefill's prompt)."""
    return tokens // chunk_size, tokens % chunk_size


def pd_flags(params: Any) -> tuple[bool, bool, int]:
    """``(prefills for a decode instance, decodes after a prefill instance, chunks the
    prefill planned)`` from a request's ``kv_transfer_params``: ``do_remote_decode``;
    ``do_remote_prefill`` or our ``glm_handoff`` (what the prefill instance returned); our
    ``glm_chunks`` (0 when absent). Flags only when exactly JSON ``true``, the count only
    as a JSON integer in ``[0, MAX_CHUNKS_CLAIMED]``: anything else a client sends is no
    (a wrong count only costs that request a wait bounded by ``timeout_s``)."""
    if not isinstance(params, Mapping):
        return False, False, 0
    chunks = params.get(CHUNKS_PARAM)
    if not (type(chunks) is int and 0 <= chunks <= MAX_CHUNKS_CLAIMED):
        chunks = 0
    return (params.get("do_remote_decode") is True,
            params.get("do_remote_prefill") is True or params.get(HANDOFF_PARAM) is True, chunks)
