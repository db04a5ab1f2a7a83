"""Shared-secret authentication of glm-cache-server, on real server processes."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import msgpack
import pytest
import zmq

from cache_server import protocol as p
from cache_server.auth import PLAIN_USERNAME, TokenFileError, bearer_matches, is_loopback, read_token_file, token_matches
from cache_server.client import CacheClient
from cache_server.client.errors import CacheServerError
from cache_server.metrics import namespace_id
from cache_server.protocol import PROTOCOL_VERSION
from testing.server_process import ServerProcess, free_port

TOKEN = "s3cret-token-for-tests-0123456789"
NS = "auth-ns"
KEY = b"\x11" * 32


@pytest.fixture(scope="module")
def server():
    # With the debug hooks, so that a refused debug_corrupt or debug_die_on would show.
    with ServerProcess("--separate-object-groups", "--l1-size-gb", "0.01", "--debug-fault-hooks",
                       auth_token=TOKEN) as s:
        yield s


@pytest.fixture
def good(server):
    """An authorised client on a store holding one object and one negotiated namespace
    whose engine declared its groups (so /metrics has per-namespace series for it)."""
    with CacheClient(server.url, timeout_s=60.0, auth_token=TOKEN) as c:
        c.clear()
        c.hello(NS, 16, attn_groups=[0], state_groups=[1])
        assert c.put(NS, [(KEY, 0, 0, b"payload")], parent=[None]) == ["stored"]
        yield c


def http(url: str, method: str = "GET", token: str | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def metric(server, line_start: str) -> float:
    _, _, body = http(server.http_url + "/metrics")
    m = re.search(r"^" + re.escape(line_start) + r" (\S+)$", body.decode(), re.M)
    return float(m.group(1)) if m else 0.0


def unauthorized_count(server) -> float:
    return metric(server, 'glm_cache_errors_total{code="unauthorized"}')


def refused_connections(server, reason: str) -> float:
    return metric(server, f'glm_cache_refused_connections_total{{reason="{reason}"}}')


def _shm_offer() -> dict:
    return {"boot": "0" * 32, "path": "/dev/shm/glmcache-intruder", "size": 1 << 20, "nonce": bytes(16)}


def op_headers() -> dict[str, dict]:
    """A well-formed request of every protocol op, each of which would read or change
    something if it were served (the debug ones included: the server enables them)."""
    headers = {
        "hello": {"v": PROTOCOL_VERSION, "ns": "intruder-ns", "alignment": 16},
        "lookup": {"ns": NS, "hashes": [KEY], "attn_groups": [0], "state_groups": [], "world_size": 1},
        "get": {"ns": NS, "keys": [[KEY, 0, 0]]},
        "put": {"ns": NS, "keys": [[b"\x22" * 32, 0, 0]], "sums": [bytes(16)]},
        "delete": {"ns": NS, "keys": [[KEY, 0, 0]]},
        "debug_corrupt": {"ns": NS, "keys": [[KEY, 0, 0]]},
        "debug_die_on": {"on": "get"},
        "release": {"lease_id": 1},
        "clear": {},
        "stats": {},
        "ping": {},
        "shm_attach": {"shm": _shm_offer()},
        "shm_detach": {"seg": 1},
        "query": {"model": NS, "token_ids": bytes(4 * 32)},
        "unpin": {"pins": bytes(8)},
    }
    assert set(headers) == set(p.OPS)  # a new op must be added here
    return {op: {"op": op, **h} for op, h in headers.items()}


def every_op(c: CacheClient) -> dict[str, object]:
    """One call of each protocol op through the client; each returns what it raised (or its
    result)."""
    requests = op_headers()
    calls = {
        "hello": lambda: c.hello("intruder-ns", 16),
        "lookup": lambda: c.lookup(NS, [KEY], [0], []),
        "get": lambda: c.get(NS, [(KEY, 0, 0)]),
        "put": lambda: c.put(NS, [(KEY, 0, 1, b"forged"), (b"\x22" * 32, 0, 0, b"forged")]),
        "delete": lambda: c.delete(NS, [(KEY, 0, 0)]),
        "release": lambda: c.release(1),
        "clear": lambda: c.clear(),
        "stats": lambda: c.stats(),
        "ping": lambda: c.ping(),
        "query": lambda: c.query(NS, [1] * 32),
        **{op: (lambda op=op: c.request(requests[op])) for op in ("debug_corrupt", "debug_die_on", "shm_attach",
                                                                   "shm_detach", "unpin")},
    }
    assert set(calls) == set(p.OPS)
    out: dict[str, object] = {}
    for op, call in calls.items():
        try:
            out[op] = call()
        except CacheServerError as e:
            out[op] = e
    return out


def assert_unchanged(good: CacheClient, before: dict) -> None:
    """Nothing was stored, deleted, corrupted, cleared, looked up, negotiated or armed."""
    after = good.stats()
    assert after["objects"] == before["objects"] == 1
    assert after["lookups"] == before["lookups"] and after["puts_stored"] == before["puts_stored"]
    assert "intruder-ns" not in after["namespaces"] and NS in after["namespaces"]
    assert after["shm"]["attached_total"] == before["shm"]["attached_total"]
    assert good.get(NS, [(KEY, 0, 0), (KEY, 0, 1), (b"\x22" * 32, 0, 0)])[1:] == [None, None]
    assert bytes(good.get(NS, [(KEY, 0, 0)])[0]) == b"payload"  # intact, and a get does not kill the server
    assert good.corrupt_objects == 0


def wait_for(value, expected, timeout_s: float = 60.0) -> float:
    """``value()`` once it reaches ``expected`` (the ZAP thread counts asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (got := value()) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


@pytest.mark.parametrize("token", [None, "wrong-token-of-the-same-size-0000", TOKEN + "x", TOKEN[:-1]],
                         ids=["missing", "wrong", "longer", "shorter"])
def test_every_op_without_the_token_is_refused_at_connection_and_changes_nothing(server, good, token):
    """A client without the token (or with another) is refused in the ZMQ handshake:
    every op raises ``unauthorized`` and no request of it reaches the server."""
    before_refused, before_token = unauthorized_count(server), refused_connections(server, "token")
    before_mechanism = refused_connections(server, "mechanism")
    before = good.stats()
    with CacheClient(server.url, timeout_s=60.0, auth_token=token) as bad:
        results = every_op(bad)
    for op, r in results.items():
        assert isinstance(r, CacheServerError) and r.code == "unauthorized" and "at connection" in r.message, (op, r)
    assert_unchanged(good, before)
    assert unauthorized_count(server) == before_refused  # refused before any request was read
    if token is None:  # no PLAIN at all: libzmq retries until it hears the mismatch, so one or more each
        assert wait_for(lambda: refused_connections(server, "mechanism"), before_mechanism + len(results)) \
            >= before_mechanism + len(results)
    else:  # one refused PLAIN handshake per op: the client drops its socket at the refusal
        assert wait_for(lambda: refused_connections(server, "token"), before_token + len(results)) \
            == before_token + len(results)


@pytest.mark.parametrize("auth", [None, "wrong-token-of-the-same-size-0000"], ids=["missing", "wrong"])
def test_every_op_is_refused_without_the_token_in_the_request_too(server, good, auth):
    """The per-request check stays: a peer that passed the handshake (PLAIN with the token)
    but sends a request without it, or with another, gets ``unauthorized`` for every op."""
    before_refused = unauthorized_count(server)
    before = good.stats()
    for op, header in op_headers().items():
        reply = raw_request(server, {**header, "id": 9, **({"auth": auth} if auth else {})})
        assert reply["ok"] is False and reply["code"] == "unauthorized", (op, reply)
    assert_unchanged(good, before)
    assert unauthorized_count(server) == before_refused + len(p.OPS)


def test_right_token_works_for_every_op(good):
    hit, lease = good.lookup(NS, [KEY], [0], [])
    assert hit == 1 and lease is not None
    assert good.release(lease) is True
    assert good.stats()["objects"] == 1
    good.ping()
    assert good.clear() == 1 and good.stats()["objects"] == 0


def raw_request(server, header: dict, identity: bytes | None = None, password: str = TOKEN) -> dict:
    """One request over a bare DEALER that passes the handshake with ``password``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.plain_username, sock.plain_password = PLAIN_USERNAME, password.encode()
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(server.url)
    try:
        sock.send_multipart([msgpack.packb(header)])
        return msgpack.unpackb(sock.recv_multipart()[0])
    finally:
        sock.close()


@pytest.mark.parametrize("auth", [7, [TOKEN], "", TOKEN.encode() + b"\xff"], ids=["int", "list", "empty", "bytes"])
def test_malformed_tokens_are_unauthorized_not_errors(server, good, auth):
    reply = raw_request(server, {"op": "clear", "id": 3, "auth": auth})
    assert reply == {"ok": False, "id": 3, "code": "unauthorized", "message": reply["message"]}
    assert good.stats()["objects"] == 1


def test_unauthenticated_peer_learns_nothing_about_ops(server):
    # Refused before the op is even parsed: no unknown_op / bad_request oracle.
    assert raw_request(server, {"op": "explode", "id": 1})["code"] == "unauthorized"
    assert raw_request(server, {"id": 1})["code"] == "unauthorized"


def test_a_taken_over_routing_identity_does_not_inherit_authentication(server, good):
    """ROUTER_HANDOVER hands an identity to whoever connects with it last: the token, not
    the identity, must be what the server trusts."""
    ident = b"replica-0"
    assert raw_request(server, {"op": "ping", "id": 1, "auth": TOKEN}, identity=ident)["ok"] is True
    reply = raw_request(server, {"op": "clear", "id": 2}, identity=ident)
    assert reply["code"] == "unauthorized" and good.stats()["objects"] == 1


def test_http_status_and_clear_need_the_bearer_token(server, good):
    for token in (None, "wrong-token-wrong-token", TOKEN + " extra"):
        code, headers, body = http(server.http_url + "/status", token=token)
        assert code == 401 and headers.get("WWW-Authenticate", "").startswith("Bearer")
        assert NS not in body.decode() and b"namespaces" not in body
        code, _, _ = http(server.http_url + "/cache/clear", "POST", token=token)
        assert code == 401
    assert good.stats()["objects"] == 1  # the refused clears removed nothing
    code, _, body = http(server.http_url + "/status", token=TOKEN)
    assert code == 200 and NS in json.loads(body)["namespaces"]
    code, _, body = http(server.http_url + "/cache/clear", "POST", token=TOKEN)
    assert code == 200 and json.loads(body) == {"removed": 1}
    assert good.stats()["objects"] == 0


def test_http_healthcheck_and_metrics_stay_open(server, good):
    code, _, body = http(server.http_url + "/healthcheck")
    assert code == 200 and json.loads(body) == {"status": "healthy"}
    code, _, body = http(server.http_url + "/metrics")
    assert code == 200 and b"glm_cache_objects" in body
    # The refusal counters are exported from the start.
    assert b'glm_cache_errors_total{code="unauthorized"}' in body
    assert b'glm_cache_refused_connections_total{reason="token"}' in body


def test_metrics_label_namespaces_by_an_id_keyed_by_the_token(server, good):
    """The open /metrics carries per-namespace series (the engine declared its groups) but
    no namespace name: each is labelled by an HMAC of the name under the token, which
    /status, behind the token, maps back."""
    _, _, body = http(server.http_url + "/metrics")
    text = body.decode()
    label = namespace_id(NS, TOKEN.encode())
    code, _, body = http(server.http_url + "/status", token=TOKEN)
    entry = json.loads(body)["namespaces"][NS]
    assert code == 200 and entry["metrics_id"] == label
    for key in ("resumable_tokens", "resumable_states", "states_held", "worthless_objects"):
        assert f'glm_cache_{key}{{namespace="{label}"}} {float(entry["usable_prefixes"][key])}' in text
    assert entry["usable_prefixes"]["worthless_objects"] == 0  # the attention object is pending, not worthless
    assert NS not in text and namespace_id(NS) not in text  # nor the unkeyed id a guesser could compute


def _peak_rss_kb(pid: int) -> int:
    """The process's peak resident set (VmHWM): a message buffered, then freed, still shows."""
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1])


