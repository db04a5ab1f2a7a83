"""Shared-secret authentication of glm-cache-server, on real server processes."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import urllib.error
import urllib.request

import msgpack
import pytest
import zmq

from cache_server.auth import TokenFileError, bearer_matches, is_loopback, read_token_file, token_matches
from testing.server_process import ServerProcess, free_port
from cache_server.protocol import PROTOCOL_VERSION
from cache_server.client import CacheClient, CacheServerError

TOKEN = "s3cret-token-for-tests-0123456789"
NS = "auth-ns"
KEY = b"\x11" * 32


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--separate-object-groups", "--l1-size-gb", "0.01", auth_token=TOKEN) as s:
        yield s


@pytest.fixture
def good(server):
    """An authorised client on a store holding one object and one negotiated namespace."""
    with CacheClient(server.url, timeout_s=5.0, auth_token=TOKEN) as c:
        c.clear()
        c.hello(NS, 16)
        assert c.put(NS, [(KEY, 0, 0, b"payload")]) == ["stored"]
        yield c


def http(url: str, method: str = "GET", token: str | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def unauthorized_count(server) -> float:
    _, _, body = http(server.http_url + "/metrics")
    m = re.search(r'^glm_cache_errors_total\{code="unauthorized"\} (\S+)$', body.decode(), re.M)
    return float(m.group(1)) if m else 0.0


def every_op(c: CacheClient) -> dict[str, object]:
    """One call of each protocol op; each returns what it raised (or its result)."""
    calls = {
        "hello": lambda: c.hello("intruder-ns", 16),
        "lookup": lambda: c.lookup(NS, [KEY], [0], []),
        "get": lambda: c.get(NS, [(KEY, 0, 0)]),
        "put": lambda: c.put(NS, [(KEY, 0, 1, b"forged"), (b"\x22" * 32, 0, 0, b"forged")]),
        "release": lambda: c.release(1),
        "clear": lambda: c.clear(),
        "stats": lambda: c.stats(),
        "ping": lambda: c.ping(),
    }
    out: dict[str, object] = {}
    for op, call in calls.items():
        try:
            out[op] = call()
        except CacheServerError as e:
            out[op] = e
    return out


@pytest.mark.parametrize("token", [None, "wrong-token-of-the-same-size-0000", TOKEN + "x", TOKEN[:-1]],
                         ids=["missing", "wrong", "longer", "shorter"])
def test_every_op_without_the_token_is_refused_and_changes_nothing(server, good, token):
    before_refused = unauthorized_count(server)
    before = good.stats()
    with CacheClient(server.url, timeout_s=5.0, auth_token=token) as bad:
        results = every_op(bad)
    for op, r in results.items():
        assert isinstance(r, CacheServerError) and r.code == "unauthorized", (op, r)
    after = good.stats()
    # Nothing was stored, cleared, looked up or negotiated by the refused requests.
    assert after["objects"] == before["objects"] == 1
    assert after["lookups"] == before["lookups"] and after["puts_stored"] == before["puts_stored"]
    assert "intruder-ns" not in after["namespaces"] and NS in after["namespaces"]
    assert good.get(NS, [(KEY, 0, 0), (KEY, 0, 1), (b"\x22" * 32, 0, 0)])[1:] == [None, None]
    assert bytes(good.get(NS, [(KEY, 0, 0)])[0]) == b"payload"
    assert unauthorized_count(server) == before_refused + len(results)


def test_right_token_works_for_every_op(good):
    hit, lease = good.lookup(NS, [KEY], [0], [])
    assert hit == 1 and lease is not None
    assert good.release(lease) is True
    assert good.stats()["objects"] == 1
    good.ping()
    assert good.clear() == 1 and good.stats()["objects"] == 0


def raw_request(server, header: dict, identity: bytes | None = None) -> dict:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
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
    assert code == 200 and json.loads(body) == {"status": "ok"}
    code, _, body = http(server.http_url + "/metrics")
    assert code == 200 and b"glm_cache_objects" in body
    # The refusal counter is exported from the start.
    assert b'glm_cache_errors_total{code="unauthorized"}' in body


def test_start_up_log_says_auth_is_on_and_never_shows_the_token(server, good):
    with pytest.raises(CacheServerError):
        CacheClient(server.url, timeout_s=5.0, auth_token="nope-nope-nope-nope").ping()
    log = server.log()
    assert "auth on" in log and "refused" in log
    assert TOKEN not in log


def test_token_file_whitespace_is_stripped(tmp_path):
    path = tmp_path / "token"
    path.write_text(f"\n  {TOKEN}\t\n\n")
    path.chmod(0o600)
    with ServerProcess("--auth-token-file", str(path)) as s:
        with CacheClient(s.url, timeout_s=5.0, auth_token=TOKEN) as c:
            c.ping()
        with pytest.raises(CacheServerError):
            CacheClient(s.url, timeout_s=5.0, auth_token=f"  {TOKEN}").ping()


def test_server_without_a_token_ignores_the_clients_token():
    with ServerProcess() as s, CacheClient(s.url, timeout_s=5.0, auth_token=TOKEN) as c:
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
        with CacheClient(s.url, timeout_s=5.0) as c:
            c.ping()
        assert "auth OFF on 0.0.0.0 (--insecure-no-auth)" in s.log()


def test_all_interfaces_with_a_token_requires_it():
    with ServerProcess("--host", "0.0.0.0", auth_token=TOKEN) as s:
        with pytest.raises(CacheServerError) as e:
            CacheClient(s.url, timeout_s=5.0).ping()
        assert e.value.code == "unauthorized"
        with CacheClient(s.url, timeout_s=5.0, auth_token=TOKEN) as c:
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
            assert not link.usable() and link.hello is None
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
