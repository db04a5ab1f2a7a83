"""Every LMCache 0.5.7 server flag, connector key, ``LMCACHE_*`` variable and HTTP route, read
from the installed ``lmcache-cli`` source (validation.lmcache_surface.scan), is in our table
(validation.lmcache_surface.table), and each behaves as its row says, against a real
glm-cache-server process (no engine). A name LMCache adds fails the first test by name.
About 15 s (one server, 16 short-lived refused starts, the rest in process)."""

from __future__ import annotations

import ast
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cache_server.cli import build_parser, main
from cache_server.lmcache_compat import HONOURED_ENV
from cache_server.lmcache_surface import ACCEPTED, NOT_APPLICABLE, REFUSED
from connector.lmcache_settings import _KEYS, MAX_OFFLOAD_TOKENS, SKIP_LOAD, LMCacheSettingRefused, translate
from testing.server_process import ServerProcess
from validation import lmcache_surface as surface

ROOT = Path(__file__).resolve().parents[2]
KEY = "lmcache-surface-key-0123456789abcdef"
OURS = set(build_parser()._option_string_actions)


@pytest.fixture(scope="module")
def scanned() -> dict[str, list[str]]:
    return surface.scan()


@pytest.fixture(scope="module")
def table() -> dict[str, dict[str, tuple[str, str]]]:
    return surface.table()


@pytest.mark.parametrize("kind", surface.KINDS)
def test_the_table_has_exactly_lmcaches_names(kind, scanned, table):
    missing = sorted(set(scanned[kind]) - set(table[kind]))
    gone = sorted(set(table[kind]) - set(scanned[kind]))
    assert not missing, f"LMCache 0.5.7's source has {kind} the table lacks: {missing}"
    assert not gone, f"the table lists {kind} LMCache's source does not have: {gone}"
    assert {status for status, _ in table[kind].values()} <= set(surface.STATUSES)
    assert all(text.strip() for _, text in table[kind].values())


def test_the_scan_reads_each_kind_the_way_lmcache_builds_it(scanned):
    """The scanner follows LMCache's own composition: the parser helpers each entry point calls
    (BooleanOptionalAction's --no- forms included), literal, enum-member and f-string connector
    keys, variables behind constants, and the auto-discovered HTTP API modules."""
    flags = surface.scan_server_flags()
    assert flags["--max-workers"] == ("python -m lmcache.v1.multiprocess.server",
                                      "python -m lmcache.v1.multiprocess.http_server", "lmcache server")
    assert "python -m lmcache.v1.multiprocess.server" not in flags["--http-host"]  # no HTTP there
    assert {"--no-separate-object-groups", "--no-l1-use-lazy", "--l2-adapter", "--prometheus-port",
            "--api-key-file", "--http-api-key-file", "--coordinator-url"} <= set(flags)
    keys = scanned["connector keys"]
    assert {"lmcache.mp.mq_timeout", "lmcache.mp.use_vmm_api",  # ExtraConfigDefault members
            "lmcache.mp.lazy_offload_horizon_steps",  # f"lmcache.mp.lazy_offload_{name}"
            "lmcache.mp.autostart.server_args", "lmcache.mp.host"} <= set(keys)
    assert not [k for k in keys if k.endswith((".", "_"))]  # prefixes are not keys
    env = surface.scan_env_vars()
    assert "lmcache.security.api_key" in env["LMCACHE_API_KEY"]  # read through a constant
    assert {"LMCACHE_RESP_PASSWORD", "LMCACHE_MP_TRANSFER_MODE", "LMCACHE_EC_*"} <= set(env)
    routes = surface.scan_http_routes()
    assert routes["GET /loglevel"].endswith("common.loglevel_api")  # discovered under http_apis/common
    assert {"GET /healthcheck", "PUT /quota/{cache_salt}", "POST /cache/clear"} <= set(routes)


def test_a_flag_is_accepted_exactly_when_our_parser_takes_it(table):
    wrong = {flag: status for flag, (status, _) in table["server flags"].items()
             if (status == ACCEPTED) != (flag in OURS)}
    assert not wrong, f"accepted in the table but not our flag, or ours but not accepted: {wrong}"


