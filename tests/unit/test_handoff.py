"""The PD hand-off's pure parts (connector.handoff): request flags as hostile input, and keys
that name exactly the prefill's prompt (tests/engine/test_pd_e2e.py runs it end to end)."""

from __future__ import annotations

import pytest

from connector.handoff import MAX_CHUNKS_CLAIMED, handoff_key, handoff_span, pd_flags


@pytest.mark.parametrize("params, expected", [
    (None, (False, False, 0)),
    ([1, 2], (False, False, 0)),
    ({"do_remote_decode": True}, (True, False, 0)),
    ({"do_remote_prefill": True}, (False, True, 0)),
    ({"glm_handoff": True, "glm_chunks": 3}, (False, True, 3)),
    ({"glm_handoff": False, "glm_chunks": 2}, (False, False, 2)),
    # what a client may send instead of JSON true / a small integer: no, and no wait
    ({"do_remote_decode": "true", "do_remote_prefill": 1, "glm_handoff": "yes"}, (False, False, 0)),
    ({"glm_handoff": True, "glm_chunks": float("inf")}, (False, True, 0)),
    ({"glm_handoff": True, "glm_chunks": 10 ** 400}, (False, True, 0)),
    ({"glm_handoff": True, "glm_chunks": MAX_CHUNKS_CLAIMED + 1}, (False, True, 0)),
    ({"glm_handoff": True, "glm_chunks": -1}, (False, True, 0)),
    ({"glm_handoff": True, "glm_chunks": True}, (False, True, 0)),
])
def test_flags_are_json_true_and_bounded_counts_only(params, expected):
    assert pd_flags(params) == expected


def test_keys_name_prefix_tail_and_salt():
    prefix, other = b"\x01" * 32, b"\x02" * 32
    k = handoff_key(prefix, [5, 6, 7], None)
    assert len(k) == 32
    assert k == handoff_key(prefix, [5, 6, 7], None)
    assert len({k, handoff_key(other, [5, 6, 7], None), handoff_key(prefix, [5, 6], None),
                handoff_key(prefix, [5, 6, 8], None)}) == 4
    # no whole chunk: the salt names the prefix (each chunk key carries it otherwise)
    assert handoff_key(None, [5], "a") != handoff_key(None, [5], "b") != handoff_key(None, [5], None)
    assert handoff_span(37, 128) == (0, 37) and handoff_span(256, 128) == (2, 0) and handoff_span(433, 128) == (3, 49)


def test_the_salt_is_length_prefixed_so_no_two_salt_and_tail_pairs_share_a_key():
    """Salt "x" with the tail [5, 6, 7], and a salt made of "x", a NUL and the first 15 bytes of
    that tail with the tail [7]: the same bytes once the salt was only NUL-terminated."""
    import struct

    tail = struct.pack("<qq", 5, 6)
    other_salt = ("x\0" + tail[:15].decode("ascii"))
    assert handoff_key(None, [5, 6, 7], "x") != handoff_key(None, [7], other_salt)


def test_a_decode_side_repeats_its_hand_off_lookup_a_bounded_number_of_times():
    """Backing off from 20 ms to at most 0.5 s, and never more than MAX_HANDOFF_RETRIES
    repeats, whatever the connector's timeout_s (a client's glm_chunks asks for the wait)."""
    from connector.handoff import HANDOFF_RETRY_MAX_S, HANDOFF_RETRY_S, MAX_HANDOFF_RETRIES, handoff_retry_delay

    delays = [handoff_retry_delay(i) for i in range(MAX_HANDOFF_RETRIES + 5)]
    assert delays[0] == HANDOFF_RETRY_S and delays[1] == 2 * HANDOFF_RETRY_S
    assert all(d is not None and d <= HANDOFF_RETRY_MAX_S for d in delays[:MAX_HANDOFF_RETRIES])
    assert delays[MAX_HANDOFF_RETRIES:] == [None] * 5
    assert 2 < sum(delays[:MAX_HANDOFF_RETRIES]) < 10  # the wait a PD pair needs, not a loop
