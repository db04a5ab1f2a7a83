"""The soak with faults, short (issue 46, item 4): ``validation/soak.py`` for two minutes of
traffic with three of its faults (the server paused 5 s, the link delaying and dropping
segments, the server killed and started again on its ports).

Two ``vllm serve`` replicas of the tiny GLM-5.3-Flash on one glm-cache-server with a Redis
L2 (three-node cluster), the replicas behind the soak's faulty TCP proxy; multi-turn chats,
repeated documents, PD pairs across the replicas and image prompts, each prompt's greedy
tokens compared with its cold run. Shown: every request is answered (a fault costs a
recompute, never an error), no token differs from the cold run (near ties of the cold run
apart, counted by the soak), and, where the connector counts its lookups, none is lost
(unanswered outside the windows of the faults that kill connections, less what the server
dropped as late). The connector's ``timeout_s`` is generous (30 s): what is asserted is
correctness, not how fast anything was.
"""

from __future__ import annotations

import pytest

from testing.l2_fixtures import require_store

pytestmark = pytest.mark.engine

FAULTS = ("pause", "link", "server")


# Longer than the suite's 600 s: 2 minutes of traffic, but its faults' grace periods, two
# vLLM start-ups, the cold runs and the clients' last requests, on a machine that may stand
# still for 30 s at a time and a CPU of it for minutes (testing/stalls.py; the soak's last wait
# does not count that time, up to 15 minutes); CI at 6d4e421 ran out of 600 s with every
# request answered and none wrong so far.
@pytest.mark.timeout(1800)
def test_soak_with_faults_answers_every_request_with_the_cold_tokens(tmp_path):
    require_store()
    from validation import soak

    args = soak.parse_args(["--minutes", "2", "--faults", ",".join(FAULTS), "--timeout-s", "30",
                            "--conversations", "2", "--turns", "3", "--documents", "2", "--questions", "2",
                            "--pd", "2", "--images", "2", "--checkpoint", str(tmp_path / "glm5next-tiny"),
                            "--keep", str(tmp_path / "logs")])
    r = soak.Soak(args).run()

    assert [w["fault"] for w in r["windows"]] == list(FAULTS)
    assert r["sent"] > 0 and r["answered"] == r["sent"], r["errors"]
    assert r["compared"] == r["sent"]
    assert r["wrong_tokens"] == 0, r["wrong_requests"]
    assert all(r["kinds"][k]["answered"] > 0 for k in soak.MIX), r["kinds"]
    assert r["link"].get("dropped", 0) + r["link"].get("delayed", 0) > 0, r["link"]
    if r["lookups"]["lost"] is not None:  # the connector's lookup counters exist
        assert r["lookups"]["lost"] == 0, r["lookups"]
