"""Hostile clients of the HTTP port, against a real glm-cache-server process over real
sockets: idle and slow-loris connections are cut at --http-timeout-s, connections beyond
--http-max-connections cost no thread (and a probe still gets through), a browser page can
clear nothing (text/plain and form bodies, foreign Origin or Sec-Fetch-Site), and a bare
POST /cache/clear does what LMCache's does: L1 only, and only what no lookup has leased."""

from __future__ import annotations

import http.client
import json
import socket
import time
from pathlib import Path

import pytest

from cache_server.client import CacheClient
from testing.l2_fixtures import l2_args, require_store, wait_written
from testing.redis_nodes import RedisNodes
from testing.server_process import ServerProcess

NS = "hostile-http"
ALIGNMENT = 128
TIMEOUT_S = 1.0  # --http-timeout-s of the servers here: the tests wait seconds, not the default 10
BOUND = 8  # --http-max-connections


def threads(server: ServerProcess) -> int:
    """The server process's thread count, as the kernel reports it."""
    assert server.proc is not None
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line")


def own_threads(server: ServerProcess) -> int:
    """The server's threads with no HTTP connection open: the fewest seen over 0.3 s (the
    start-up health check's thread may still be on its way out)."""
    seen: list[int] = []
    deadline = time.monotonic() + 5.0  # a server just started may still be starting threads
    while time.monotonic() < deadline and (len(seen) < 7 or len(set(seen[-7:])) > 1):
        seen.append(threads(server))
        time.sleep(0.05)
    return min(seen[-7:])


def settle(server: ServerProcess, target: int, timeout_s: float = 60.0) -> int:
    """Poll the thread count until it is at most ``target`` (or the time is up); returns it."""
    deadline = time.monotonic() + timeout_s
    while (n := threads(server)) > target and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def request(server: ServerProcess, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"{}")
    finally:
        conn.close()


