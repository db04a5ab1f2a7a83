"""Which recurrent states vLLM keeps, and so which the connector is offered to save; and the
start-up warnings where those are not where the chunk grid needs them
(:func:`retention_warnings`).

vLLM (align mode) snapshots the state where a prefill step ends on its block grid and keeps
the snapshots its retention policy names (by default the prompt's replay boundary
``N * floor((len-1)/N)``); the scheduler hands each kept one to the connector as a boundary
offload, and it saves those on chunk boundaries. With C == N (production: N is vLLM's
unified block) the replay boundary is the strict-prefix boundary. With C > N, run vLLM with
``--max-num-batched-tokens`` a multiple of C and ``--prefix-cache-retention-interval C``
(one state per chunk) or give the server ``--chunk-size N``; the connector warns otherwise.

Speculative decoding with EAGLE/MTP (vLLM 0.32). vLLM's local prefix cache drops the last
block of a hit for the drafter's groups (``single_type_kv_cache_manager.py:819``, after
matching one block further, ``kv_cache_coordinator.py:857-882``): that block's last draft
row was computed from the writer's next token, which its block hash does not cover
(``kv_cache_coordinator.py:135-146``). The scheduler applies no such drop to our tokens
(``sched/scheduler.py:978-1027`` takes them as returned), allocates blocks for the whole
hit (``allocate_slots(..., num_external_computed_tokens)``, scheduler.py:1262; no
lookahead slots during the async load, :1224) and hands them to
:meth:`connector.scheduler.SchedulerSide.update_state_after_alloc` (:1289). None is needed:
our chunk keys cover the token after each chunk (:func:`cache_server.chunk_keys.lookahead_keys`),
which is what vLLM's drop buys locally. The drop moves vLLM's KDA snapshots one block back
instead: a prompt's prefill checkpoint is ``N_b * floor(len / N_b) - N_b``
(``kv_cache_interface.py:1110``, used at scheduler.py:476) and the retained replay
boundaries are ``{N_b * floor((len-1)/N_b) - N_b, N_b * floor(len/N_b) - N_b}``
(``kv_cache_coordinator.py:65``, Mamba groups told at :177). Those are the states we are
offered and save, and a hit needs a state at its end, so with C == N_b a resend of an
unaligned prompt resumes one chunk before the strict-prefix checkpoint and an aligned one
at it; a state another request saved at the strict-prefix checkpoint is used there. The
lookup is not capped below the strict prefix: with the lookahead in the keys every hit
the server returns is valid for the drafter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from connector.drafts import Drafts
    from connector.geometry import Geometry


def chunk_exceeds_block(geo: Geometry, max_num_batched_tokens: int, retention: int | None) -> str | None:
    """A chunk longer than vLLM's block needs state snapshots vLLM does not keep by
    default: it ends prefill steps, and retains states, on its own block grid only
    (``retention``: vLLM's ``--prefix-cache-retention-interval``, None: dense)."""
    if not geo.state_groups or geo.chunk_size == geo.scheduler_block_size:
        return None
    if max_num_batched_tokens % geo.chunk_size == 0 and retention == geo.chunk_size:
        return None
    C, N = geo.chunk_size, geo.scheduler_block_size
    return (f"GlmCacheConnector: chunk size {C} exceeds vLLM's block {N}, so recurrent state snapshots exist at "
            f"chunk boundaries only where prefill steps end there; set --max-num-batched-tokens to a multiple of "
            f"{C} and --prefix-cache-retention-interval {C} (or start glm-cache-server with --chunk-size {N}), "
            "otherwise many prompts will get no hit")


def drafts_resume_a_chunk_early(geo: Geometry, drafts: Drafts, retention: int | None) -> str | None:
    """With a drafter that writes rows (MTP, EAGLE), vLLM keeps a prompt's recurrent
    state one block before its replay boundary (``drop_eagle_checkpoint_block``: the
    block its own local hits drop), so the state at the strict prefix exists only for
    the step that computed it, in a slot the next step overwrites, and vLLM offers a
    connector only the states it retains. A resend of an unaligned prompt then resumes
    one chunk before the strict prefix (255 tokens: 0 instead of 128). Only vLLM's
    retention can keep it: say which flag."""
    if not drafts.lookahead or not geo.state_groups:
        return None
    C, N = geo.chunk_size, geo.scheduler_block_size
    if C != N:
        # measured on the tiny checkpoint (chunk 256, block 128, retention 256, MTP k=2):
        # prompts of 612 and 814 tokens resumed one chunk short; with chunk == block they
        # resume at the strict prefix
        return (f"GlmCacheConnector: with {drafts.method} drafts and a chunk ({C}) larger than vLLM's block ({N}), "
                f"resends resume up to one chunk before the strict prefix; start glm-cache-server with "
                f"--chunk-size {N}")
    if retention is None or (retention > 0 and C % retention == 0):
        return None  # dense, or a state kept at every chunk end
    return (f"GlmCacheConnector: with {drafts.method} drafts vLLM keeps each prompt's recurrent state one block "
            f"before its replay boundary, so a resend resumes one chunk before the strict prefix; start vLLM with "
            f"--prefix-cache-retention-interval {C} for hits at the strict prefix (vLLM then keeps a state "
            "snapshot every chunk of a prompt in its pool, evicted as its prefix cache is)")


def retention_warnings(geo: Geometry, drafts: Drafts, max_num_batched_tokens: int,
                       retention: int | None) -> list[str]:
    """What to warn of at start-up (and when a server's grid differs) where the states vLLM
    keeps are not where the chunk grid of ``geo`` needs them."""
    lines = (chunk_exceeds_block(geo, max_num_batched_tokens, retention),
             drafts_resume_a_chunk_early(geo, drafts, retention))
    return [line for line in lines if line is not None]