def _settled_peak_rss_kb(pid: int, timeout_s: float = 60.0) -> int:
    """The peak RSS once the started server's allocations have settled (the same in three
    reads 0.1 s apart)."""
    deadline = time.monotonic() + timeout_s
    seen = [_peak_rss_kb(pid)]
    while len(seen) < 3 or len(set(seen[-3:])) > 1:
        assert time.monotonic() < deadline, f"the server's peak RSS still grew after {timeout_s}s: {seen[-3:]} kB"
        time.sleep(0.1)
        seen.append(_peak_rss_kb(pid))
    return seen[-1]


HANDSHAKE_OUTCOMES = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                      | zmq.EVENT_DISCONNECTED)


def _first_handshake_outcome(monitor: zmq.Socket, timeout_s: float = 60.0) -> int:
    """The first handshake outcome (or disconnection) a socket's monitor reports."""
    from zmq.utils.monitor import parse_monitor_message

    assert monitor.poll(int(timeout_s * 1000)), f"no handshake outcome within {timeout_s}s"
    return parse_monitor_message(monitor.recv_multipart())["event"]


@pytest.mark.parametrize("password", [None, "wrong-token-of-the-same-size-0000"], ids=["no-token", "wrong-token"])
def test_a_peer_without_the_token_cannot_make_the_server_buffer(password):
    """libzmq's MAXMSGSIZE bounds a frame, not a message: a peer may send 80 frames of
    1.5 MiB against a 2 MiB limit. Without the token it is refused at the handshake, so the
    server never reads them: its peak RSS stays flat. With the token, the same message is read
    and answered too_large (what the per-request checks cost an authenticated peer)."""
    with ServerProcess("--max-message-mb", "2", "--max-object-size-mb", "1", auth_token=TOKEN) as s:
        CacheClient(s.url, timeout_s=60.0, auth_token=TOKEN).ping()  # the server's threads are up
        before = _settled_peak_rss_kb(s.proc.pid)
        ctx = zmq.Context()
        socks, monitors = [], []
        frame = os.urandom(3 << 19)  # 1.5 MiB
        for _ in range(2):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            if password is not None:
                sock.plain_username, sock.plain_password = PLAIN_USERNAME, password.encode()
            monitors.append(sock.get_monitor_socket(HANDSHAKE_OUTCOMES))
            sock.connect(s.url)
            try:  # queued for the connection; once the handshake was refused there is none to queue for
                sock.send_multipart([msgpack.packb({"op": "ping", "id": 1}), *[frame] * 80], copy=False,
                                    flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            socks.append(sock)
        # each socket's handshake refused (libzmq retries it every 100 ms meanwhile): the
        # server never took a connection to read the message from
        outcomes = [_first_handshake_outcome(m) for m in monitors]
        grown_mb = (_peak_rss_kb(s.proc.pid) - before) / 1024
        for sock, monitor in zip(socks, monitors):
            sock.disable_monitor()
            monitor.close()
            sock.close()
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in outcomes, outcomes
        ctx.term()
        assert grown_mb < 8, f"the server buffered {grown_mb:.0f} MB for a peer without the token"
        with CacheClient(s.url, timeout_s=60.0, auth_token=TOKEN) as c:
            c.ping()  # still serving
            with pytest.raises(CacheServerError) as e:
                c.request({"op": "ping"}, [frame] * 2)
            assert e.value.code == "too_large"


def test_start_up_log_says_auth_is_on_and_never_shows_the_token(server, good):
    with pytest.raises(CacheServerError):
        CacheClient(server.url, timeout_s=60.0, auth_token="nope-nope-nope-nope").ping()
    log = server.log()
    assert "auth on" in log and "refused" in log
    assert TOKEN not in log


def test_token_file_whitespace_is_stripped(tmp_path):
    path = tmp_path / "token"
    path.write_text(f"\n  {TOKEN}\t\n\n")
    path.chmod(0o600)
    with ServerProcess("--auth-token-file", str(path)) as s:
        with CacheClient(s.url, timeout_s=60.0, auth_token=TOKEN) as c:
            c.ping()
        with pytest.raises(CacheServerError):
            CacheClient(s.url, timeout_s=60.0, auth_token=f"  {TOKEN}").ping()


def test_server_without_a_token_ignores_the_clients_token():
    with ServerProcess() as s, CacheClient(s.url, timeout_s=60.0, auth_token=TOKEN) as c:
        assert c.put(NS, [(KEY, 0, 0, b"x")]) == ["stored"]
        assert http(s.http_url + "/status")[0] == 200  # loopback without a token: open
        assert "auth off: bound to loopback only" in s.log()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cache_server.cli", "--port", str(free_port()),
                           "--http-port", str(free_port()), *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "my-host.example"])
