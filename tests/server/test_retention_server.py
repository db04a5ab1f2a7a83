"""Retention through a real glm-cache-server: ``--eviction-policy`` and ``--l1-state-share``
reach the store (what validation/bench_capacity.py compares), and bad values are refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cache_server.chunk_keys import chunk_hashes
from cache_server.client import CacheClient
from testing.server_process import ServerProcess

MIB = 1 << 20


def _conversation(client: CacheClient, ns: str, chunk: int, seed: int, chunks: int, state_bytes: int) -> list[bytes]:
    """``chunks`` attention chunks of 64 KiB (one copy) and a state at the last one (one rank)."""
    hashes = chunk_hashes([seed] * (chunks * chunk), chunk)
    items = [(h, 0, 0, b"a" * (64 << 10)) for h in hashes] + [(hashes[-1], 1, 0, b"s" * state_bytes)]
    parents = [None, *hashes[:-1], hashes[-2] if chunks > 1 else None]
    assert set(client.put(ns, items, parent=parents)) == {"stored"}
    return hashes


def _server(*args: str) -> ServerProcess:
    return ServerProcess("--separate-object-groups", "--l1-size-gb", str(4 / 1024), "--max-object-size-mb", "2",
                         *args).start()


@pytest.mark.parametrize("policy", ["value", "LRU"])
def test_eviction_policy_reaches_the_store(policy):
    """A deep conversation stored first, a shallow one after, then pressure: by value the
    shallow one's state goes (a quarter of the prefill saved for the same bytes); by LRU the
    deep one's first chunk, and with it the deep conversation."""
    with _server("--eviction-policy", policy) as server:
        c = CacheClient(server.url, timeout_s=10)
        chunk = c.hello("ns", 16, 1, attn_groups=[0], state_groups=[1])["chunk_size"]
        assert c.stats()["config"]["eviction_policy"] == policy
        deep = _conversation(c, "ns", chunk, 1, 16, 1 * MIB)  # 2 MiB
        shallow = _conversation(c, "ns", chunk, 2, 4, 1 * MIB)  # 1.25 MiB
        c.hello("other", 16)  # another engine's 1 MiB object: 0.25 MiB over the budget
        assert c.put("other", [(bytes(32), 0, 0, b"f" * MIB)]) == ["stored"]
        depth = {name: c.lookup("ns", hs, [0], [1], lease=False)[0] for name, hs in (("deep", deep),
                                                                                        ("shallow", shallow))}
        assert depth == ({"deep": 16, "shallow": 0} if policy == "value" else {"deep": 0, "shallow": 4})
        c.close()


def test_state_share_reaches_the_store():
    """Three 1 MiB states (less a little for each object's charged overhead) with 0.5 of a
    4 MiB budget for states: the third evicts the first, though the store as a whole has room."""
    with _server("--l1-state-share", "0.5") as server:
        c = CacheClient(server.url, timeout_s=10)
        chunk = c.hello("ns", 16, 1, attn_groups=[0], state_groups=[1])["chunk_size"]
        assert c.stats()["config"]["l1_state_share"] == 0.5
        convs = [_conversation(c, "ns", chunk, seed, 1, MIB - 2 * c.stats()["object_overhead_bytes"])
                 for seed in (1, 2, 3)]
        st = c.stats()
        assert st["evictions"] == 1 and st["used_bytes"] < 4 * MIB - MIB
        assert [c.lookup("ns", hs, [0], [1], lease=False)[0] for hs in convs] == [0, 1, 1]
        c.close()


@pytest.mark.parametrize("args", [["--l1-state-share", "0"], ["--l1-state-share", "1"],
                                  ["--eviction-policy", "lfu"]])
def test_bad_retention_options_exit_2(args):
    r = subprocess.run([sys.executable, "-m", "cache_server.cli", *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "error:" in r.stderr