def metric(server: ServerProcess, code: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    line = f'glm_cache_errors_total{{code="{code}"}} '
    return next((float(ln[len(line):]) for ln in text.splitlines() if ln.startswith(line)), 0.0)


def closed_by_server(sock: socket.socket, within_s: float) -> float | None:
    """Seconds until the server closed ``sock`` (end of input or a reset), None if it was
    still open after ``within_s``."""
    t0 = time.monotonic()
    sock.settimeout(within_s)
    try:
        data = sock.recv(1)
    except TimeoutError:
        return None
    except ConnectionResetError:
        return time.monotonic() - t0
    assert data == b"", data
    return time.monotonic() - t0


def store_prefix(c: CacheClient, seed: int, n_chunks: int = 3) -> list[bytes]:
    """``n_chunks`` attention objects (group 0) and a state (group 1) at the last chunk."""
    hashes = [(seed << 32 | i).to_bytes(32, "big") for i in range(n_chunks)]
    c.put(NS, [(h, 0, 0, bytes(2048)) for h in hashes] + [(hashes[-1], 1, 0, bytes(512))])
    return hashes


SERVER_ARGS = ("--l1-size-gb", "0.05", "--http-timeout-s", str(TIMEOUT_S), "--http-max-connections", str(BOUND))  # the server fixture's (conftest.py)


@pytest.fixture
def client(client):
    client.hello(NS, ALIGNMENT, attn_groups=[0], state_groups=[1])
    return client


def test_idle_connections_are_closed_at_the_timeout_and_their_threads_end(server):
    base = own_threads(server)
    timeouts = metric(server, "http_timeout")
    assert settle(server, base) == base  # the metric request's thread ended (seen in CI: still there)
    socks = [socket.create_connection(("127.0.0.1", server.http_port)) for _ in range(BOUND - 2)]
    try:
        # a thread each while they are open (they are cut at TIMEOUT_S: seen before that)
        deadline = time.monotonic() + TIMEOUT_S
        while (seen := threads(server)) < base + len(socks) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen == base + len(socks), (seen, base)
        for s in socks:  # each is cut by the server (a generous bound: a hang fails, a slow machine does not)
            assert closed_by_server(s, within_s=60) is not None
        assert settle(server, base) == base
    finally:
        for s in socks:
            s.close()
    assert metric(server, "http_timeout") >= timeouts + len(socks)  # cut for the timeout, each of them
    assert request(server, "GET", "/healthcheck") == (200, {"status": "healthy"})


def test_slow_loris_is_cut_while_still_trickling(server):
    """One byte of the request head every 0.1 s: each byte would restart a socket timeout,
    but the whole request is due within TIMEOUT_S: it is cut while bytes still arrive (the
    head takes 20 s to trickle, twenty times TIMEOUT_S), not after the last."""
    sock = socket.create_connection(("127.0.0.1", server.http_port))
    try:
        head = b"GET /healthcheck HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 200  # never finished
        sock.setblocking(False)
        t0 = time.monotonic()
        cut = None
        for byte in head:
            try:
                sock.send(bytes([byte]))
                if sock.recv(1, socket.MSG_PEEK) == b"":
                    cut = time.monotonic() - t0
                    break
            except BlockingIOError:
                pass  # nothing to read: still open
            except OSError:  # reset or broken pipe: cut
                cut = time.monotonic() - t0
                break
            time.sleep(0.1)
        assert cut is not None, f"still open after {time.monotonic() - t0:.1f}s, the whole head trickled"
    finally:
        sock.close()


def test_a_flood_of_connections_costs_at_most_the_bound_in_threads_and_probes_get_through():
    """300 idle connections (what pinned 307 threads before): at most BOUND are served, each
    newcomer sheds the longest waiting, a health check during the flood is answered, and
    the threads are the server's own again once the flood is gone."""
    with ServerProcess("--http-timeout-s", "60", "--http-max-connections", str(BOUND)) as s:
        base = own_threads(s)
        socks = []
        try:
            for _ in range(300):
                socks.append(socket.create_connection(("127.0.0.1", s.http_port)))
            assert settle(s, base + BOUND) <= base + BOUND  # shed connections' threads leave
            assert request(s, "GET", "/healthcheck") == (200, {"status": "healthy"})  # during the flood
            assert metric(s, "http_shed") >= 300 - BOUND
            # the shed ones were closed by the server, not left hanging (their timeout is 60 s)
            assert closed_by_server(socks[0], within_s=30) is not None
        finally:
            for sock in socks:
                sock.close()
        assert settle(s, base) == base
        assert request(s, "GET", "/healthcheck") == (200, {"status": "healthy"})


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          None])
def test_clear_with_a_body_a_browser_can_send_cross_site_is_refused(server, client, content_type):
    store_prefix(client, 1)
    headers = {"Content-Type": content_type} if content_type else {}
    before = metric(server, "http_cross_site")
    for path in ("/cache/clear", "/clear-cache"):
        code, err = request(server, "POST", path, b'{"tier": "all", "force": true}', headers)
        assert code == 415 and "Content-Type: application/json" in err["error"], (path, code, err)
    assert client.stats()["objects"] == 4  # nothing cleared
    assert metric(server, "http_cross_site") == before + 2


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},
    {"Origin": "null"},  # a sandboxed frame, or a page opened from a file
    {"Origin": "https://127.0.0.1"},  # another port (and scheme) of this host: another origin
    {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},  # another port of this host
], ids=["foreign", "null", "other-port", "fetch-cross-site", "fetch-same-site"])
def test_clear_from_another_origin_is_refused(server, client, headers):
    store_prefix(client, 2)
    for path in ("/cache/clear", "/clear-cache"):  # bodiless, as a form or fetch(no-cors) can post
        code, err = request(server, "POST", path, None, headers)
        assert code == 403 and "cross-site request refused" in err["error"], (path, code, err)
    code, err = request(server, "POST", "/cache/clear", b'{"tier": "l1"}', {**headers, "Content-Type": "application/json"})
    assert code == 403
    assert client.stats()["objects"] == 4  # nothing cleared


def test_dns_rebinding_origin_is_refused_though_it_matches_the_host_header(server, client):
    """A page of rebind.example whose name now resolves to 127.0.0.1 sends Origin and Host
    of its own name, on our port: only our bound address (or loopback names) counts."""
    store_prefix(client, 3)
    name = f"rebind.example:{server.http_port}"
    code, _ = request(server, "POST", "/cache/clear", None, {"Origin": f"http://{name}", "Host": name})
    assert code == 403 and client.stats()["objects"] == 4