def test_binding_beyond_loopback_without_a_token_exits_2(host):
    r = cli("--host", host)
    assert r.returncode == 2
    assert "--auth-token-file" in r.stderr and "--insecure-no-auth" in r.stderr


@pytest.mark.parametrize("content,why", [("", "is empty"), ("  \n\t", "is empty"), ("short", "at least 16"),
                                         ("two words-but-long-enough", "one word")])
def test_unusable_token_file_exits_2_with_a_message(tmp_path, content, why):
    path = tmp_path / "token"
    path.write_text(content)
    r = cli("--auth-token-file", str(path))
    assert r.returncode == 2 and why in r.stderr and str(path) in r.stderr
    if content.strip():
        assert content.strip() not in r.stderr  # the (bad) secret is not echoed


def test_missing_token_file_and_contradictory_flags_exit_2(tmp_path):
    r = cli("--auth-token-file", str(tmp_path / "absent"))
    assert r.returncode == 2 and "cannot read auth token file" in r.stderr
    path = tmp_path / "token"
    path.write_text(TOKEN)
    r = cli("--auth-token-file", str(path), "--insecure-no-auth")
    assert r.returncode == 2 and "not allowed with" in r.stderr


def test_insecure_no_auth_binds_all_interfaces_with_a_warning():
    with ServerProcess("--host", "0.0.0.0", "--insecure-no-auth") as s:  # traffic on 127.0.0.1 only
        with CacheClient(s.url, timeout_s=60.0) as c:
            c.ping()
        assert "auth OFF on 0.0.0.0 (--insecure-no-auth)" in s.log()


