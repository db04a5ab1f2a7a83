"""The PD hand-off's pure parts (connector.handoff): request flags as hostile input, and keys
that name exactly the prefill's prompt (tests/test_pd_e2e.py runs it end to end)."""

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
