"""What LMCache 0.5.7's operator surface is here, where the server acts on it at start-up.

An operator switching from LMCache's multiprocess server brings its command-line flags and its
``LMCACHE_*`` environment variables. :data:`SERVER_FLAGS` says for each flag whether it is

- ``accepted``: the same name with the same meaning here,
- ``refused``: given here, the start stops with a message naming our equivalent
  (:func:`refusal`, used by :mod:`cache_server.cli`), or
- ``not applicable``: nothing here could take it; the start stops with why.

A set ``LMCACHE_*`` variable we do not read gets one start-up line (:func:`env_hint`).
``validation/lmcache_surface.py`` reads LMCache's installed source for every name of its
surface (flags, connector keys, variables, HTTP routes), checks them against these tables
(``tests/server/test_lmcache_surface.py``) and writes ``docs/lmcache-surface.md``.
"""

from __future__ import annotations

from collections.abc import Iterable

ACCEPTED, REFUSED, NOT_APPLICABLE = "accepted", "refused", "not applicable"
STATUSES = (ACCEPTED, REFUSED, NOT_APPLICABLE)

def _a(why: str) -> tuple[str, str]:
    return ACCEPTED, why


def _r(ours: str) -> tuple[str, str]:
    return REFUSED, ours


def _n(why: str) -> tuple[str, str]:
    return NOT_APPLICABLE, why


_NO_BLEND = "no CacheBlend (--engine-type blend) here: prefix reuse only"
_NO_COORDINATOR = "no LMCache coordinator here: servers share objects through --l2 (a Redis/Valkey tier)"
_NO_GPU = "the server touches no GPU: the engine's workers copy pages (payloads over TCP or host shared memory)"
_NO_POOL = "L1 holds each object in its own allocation as it arrives: no preallocated pool"
_NO_OTEL = "no OpenTelemetry event bus: the server's counters are served at /metrics (Prometheus pull)"
_NO_PLUGINS = "no runtime plugins or server modules: one fixed server"
_NO_SCRIPT = "no /run_script endpoint (no remote code execution)"