SAMPLES = {"--host": ("127.0.0.2", "host"), "--http-host": ("127.0.0.3", "http_host"), "--port": ("5556", "port"),
           "--http-port": ("8081", "http_port"), "--prometheus-port": ("9090", "prometheus_port"),
           "--chunk-size": ("512", "chunk_size"), "--l1-size-gb": ("2.5", "l1_size_gb"),
           "--eviction-policy": ("LRU", "eviction_policy"), "--api-key-file": ("/k", "api_key_file"),
           "--http-api-key-file": ("/k", "api_key_file"), "--separate-object-groups": (None, "separate_object_groups"),
           "--no-separate-object-groups": (False, "separate_object_groups")}


def test_every_accepted_flag_parses_with_lmcaches_value(table):
    accepted = [f for f, (s, _) in table["server flags"].items() if s == ACCEPTED]
    assert sorted(accepted) == sorted(SAMPLES)
    for flag in accepted:
        value, dest = SAMPLES[flag]
        args = build_parser().parse_args([flag] + ([value] if isinstance(value, str) else []))
        got = getattr(args, dest)
        want = {"/k": ["/k"], None: True, False: False}.get(value, value)
        assert got == want or str(got) == value or got == type(got)(value), (flag, got)


def _names_ours(text: str) -> bool:
    """The text names one of our flags or connector settings."""
    tokens = re.findall(r"--[a-z0-9-]+|lmcache\.[a-z_.]+[a-z]", text)
    return any(t in OURS or t in _KEYS or t in (MAX_OFFLOAD_TOKENS, SKIP_LOAD) for t in tokens)