def test_all_interfaces_with_a_token_requires_it():
    with ServerProcess("--host", "0.0.0.0", auth_token=TOKEN) as s:
        with pytest.raises(CacheServerError) as e:
            CacheClient(s.url, timeout_s=60.0).ping()
        assert e.value.code == "unauthorized"
        with CacheClient(s.url, timeout_s=60.0, auth_token=TOKEN) as c:
            assert c.hello(NS, 16)["v"] == PROTOCOL_VERSION


def test_world_readable_token_file_is_accepted_with_a_warning(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o644)
    with ServerProcess("--auth-token-file", str(path)) as s:
        assert "readable by every local user" in s.log()


# --- helpers, unit level ---------------------------------------------------------------------


@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("[::1]", True),
                                       ("localhost", True), ("LOCALHOST", True), ("0.0.0.0", False),
                                       ("*", False), ("::", False), ("192.168.1.5", False), ("example.org", False)])
def test_is_loopback(host, loop):
    assert is_loopback(host) is loop


def test_token_and_bearer_comparisons():
    assert token_matches(TOKEN, TOKEN) and token_matches(TOKEN.encode(), TOKEN)
    assert not token_matches(None, TOKEN) and not token_matches(1, TOKEN) and not token_matches("é" * 20, TOKEN)
    assert bearer_matches(f"Bearer {TOKEN}", TOKEN) and bearer_matches(f"bearer  {TOKEN} ", TOKEN)
    assert not bearer_matches(f"Basic {TOKEN}", TOKEN) and not bearer_matches(TOKEN, TOKEN)
    assert not bearer_matches(None, TOKEN) and not bearer_matches("Bearer", TOKEN)