def test_a_rebinding_page_cannot_read_status_without_a_token(server):
    """A GET needs no CORS preflight: a page whose name now resolves to 127.0.0.1 could read
    /status (namespace names). Without a token the server answers loopback names only."""
    code, doc = request(server, "GET", "/status", None, {"Host": f"rebind.example:{server.http_port}"})
    assert code == 421 and "namespaces" not in doc
    for name in ("localhost", "127.0.0.1"):
        assert request(server, "GET", "/status", None, {"Host": f"{name}:{server.http_port}"})[0] == 200
    assert request(server, "GET", "/healthcheck", None, {"Host": "rebind.example"})[0] == 200  # probes stay open


def test_same_origin_curl_and_lmcache_shaped_clears_still_work(server, client):
    store_prefix(client, 4)
    own = f"http://127.0.0.1:{server.http_port}"
    assert request(server, "POST", "/cache/clear", b'{"tier": "l1"}',
                   {"Origin": own, "Sec-Fetch-Site": "same-origin", "Content-Type": "application/json"}) == (
        200, {"removed": 4, "status": "ok", "cleared": {"tier": "l1"}, "forced": False})
    store_prefix(client, 4)
    assert request(server, "POST", "/cache/clear", None, {"Origin": f"http://localhost:{server.http_port}"}) == (
        200, {"removed": 4})
    store_prefix(client, 4)
    assert request(server, "POST", "/clear-cache") == (  # curl -X POST: no body, no Origin
        200, {"removed": 4, "status": "ok", "cleared": {"tier": "l1"}, "forced": False})
    code, err = request(server, "POST", "/cache/clear", b'{"force": "yes"}', {"Content-Type": "application/json"})
    assert code == 400 and "force must be true or false" in err["error"]


def test_bare_clear_keeps_l2_and_leased_objects_named_tiers_and_force_do_not():
    require_store()
    with RedisNodes(1, cluster=False, maxmemory_mb=64) as redis, \
            ServerProcess("--separate-object-groups", "--l1-size-gb", "0.05", *l2_args(redis.url)) as s, \
            CacheClient(s.url, timeout_s=10.0) as c:
        c.hello(NS, ALIGNMENT, attn_groups=[0], state_groups=[1])
        leased = store_prefix(c, 10)
        free = store_prefix(c, 11)
        wait_written(lambda: request(s, "GET", "/status")[1], 8)
        depth, lease_id = c.lookup(NS, leased, [0], [1], lease=True)  # an engine about to load it
        assert depth == 3 and lease_id is not None
        # bare: L1 only, the leased prefix kept
        assert request(s, "POST", "/cache/clear") == (200, {"removed": 4, "kept_leased": 4})
        assert c.stats()["objects"] == 4
        got = c.get(NS, [(h, 0, 0) for h in leased] + [(leased[-1], 1, 0)])
        assert all(p is not None for p in got)  # the leased load still finds every object
        # L2 untouched: the unleased prefix comes back from it
        assert c.lookup(NS, free, [0], [1], lease=False)[0] == 3
        assert c.stats()["objects"] == 8
        # the protocol's clear op, bare: the same (it cleared L1, leased objects and L2 before)
        assert c.request({"op": "clear"})[0]["removed"] == 4 and c.request({"op": "clear"})[0]["kept_leased"] == 4
        assert c.lookup(NS, free, [0], [1], lease=False)[0] == 3
        assert c.stats()["objects"] == 8
        # LMCache's CLI body: the same
        assert request(s, "POST", "/cache/clear", b'{"tier": "l1"}', {"Content-Type": "application/json"}) == (
            200, {"removed": 4, "kept_leased": 4, "status": "ok", "cleared": {"tier": "l1"}, "forced": False})
        assert c.lookup(NS, free, [0], [1], lease=False)[0] == 3
        # force: the leased ones go too (L1 only still)
        assert request(s, "POST", "/cache/clear", b'{"force": true}', {"Content-Type": "application/json"}) == (
            200, {"removed": 8, "status": "ok", "cleared": {"tier": "l1"}, "forced": True})
        assert c.stats()["objects"] == 0
        assert c.lookup(NS, free, [0], [1], lease=False)[0] == 3
        # L2 only when named
        assert request(s, "POST", "/cache/clear", b'{"tier": "all", "force": true}',
                       {"Content-Type": "application/json"})[0] == 200
        assert c.stats()["objects"] == 0
        assert c.lookup(NS, free, [0], [1], lease=False)[0] == 0
        assert c.lookup(NS, leased, [0], [1], lease=False)[0] == 0