def test_each_refused_flag_stops_the_server_naming_our_equivalent(table):
    refused = {f: text for f, (s, text) in table["server flags"].items() if s == REFUSED}
    assert refused
    procs = {flag: subprocess.Popen([sys.executable, "-m", "cache_server.cli", flag, "4", "--port", "0",
                                     "--http-port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for flag in refused}
    for flag, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 2, (flag, out, err)
        assert f"glm-cache-server: error: {flag} is LMCache's; here: {refused[flag]}" in err, err
        assert _names_ours(refused[flag]), f"{flag}'s refusal names none of our flags or settings"


def test_each_not_applicable_flag_stops_the_server_with_why(table, capsys):
    for flag, (status, text) in table["server flags"].items():
        if status != NOT_APPLICABLE:
            continue
        for argv in ([flag, "x"], [f"{flag}=x"], ["--port", "0", flag]):
            with pytest.raises(SystemExit) as exit_:
                main(argv)
            assert exit_.value.code == 2
            assert f"{flag} is LMCache's; not applicable here: {text}" in capsys.readouterr().err


def test_connector_keys_are_connector_lmcache_settings_own(table):
    """The connector rows are lmcache_settings' (derived by asking translate()), and say
    what it does: an accepted key passes at the value named, a refused one never does."""
    rows = table["connector keys"]
    assert set(rows) == set(_KEYS)
    for key, (status, text) in rows.items():
        if status == REFUSED:
            with pytest.raises(LMCacheSettingRefused):
                translate({key: 1})
        elif text.startswith("only "):
            value = eval(text.split(" ", 2)[1])  # the repr the row shows: True, False or a string
            assert translate({key: value}) == {}
            with pytest.raises(LMCacheSettingRefused):
                translate({key: "not-" + str(value)})
        else:
            assert text.startswith("sets ") and translate({key: surface._EXAMPLES[key]})


def _request(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {KEY}"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _concrete(name: str) -> str:
    """A variable name for a row: a family's pattern made one real name."""
    families = {"LMCACHE_EC_*": "LMCACHE_EC_CHUNK_SIZE", "LMCACHE_{attr_name.upper()}": "LMCACHE_CHUNK_SIZE"}
    return families.get(name, name)


@pytest.fixture(scope="module")
def server(table):
    env = {_concrete(n): "1" for n, (s, _) in table["environment variables"].items() if s != ACCEPTED}
    saved = {n: v for n, v in os.environ.items() if n.startswith("LMCACHE_")}
    for n in saved:
        del os.environ[n]
    os.environ.update(env, LMCACHE_API_KEY=KEY)
    try:
        with ServerProcess(log_path=Path(tempfile.mkdtemp(prefix="lmc-surface-")) / "server.log") as s:
            yield s
    finally:
        for n in [*env, "LMCACHE_API_KEY"]:
            os.environ.pop(n, None)
        os.environ.update(saved)


def test_each_unread_variable_is_named_once_with_our_equivalent(server, table):
    log = server.log()
    for name, (status, text) in table["environment variables"].items():
        concrete = _concrete(name)
        line = f"{concrete} is set and not honoured"
        if status == ACCEPTED:
            assert name in HONOURED_ENV and line not in log
            continue
        where = "here: " if status == REFUSED else "not applicable here: "
        assert log.count(line) == 1, (name, log)
        assert f"{line}: glm-cache-server does not read it ({where}{text}; docs/lmcache-surface.md)" in log
    assert "auth on (LMCACHE_API_KEY)" in log  # the honoured one was read: its key is the token


def _path(route: str) -> tuple[str, str]:
    method, path = route.split(" ", 1)
    return method, re.sub(r"\{[a-z_]+\}", lambda m: {"{backend}": "resp", "{operation}": "add"}.get(m[0], "x"), path)


def test_each_route_answers_as_its_row_says(server, table):
    for route, (status, text) in table["HTTP routes"].items():
        method, path = _path(route)
        body = b"{}" if method == "POST" else None
        code, reply = _request(method, server.http_url + path, body)
        if status == ACCEPTED:
            assert code == 200, (route, code, reply[:200])
        elif status == REFUSED:
            assert code == 501 and text.startswith("501")
            assert "--l1-size-gb" in json.loads(reply)["error"] and "--l1-size-gb" in text, (route, reply)
        else:
            assert code == 404 and "404" in text, (route, code, reply[:200])


def test_the_generated_page_is_current_and_linked():
    page = ROOT / "docs" / "lmcache-surface.md"
    assert page.read_text() == surface.markdown(), \
        "regenerate: python -m validation.lmcache_surface > docs/lmcache-surface.md"
    assert "(lmcache-surface.md)" in (ROOT / "docs" / "migrating-from-lmcache.md").read_text()


def test_the_page_counts_each_kind_and_status(table):
    page = surface.markdown()
    for kind in surface.KINDS:
        counts = [sum(1 for s, _ in table[kind].values() if s == status) for status in surface.STATUSES]
        assert f"| {kind} | {counts[0]} | {counts[1]} | {counts[2]} |" in page
        for key in table[kind]:
            assert f"| `{key}` |" in page


def test_a_name_lmcache_adds_is_found_by_name(monkeypatch):
    """The scan is of the source as it is: a flag, variable, route or key added to LMCache's
    modules (here, into their parsed trees) shows up in the scan, so the first test names it."""
    real = surface._tree
    additions = {
        ("lmcache.v1.multiprocess.config", "add_mp_server_args"): 'mp_group.add_argument("--brand-new-flag")',
        ("lmcache.v1.distributed.l2_adapters.resp_l2_adapter", None): 'x = os.getenv("LMCACHE_BRAND_NEW")',
        ("lmcache.v1.multiprocess.http_apis.info_api", None): '@router.get("/brand-new")\ndef brand_new(): pass',
        ("lmcache.integration.vllm.lmcache_mp_connector", None): 'k = "lmcache.mp.brand_new"',
    }

    def patched(module):
        tree = real(module)
        for (where, function), code in additions.items():
            if module == where:
                tree = copy.deepcopy(tree)
                body = tree.body if function is None else next(
                    n for n in tree.body if getattr(n, "name", None) == function).body
                body.extend(ast.parse(code).body)
        return tree

    monkeypatch.setattr(surface, "_tree", patched)
    assert "--brand-new-flag" in surface.scan_server_flags()
    assert "LMCACHE_BRAND_NEW" in surface.scan_env_vars()
    assert "GET /brand-new" in surface.scan_http_routes()
    assert "lmcache.mp.brand_new" in surface.scan_connector_keys()
    assert "--brand-new-flag" not in surface.table()["server flags"]