# LMCache server flag -> (status, our equivalent or why). "accepted": our parser takes the same
# name with the same meaning; "refused"/"not applicable": cache_server.cli stops with exit 2 and
# this text (refusal), before argparse could say only "unrecognized arguments".
SERVER_FLAGS: dict[str, tuple[str, str]] = {
    "--api-key-file": _a("the key becomes the server's one token (ZMQ and HTTP), LMCache's header rules"),
    "--http-api-key-file": _a("LMCache's alias of --api-key-file, the same here"),
    "--host": _a("binds ZMQ, and HTTP too unless --http-host is given (LMCache's HTTP default is 127.0.0.1)"),
    "--port": _a("the ZMQ port (5555 in both)"),
    "--http-host": _a("binds HTTP apart from ZMQ"),
    "--http-port": _a("the HTTP port (8080 in both)"),
    "--prometheus-port": _a("/metrics alone, without a key (LMCache: 9090, always on; here only when given)"),
    "--chunk-size": _a("minimum chunk size, rounded up to the engine's alignment at handshake, as LMCache"),
    "--l1-size-gb": _a("the in-memory byte budget"),
    "--eviction-policy": _a("LRU as LMCache's (in our retention classes); our default is value; ARC, "
                            "IsolatedLRU and noop are refused by argparse's choices"),
    "--separate-object-groups": _a("one object per cache group, required for hybrid models in both"),
    "--no-separate-object-groups": _a("one object per chunk, as LMCache's (ours is on by default: every model "
                                      "this project serves is hybrid)"),
    "--max-workers": _r("--workers N (threads answering requests)"),
    "--max-cpu-workers": _r("--workers N (one pool of threads answers every request)"),
    "--max-gpu-workers": _r("--workers N; " + _NO_GPU),
    "--l1-read-ttl-seconds": _r("--lease-ttl-s SECONDS (how long a lookup's hit stays pinned if never released)"),
    "--l1-manager": _r("--l1-size-gb GIB (one DRAM L1; no DEVDAX or GDS tiers)"),
    "--l2-adapter": _r("--l2 redis://HOST:PORT or redis+cluster://... with --l2-secret-file PATH (one RESP tier)"),
    "--eviction-trigger-watermark": _r("--l1-size-gb GIB: eviction starts when the budget is full; for LMCache's "
                                       "headroom give the watermark x your pool"),
    "--hash-algorithm": _r("the connector's lmcache.mp.hash_algorithm (blake3) and chunk_keys: lookups send keys, "
                           "the server hashes no tokens"),
    "--supported-transfer-mode": _r("the connector's lmcache.mp.mp_transfer_mode engine_driven, always; " + _NO_GPU),
    "--shm-name": _r("nothing to name: each same-host client offers its own sealed memfd segment (--no-shm "
                     "turns that off)"),
    "--transport": _r("leave it out: ZMQ on --port is the only transport (LMCache's default)"),
    "--kv-load-policy": _r("lmcache.skip_load in a request's kv_transfer_params (the connector honours it)"),
    "--otlp-endpoint": _r("scrape /metrics on --http-port or --prometheus-port; " + _NO_OTEL),
    "--coordinator-url": _r("--l2 URL: " + _NO_COORDINATOR),
    "--p2p-advertise-url": _r("--l2 URL: servers share objects through a Redis/Valkey tier, not peer to peer"),
    "--eviction-ratio": _n("eviction frees what each put needs, no more"),
    "--l1-write-ttl-seconds": _n("a put is stored whole within one request: no write lock to time out"),
    "--instance-id": _n("no coordinator membership or OTel resource to name"),
    "--null-block-id": _n("the connector sends pages, not engine block IDs"),
    "--grpc-server-workers": _n("no gRPC transport (ZMQ only); see --workers"),
    "--grpc-server-mode": _n("no gRPC transport (ZMQ only)"),
    "--engine-type": _n(_NO_BLEND),
    "--enable-segmented-prefix": _n(_NO_BLEND),
    "--enable-dedup-content": _n(_NO_BLEND),
    "--enable-blend-reorder": _n(_NO_BLEND),
    "--coordinator-blend-timeout": _n(_NO_BLEND),
    "--coordinator-blend-match-concurrency": _n(_NO_BLEND),
    "--isolated-ipc": _n("no CUDA IPC: " + _NO_GPU),
    "--no-isolated-ipc": _n("no CUDA IPC: " + _NO_GPU),
    "--runtime-plugin-locations": _n(_NO_PLUGINS),
    "--runtime-plugin-config": _n(_NO_PLUGINS),
    "--server-module": _n(_NO_PLUGINS),
    "--script-allowed-imports": _n(_NO_SCRIPT),
    "--run-script-api-enabled": _n(_NO_SCRIPT),
    "--no-run-script-api-enabled": _n(_NO_SCRIPT),
    "--worker-reap-timeout-seconds": _n("no worker registrations to reap: every request names its namespace"),
    "--worker-registration-grace-seconds": _n("no worker registrations: every request names its namespace"),
    "--session-ttl-seconds": _n("no per-request sessions: leases (--lease-ttl-s) are what a lookup holds"),
    "--kv-event-log-size": _n("KV events come from the engine (GlmCacheConnector with vLLM's --kv-events-config)"),
    "--l1-use-lazy": _n(_NO_POOL),
    "--no-l1-use-lazy": _n(_NO_POOL),
    "--l1-init-size-gb": _n(_NO_POOL),
    "--l1-align-bytes": _n(_NO_POOL),
    "--l1-use-hugepages": _n(_NO_POOL),
    "--no-l1-use-hugepages": _n(_NO_POOL),
    "--l1-devdax-path": _n("no DEVDAX L1: " + _NO_POOL),
    "--l1-devdax-offset-gb": _n("no DEVDAX L1: " + _NO_POOL),
    "--l1-mlock": _n(_NO_POOL),
    "--gds-l1-path": _n("no GPUDirect Storage L1"),
    "--gds-l1-use-direct-io": _n("no GPUDirect Storage L1"),
    "--no-gds-l1-use-direct-io": _n("no GPUDirect Storage L1"),
    "--gds-l1-backend": _n("no GPUDirect Storage L1"),
    "--l2-store-policy": _n("--l2 writes every stored object through (LMCache's default policy); no other"),
    "--l2-prefetch-policy": _n("one L2 tier: a lookup promotes what it adds"),
    "--l2-prefetch-inflight-watermark": _n("promotion happens inside the lookup, within the L2 URL's timeout_s"),
    "--l2-prefetch-max-in-flight": _n("deprecated and ignored by LMCache itself"),
    "--periodic-notifier-interval-ms": _n("no periodic notifier"),
    "--disable-observability": _n(_NO_OTEL),
    "--disable-metrics": _n(_NO_OTEL),
    "--disable-grpc-metrics": _n("no gRPC transport (ZMQ only)"),
    "--disable-logging": _n(_NO_OTEL + "; the log is --log-level's"),
    "--enable-tracing": _n(_NO_OTEL),
    "--enable-token-trace": _n(_NO_OTEL),
    "--event-bus-queue-size": _n(_NO_OTEL),
    "--metrics-sample-rate": _n("no lifecycle histograms: counters count every event"),
    "--lookup-hash-log-dir": _n("no lookup hash log"),
    "--lookup-hash-log-rotation-interval": _n("no lookup hash log"),
    "--lookup-hash-log-rotation-max-size": _n("no lookup hash log"),
    "--lookup-hash-log-max-files": _n("no lookup hash log"),
    "--enable-gc-monitor": _n("no garbage-collection monitor"),
    "--gc-monitor-min-pause-ms": _n("no garbage-collection monitor"),
    "--gc-monitor-top-objects": _n("no garbage-collection monitor"),
    "--enable-extra-logging": _n("no GPU<->CPU copies in the server to log; the figures are at /metrics"),
    "--extra-logging-interval": _n("no GPU<->CPU copies in the server to log; the figures are at /metrics"),
    "--trace-level": _n("no storage or event trace recorder"),
    "--trace-output": _n("no storage or event trace recorder"),
    "--coordinator-advertise-ip": _n(_NO_COORDINATOR),
    "--coordinator-heartbeat-interval": _n(_NO_COORDINATOR),
    "--coordinator-event-reporting": _n(_NO_COORDINATOR),
    "--coordinator-event-flush-interval": _n(_NO_COORDINATOR),
    "--coordinator-event-transport": _n(_NO_COORDINATOR),
    "--coordinator-kafka-bootstrap-servers": _n(_NO_COORDINATOR),
    "--coordinator-kafka-topic": _n(_NO_COORDINATOR),
    "--coordinator-kafka-delivery-timeout": _n(_NO_COORDINATOR),
    "--coordinator-l2-event-reporting": _n(_NO_COORDINATOR),
    "--coordinator-l2-event-flush-interval": _n(_NO_COORDINATOR),
    "--p2p-listen-url": _n("no peer-to-peer transfer: servers share through --l2"),
    "--p2p-lookup-timeout": _n("no peer-to-peer transfer: servers share through --l2"),
    "--p2p-load-timeout": _n("no peer-to-peer transfer: servers share through --l2"),
    "--p2p-transfer-engine": _n("no peer-to-peer transfer: servers share through --l2"),
}