def test_read_token_file_rejects_non_ascii(tmp_path):
    path = tmp_path / "token"
    path.write_bytes("é".encode() * 20)
    with pytest.raises(TokenFileError, match="printable ASCII"):
        read_token_file(path)


# --- connector side: config reading and refusal handling -----------------------------------


@pytest.fixture(scope="module")
def glm_connector():
    pytest.importorskip("vllm")
    import connector.config as config

    return config


def _server_link():
    from connector.remote import ServerLink

    return ServerLink


def kv_config(**extra):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="GlmCacheConnector", kv_role="kv_both", kv_connector_extra_config=extra)


def test_connector_reads_auth_token_file(glm_connector, tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert glm_connector.auth_token_from_config(kv_config(auth_token_file=str(path)).get_from_extra_config) == TOKEN
    assert glm_connector.auth_token_from_config(kv_config().get_from_extra_config) is None
    assert glm_connector.auth_token_from_config(kv_config(auth_token_file="").get_from_extra_config) is None
    with pytest.raises(TokenFileError, match="cannot read auth token file .*absent"):
        glm_connector.auth_token_from_config(kv_config(auth_token_file=str(tmp_path / "absent")).get_from_extra_config)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(TokenFileError, match="is empty"):
        glm_connector.auth_token_from_config(kv_config(auth_token_file=str(tmp_path / "empty")).get_from_extra_config)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_connector_link_treats_a_refused_token_as_an_unusable_server_logged_once(glm_connector, server, good):
    logger = logging.getLogger("vllm.glm_cache_connector")
    records = _Records()
    logger.addHandler(records)
    try:
        link = _server_link()(server.url, 2.0, 60.0, auth_token="wrong-token-wrong-token")
        for _ in range(3):
            link._down_until = 0.0  # as if the back-off had passed
            with pytest.raises(CacheServerError) as e:
                link.client.hello(NS, 16)
            link.failed("handshake", e.value)
            assert not link.usable() and link.session is None
    finally:
        logger.removeHandler(records)
        link.client.close()
    errors = [r for r in records.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "refused our token" in errors[0].getMessage()
    assert not [r for r in records.records if r.levelno == logging.WARNING]
    ok = _server_link()(server.url, 2.0, 60.0, auth_token=TOKEN)
    assert ok.usable() and ok.client.hello(NS, 16)["v"] == PROTOCOL_VERSION
    ok.client.close()


def test_connector_link_with_an_unusable_token_file_never_talks_to_the_server(glm_connector):
    link = _server_link()(f"tcp://127.0.0.1:{free_port()}", 2.0, 0.0, disabled=True)
    assert not link.usable()
    link.client.close()