def refusal(argv: Iterable[str], ours: Iterable[str]) -> str | None:
    """The message for the first LMCache server flag in ``argv`` that our parser (option
    strings ``ours``) does not take, or None. ``--flag=value`` counts as ``--flag``."""
    ours = set(ours)
    for arg in argv:
        if arg == "--":
            return None
        name = arg.split("=", 1)[0]
        if name in SERVER_FLAGS and name not in ours:
            status, text = SERVER_FLAGS[name]
            where = "here: " if status == REFUSED else "not applicable here: "
            return f"{name} is LMCache's; {where}{text}"
    return None


# LMCACHE_* variables: those cache_server.lmcache_compat.HONOURED_ENV names are read with
# LMCache's meaning; every other one that is set is named at start-up, one line, with the text
# below (cache_server.cli), and otherwise not acted on.
_ENV_OURS: dict[str, tuple[str, str]] = {
    "LMCACHE_RESP_HOST": _r("--l2 redis://HOST:PORT (the L2 URL)"),
    "LMCACHE_RESP_PORT": _r("--l2 redis://HOST:PORT (the L2 URL)"),
    "LMCACHE_RESP_USERNAME": _r("--l2 redis://USER:PASSWORD@HOST:PORT (the L2 URL)"),
    "LMCACHE_RESP_PASSWORD": _r("--l2 redis://USER:PASSWORD@HOST:PORT (the L2 URL)"),
    "LMCACHE_LOG_LEVEL": _r("--log-level LEVEL"),
    "LMCACHE_MP_TRANSFER_MODE": _r("engine-driven always (the connector's lmcache.mp.mp_transfer_mode "
                                   "engine_driven); " + _NO_GPU),
    "LMCACHE_COORDINATOR_URL": _r("--l2 URL: " + _NO_COORDINATOR),
    "LMCACHE_COORDINATOR_ADVERTISE_IP": _n(_NO_COORDINATOR),
    "LMCACHE_COORDINATOR_HEARTBEAT_INTERVAL": _n(_NO_COORDINATOR),
    "LMCACHE_COORDINATOR_EVENT_REPORTING": _n(_NO_COORDINATOR),
    "LMCACHE_COORDINATOR_EVENT_FLUSH_INTERVAL": _n(_NO_COORDINATOR),
    "LMCACHE_AEROSPIKE_HOSTS": _n("no Aerospike L2: --l2 is Redis/Valkey"),
    "LMCACHE_AEROSPIKE_NAMESPACE": _n("no Aerospike L2: --l2 is Redis/Valkey"),
    "LMCACHE_AEROSPIKE_SET": _n("no Aerospike L2: --l2 is Redis/Valkey"),
    "LMCACHE_AEROSPIKE_USERNAME": _n("no Aerospike L2: --l2 is Redis/Valkey"),
    "LMCACHE_AEROSPIKE_PASSWORD": _n("no Aerospike L2: --l2 is Redis/Valkey"),
    "LMCACHE_CONFIG_FILE": _n("LMCache's in-process engine configuration (LMCacheConnectorV1): the MP server "
                              "takes flags, and so does this one"),
    "LMCACHE_EC_*": _n("LMCache's in-process engine configuration overrides (LMCacheConnectorV1)"),
    "LMCACHE_{attr_name.upper()}": _n("LMCACHE_<setting> of LMCache's in-process engine configuration "
                                      "(LMCacheConnectorV1: LMCACHE_CHUNK_SIZE, LMCACHE_LOCAL_CPU, ...); "
                                      "the MP server takes flags, and so does this one"),
    "LMCACHE_DEVICE_BACKEND": _n(_NO_GPU),
    "LMCACHE_DISABLE_BANNER": _n("no banner is printed"),
    "LMCACHE_TRACK_USAGE": _n("no usage telemetry is sent"),
    "LMCACHE_USAGE_TRACK_URL": _n("no usage telemetry is sent"),
    "LMCACHE_USAGE_TRACK_INTERVAL": _n("no usage telemetry is sent"),
    "LMCACHE_REQUEST_TELEMETRY_TYPE": _n("no per-request telemetry export: the connector counts in vLLM's "
                                         "/metrics (vllm:glm_cache_*)"),
    "LMCACHE_REQUEST_TELEMETRY_ENDPOINT": _n("no per-request telemetry export: the connector counts in vLLM's "
                                             "/metrics (vllm:glm_cache_*)"),
}


def env_vars() -> dict[str, tuple[str, str]]:
    from cache_server.lmcache_compat import HONOURED_ENV

    honoured = {name: _a("read with LMCache's meaning: the API key, used as the server's token (the "
                         "legacy HTTP variable only when the new one is unset, as in LMCache)")
                for name in HONOURED_ENV}
    return {**honoured, **_ENV_OURS}


def env_hint(name: str) -> str:
    """What the start-up line says of a set ``LMCACHE_*`` variable we do not read: our equivalent
    or why none applies. A name not listed is taken for a setting of LMCache's in-process engine
    configuration (``LMCACHE_<setting>``, the only other reader of such names)."""
    entry = _ENV_OURS.get(name)
    if entry is None:
        entry = _ENV_OURS["LMCACHE_EC_*" if name.startswith("LMCACHE_EC_") else "LMCACHE_{attr_name.upper()}"]
    return ("here: " if entry[0] == REFUSED else "not applicable here: ") + entry[1]
