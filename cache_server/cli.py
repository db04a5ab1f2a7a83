"""Command line of glm-cache-server."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping

import zmq

from cache_server.auth import (
    MIN_L2_SECRET_CHARS,
    TokenFileError,
    is_loopback,
    lmcache_api_keys,
    lmcache_key_variables,
    read_token_file,
    world_readable,
)
from cache_server.config import GIB, MIB, PUT_OBJECTS_BOUND, ServerConfig
from cache_server.conn_gate import HANDSHAKE_S, SILENT_S, pending_caps, raise_nofile_limit
from cache_server.http import start_http
from cache_server.lmcache_compat import unhonoured_lmcache_env
from cache_server.lmcache_surface import env_hint, refusal
from cache_server.server import CacheServer

logger = logging.getLogger("glm_cache_server")


def _number(kind: type, what: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse type: ``kind`` parsed from text, accepted where ``ok`` holds."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _number(int, "a positive integer", lambda v: v > 0)
_port = _number(int, "a port number in 0..65535", lambda v: 0 <= v <= 65535)
_positive_float = _number(float, "a positive finite number", lambda v: 0 < v < float("inf"))
_fraction = _number(float, "a fraction in (0, 1]", lambda v: 0 < v <= 1)
_open_fraction = _number(float, "a fraction in (0, 1)", lambda v: 0 < v < 1)


_DEFAULTS = ServerConfig()  # the server's defaults, written once (cache_server.config)


def build_parser() -> argparse.ArgumentParser:
    """The command line; every default is :class:`ServerConfig`'s, in the flag's unit."""
    d = _DEFAULTS
    ap = argparse.ArgumentParser(
        prog="glm-cache-server",
        description="Standalone LRU cache server for hybrid (KDA + sparse-MLA) prompt state, "
                    "shared by any number of vLLM replicas running GlmCacheConnector.")
    ap.add_argument("--host", default=d.host,
                    help="address to bind the ZMQ socket, and HTTP unless --http-host is given (default "
                         "%(default)s; binding beyond loopback needs --auth-token-file or --insecure-no-auth)")
    ap.add_argument("--http-host", default=d.http_host, metavar="HOST",
                    help="address to bind HTTP, as LMCache's --http-host (default: --host; LMCache's is "
                         "127.0.0.1; beyond loopback it needs a token or --insecure-no-auth, as --host does)")
    ap.add_argument("--port", type=_port, default=d.port, metavar="N",
                    help="ZMQ ROUTER port (default %(default)s; 0 picks a free one)")
    ap.add_argument("--http-port", type=_port, default=d.http_port, metavar="N",
                    help="HTTP port for /healthcheck, /status, /metrics (default %(default)s; 0 disables HTTP)")
    ap.add_argument("--prometheus-port", type=_port, default=d.prometheus_port, metavar="N",
                    help="also serve GET /metrics alone on this port of --http-host (else --host), without a "
                         "token, as LMCache's separate Prometheus port (LMCache: 9090, always on); 0 picks a "
                         "free one (default: none, /metrics is on --http-port)")
    ap.add_argument("--http-timeout-s", type=_positive_float, default=d.http_timeout_s, metavar="SECONDS",
                    help="seconds an HTTP connection has to send its whole request, however slowly it trickles "
                         "in, and to take the reply; then it is closed (default %(default)s)")
    ap.add_argument("--http-max-connections", type=_positive_int, default=d.http_max_connections, metavar="N",
                    help="HTTP connections open at once, each a thread; one more sheds the one waiting longest "
                         "for its request, or is answered 503 if all are being answered (default %(default)s)")
    ap.add_argument("--chunk-size", type=_positive_int, default=d.min_chunk_size, metavar="N",
                    help="minimum chunk size in tokens; each engine gets the smallest multiple of its "
                         "alignment at least this large (default %(default)s)")
    ap.add_argument("--l1-size-gb", type=_positive_float, default=d.l1_size_bytes / GIB, metavar="GIB",
                    help="byte budget of the in-memory store in GiB (default %(default)s)")
    ap.add_argument("--eviction-policy", choices=["value", "LRU"], default=d.eviction_policy,
                    help="order within each retention class (worthless, superseded, the rest): 'value' "
                         "(recency and prefill saved per byte, GreedyDual) or 'LRU' (default %(default)s)")
    ap.add_argument("--l1-state-share", type=_open_fraction, default=d.l1_state_share, metavar="FRACTION",
                    help="give the state groups of engines that declared them a separate share of "
                         "--l1-size-gb, in (0, 1); default: one budget for all (measured better)")
    ap.add_argument("--separate-object-groups", action=argparse.BooleanOptionalAction, default=d.separate_object_groups,
                    help="store one object per cache group, required for hybrid KDA/Mamba models (on by default; "
                         "--no-separate-object-groups, as LMCache's, turns it off)")
    ap.add_argument("--max-object-size-mb", type=_positive_float, default=None, metavar="MIB",
                    help=f"largest object accepted, in MiB (default {d.max_object_bytes / MIB:g}, or the whole "
                         "budget if smaller)")
    ap.add_argument("--lease-ttl-s", type=_positive_float, default=d.lease_ttl_s, metavar="SECONDS",
                    help="seconds a lookup's hit stays pinned if never released (default %(default)s)")
    ap.add_argument("--debug-fault-hooks", action="store_true", default=d.debug_fault_hooks,
                    help="testing only: enable the debug_corrupt op (flips a byte of a stored object: bit "
                         "rot cannot be caused otherwise) and debug_die_on (SIGKILL on the next get/put, to "
                         "crash mid-transfer); never in production")
    auth = ap.add_mutually_exclusive_group()
    auth.add_argument("--auth-token-file", metavar="PATH", default=None,
                      help="file holding a shared secret (one word, at least 16 characters) that every ZMQ "
                           "request and the HTTP /status and /cache/clear must carry; one token for all "
                           "namespaces")
    auth.add_argument("--insecure-no-auth", action="store_true",
                      help="allow binding beyond loopback without a token: anyone who reaches the port "
                           "may read, write and clear the cache")
    ap.add_argument("--api-key-file", "--http-api-key-file", dest="api_key_file", action="append", default=None,
                    metavar="PATH",
                    help="LMCache's key flag, repeatable: the file's key becomes the token (as --auth-token-file, "
                         "same rules); as in LMCache, LMCACHE_API_KEY_FILE and LMCACHE_API_KEY (else "
                         "LMCACHE_HTTP_API_KEY[_FILE]) add keys, and HTTP /metrics then needs the key too (only / "
                         "and /healthcheck stay open); all sources must hold the same key (one token)")
    ap.add_argument("--max-message-mb", type=_positive_float, default=None, metavar="MIB",
                    help="largest request in MiB, header and payloads together; ZMQ disconnects a peer that "
                         "sends a bigger frame, a bigger total is answered too_large (default: "
                         f"{PUT_OBJECTS_BOUND} maximum-size objects, at most the L1 budget, plus the header cap)")
    ap.add_argument("--max-header-kb", type=_positive_int, default=d.max_header_bytes >> 10, metavar="KIB",
                    help="largest request header in KiB, refused before parsing (default %(default)s)")
    ap.add_argument("--max-leases-per-client", type=_positive_int, default=d.max_leases_per_client, metavar="N",
                    help="leases one connection holds; its oldest is dropped for a new one (default %(default)s)")
    ap.add_argument("--max-leased-fraction", type=_fraction, default=d.max_leased_fraction, metavar="FRACTION",
                    help="share of the L1 budget leases may pin; the oldest leases are dropped to stay under it "
                         "(default %(default)s)")
    ap.add_argument("--max-namespaces", type=_positive_int, default=d.max_namespaces, metavar="N",
                    help="namespaces known at once; a new one replaces the least recently used empty one, "
                         "else it is refused (default %(default)s)")
    ap.add_argument("--l2", metavar="URL", default=d.l2_url,
                    help="second tier on a Redis/Valkey store shared by many servers: redis://host:port or "
                         "redis+cluster://host:port,host:port,... (query: timeout_s, retry_after_s, queue_mb, "
                         "prefix, ttl_s); every stored object is written through asynchronously, a lookup "
                         "promotes what L2 adds; needs --l2-secret-file (default: none)")
    ap.add_argument("--l2-secret-file", metavar="PATH", default=None,
                    help=f"file holding the secret (one word, at least {MIN_L2_SECRET_CHARS} characters) that "
                         "authenticates every L2 value (keyed blake3 over key, metadata and payload), so a value "
                         "written into the store by anyone else is refused; every server sharing the store needs "
                         "the same one, no client ever does (required with --l2)")
    ap.add_argument("--no-shm", action="store_false", dest="shm", default=d.shm,
                    help="offer no shared memory to clients on this host: every payload travels over the "
                         "socket (default: same-host clients that offer a sealed memfd segment at hello move "
                         "payloads through it)")
    ap.add_argument("--no-arena", action="store_false", dest="arena", default=d.arena,
                    help="keep no arena: same-host gets are copied into each client's own segment. The arena "
                         "(objects of 256 KiB and more, one mapping) is readable by every same-host client the "
                         "server agreed shared memory with and by every process of the server's user, whatever "
                         "namespace or cache_salt stored them: use this where tenants on one host are kept "
                         "apart by cache_salt only")
    ap.add_argument("--workers", type=_positive_int, default=d.workers, metavar="N",
                    help="threads answering requests, so one engine's large transfer does not hold the others "
                         "behind it (default %(default)s)")
    ap.add_argument("--io-threads", type=_positive_int, default=d.io_threads, metavar="N",
                    help="ZMQ I/O threads reading and writing the sockets (default %(default)s)")
    ap.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                    type=str.upper, help="log level (default %(default)s)")
    return ap


def config_from_args(args: argparse.Namespace, auth_token: str | None = None,
                     l2_secret: bytes | None = None, metrics_need_auth: bool = False) -> ServerConfig:
    """The :class:`ServerConfig` a parsed command line asks for (the secrets read from their files)."""
    l1_size_bytes = int(args.l1_size_gb * GIB)
    return ServerConfig(
        host=args.host, port=args.port, http_port=args.http_port, http_host=args.http_host,
        prometheus_port=args.prometheus_port, min_chunk_size=args.chunk_size,
        l1_size_bytes=l1_size_bytes,
        max_object_bytes=(int(args.max_object_size_mb * MIB) if args.max_object_size_mb is not None
                          else min(_DEFAULTS.max_object_bytes, l1_size_bytes)),
        separate_object_groups=args.separate_object_groups, lease_ttl_s=args.lease_ttl_s,
        eviction_policy=args.eviction_policy, l1_state_share=args.l1_state_share,
        debug_fault_hooks=args.debug_fault_hooks,
        auth_token=auth_token, metrics_need_auth=metrics_need_auth,
        max_message_bytes=int(args.max_message_mb * MIB) if args.max_message_mb is not None else None,
        max_header_bytes=args.max_header_kb << 10, max_leases_per_client=args.max_leases_per_client,
        max_leased_fraction=args.max_leased_fraction, max_namespaces=args.max_namespaces, l2_url=args.l2,
        l2_secret=l2_secret,
        shm=args.shm, arena=args.arena, workers=args.workers, io_threads=args.io_threads,
        http_timeout_s=args.http_timeout_s, http_max_connections=args.http_max_connections)


def flags_table(parser: argparse.ArgumentParser | None = None) -> str:
    """The command line as a Markdown table, ``| flag | default | meaning |``, one row per
    option in the order of ``--help`` (``--help`` itself left out), for the docs."""
    ap = parser or build_parser()
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for action in ap._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs != 0:
            flag += " " + (action.metavar or ("{" + ",".join(action.choices) + "}" if action.choices
                                              else action.dest.upper()))
        if action.nargs == 0:  # a switch: the default is not giving it
            default = "off"
        else:
            default = "none" if action.default is None else f"`{action.default}`"
        meaning = (action.help or "") % dict(vars(action), prog=ap.prog)
        cell = meaning.replace("|", r"\|")
        rows.append(f"| `{flag}` | {default} | {cell} |")
    return "\n".join(rows) + "\n"


def _return_freed_payloads_to_the_os() -> None:
    """Objects are megabytes and churn constantly. glibc serves such blocks with mmap only
    up to a threshold it raises each time one is freed (to 32 MiB), after which freed
    payloads stay in fragmented heap arenas and RSS drifts well past the byte budget.
    Pinning the threshold keeps every payload-sized block an mmap that free() returns."""
    import ctypes
    import ctypes.util

    m_mmap_threshold = -3
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(m_mmap_threshold, 256 * 1024)
    except (OSError, AttributeError):  # not glibc: its allocator has its own policy
        pass


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    lmcache_flag = refusal(sys.argv[1:] if argv is None else argv, ap._option_string_actions)
    if lmcache_flag is not None:  # LMCache's server flag we do not take: say what to use instead
        ap.error(lmcache_flag)
    args = ap.parse_args(argv)  # invalid values exit 2 with argparse's message
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _return_freed_payloads_to_the_os()
    auth_token, token_source, metrics_need_auth = _auth_token(ap, args, os.environ)
    if auth_token is None and not args.insecure_no_auth:
        for flag, where in (("--host", args.host), ("--http-host", args.http_host)):
            if where is not None and not is_loopback(where):
                ap.error(f"{flag} {where} is reachable beyond this machine: pass --auth-token-file PATH "
                         "(or --api-key-file PATH; or, on a network you trust completely, --insecure-no-auth)")
    l2_secret = None
    if args.l2 is None and args.l2_secret_file is not None:
        ap.error("--l2-secret-file is given without --l2")
    if args.l2 is not None:
        if args.l2_secret_file is None:
            ap.error("--l2 needs --l2-secret-file PATH: the secret every server sharing the store holds, which "
                     "authenticates each L2 value (e.g. python -c 'import secrets; print(secrets.token_urlsafe(48))'"
                     " > PATH; chmod 600 PATH)")
        try:
            l2_secret = read_token_file(args.l2_secret_file, "L2 secret", MIN_L2_SECRET_CHARS).encode()
        except TokenFileError as e:
            ap.error(str(e))
        if world_readable(args.l2_secret_file):
            logger.warning("L2 secret file %s is readable by every local user; chmod 600 it", args.l2_secret_file)
    if args.prometheus_port and args.prometheus_port == args.http_port:
        ap.error(f"--prometheus-port {args.prometheus_port} is --http-port too: give it another port")
    config = config_from_args(args, auth_token, l2_secret, metrics_need_auth)
    if config.max_object_bytes > config.l1_size_bytes:
        ap.error(f"--max-object-size-mb ({args.max_object_size_mb}) exceeds --l1-size-gb ({args.l1_size_gb} GiB)")
    if config.message_limit_bytes < config.max_object_bytes:
        ap.error(f"--max-message-mb ({args.max_message_mb}) is below the maximum object size "
                 f"({config.max_object_bytes} bytes): a put of one such object could never arrive")
    if config.l2_url is not None:
        from cache_server.l2_config import L2Config, L2ConfigError

        try:
            L2Config.from_url(config.l2_url, allow_debug=config.debug_fault_hooks, secret=l2_secret)
        except L2ConfigError as e:
            ap.error(str(e))
    try:
        nofile = raise_nofile_limit()  # before any socket: descriptors are what a flood of connections takes
        server = CacheServer(config)
    except zmq.ZMQError as e:
        logger.error("cannot bind tcp://%s:%d: %s", config.host, config.port, e)
        return 1
    # Before HTTP answers its health check: a supervisor (or a test) that saw it up and stops
    # the server at once gets a clean shutdown, not the signal's default death.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: (logger.info("received %s, shutting down",
                                                               signal.Signals(signum).name), server.stop()))
    httpd = metricsd = None
    http_host = config.bound_http_host
    # The metrics port first: HTTP's health check answering then means both are up.
    for port, metrics_only in ((config.prometheus_port, True), (config.http_port, False)):
        if (port is None) if metrics_only else (port == 0):
            continue  # no --prometheus-port: no metrics port; --http-port 0: no HTTP
        try:
            bound = start_http(server, http_host, port, metrics_only=metrics_only)
        except OSError as e:
            logger.error("cannot bind %s on %s:%d: %s", "--prometheus-port" if metrics_only else "HTTP", http_host,
                         port, e)
            for started in (httpd, metricsd):
                if started is not None:
                    started.shutdown()
                    started.server_close()
            server.stop()
            server.serve_forever()  # closes the socket at once
            return 1
        if metrics_only:
            metricsd = bound
        else:
            httpd = bound
    http_where = f"http://{http_host}:{httpd.server_address[1]}" if httpd else "disabled"
    logger.info("glm-cache-server listening on tcp://%s:%d (HTTP %s)", config.host, server.port, http_where)
    if metricsd is not None:
        logger.info("Prometheus metrics (--prometheus-port, no token) on http://%s:%d/metrics", http_host,
                    metricsd.server_address[1])
    if config.auth_token is not None:
        logger.info("auth on (%s): every ZMQ request and every HTTP route but %s need the token "
                    "(Authorization: Bearer or X-LMCache-API-Key)", token_source,
                    "/ and /healthcheck" if config.metrics_need_auth else "/, /healthcheck and /metrics")
    elif is_loopback(config.host) and is_loopback(http_host):
        logger.info("auth off: bound to loopback only")
    else:
        logger.warning("auth OFF on %s (--insecure-no-auth): anyone who reaches the port can read, "
                       "write and clear the cache", config.host)
    logger.info("budget %.2f GiB (%d bytes), eviction %s, separate object groups %s, min chunk %d tokens, "
                "max object %d bytes, lease TTL %.0f s", config.l1_size_bytes / GIB, config.l1_size_bytes,
                config.eviction_policy, "on" if config.separate_object_groups else "off",
                config.min_chunk_size, config.max_object_bytes, config.lease_ttl_s)
    logger.info("limits: message %d bytes, header %d bytes, %d leases per client, %d leased bytes, %d namespaces",
                config.message_limit_bytes, config.max_header_bytes, config.max_leases_per_client,
                server.store.max_leased_bytes, config.max_namespaces)
    logger.info("%d workers, %d ZMQ I/O threads, same-host shared memory %s", config.workers, config.io_threads,
                "on" if server.same_host.segments.snapshot()["enabled"] else "off")
    logger.info("connections: %d open descriptors at most (RLIMIT_NOFILE), a greeting within %.0f s and the handshake "
                "within %.0f s, at most %d under way per address and %d in all", nofile, SILENT_S, HANDSHAKE_S,
                *pending_caps())
    if httpd:
        logger.info("HTTP: at most %d connections, %.0f s for each request", config.http_max_connections,
                    config.http_timeout_s)
    if server.l2 is not None:
        logger.info("L2 on %s: write-through (asynchronous, %d MiB queue), promotion at lookup within %.1fs",
                    server.l2.config.redacted(), server.l2.config.queue_bytes >> 20, server.l2.config.timeout_s)
    server.serve_forever()
    for started in (httpd, metricsd):
        if started is not None:
            started.shutdown()
            started.server_close()
    logger.info("stopped")
    return 0


def _auth_token(ap: argparse.ArgumentParser, args: argparse.Namespace,
                environ: Mapping[str, str]) -> tuple[str | None, str, bool]:
    """The token, what gave it, and whether /metrics needs it (LMCache's rule, when a key was
    given LMCache's way). ``--auth-token-file`` and LMCache's sources (``--api-key-file``,
    ``LMCACHE_[HTTP_]API_KEY[_FILE]``) may be combined if they hold one key: LMCache accepts
    several at once (rotation), this server one token. The unhonoured ``LMCACHE_*`` variables
    are named here, one line each."""
    _, _, shadowed = lmcache_key_variables(environ)
    for name in unhonoured_lmcache_env(environ, shadowed):
        if name in shadowed:
            logger.warning("%s is set and ignored: %s takes precedence, as in LMCache", name,
                           name.replace("_HTTP_", "_"))
        else:
            logger.warning("%s is set and not honoured: glm-cache-server does not read it (%s; "
                           "docs/lmcache-surface.md)", name, env_hint(name))
    keys: list[tuple[str, str]] = []
    if args.auth_token_file is not None:
        try:
            keys.append((f"--auth-token-file {args.auth_token_file}", read_token_file(args.auth_token_file)))
        except TokenFileError as e:
            ap.error(str(e))
    try:
        lmcache_keys = lmcache_api_keys(args.api_key_file or [], environ)
    except TokenFileError as e:
        ap.error(f"{e} (LMCache's API key, used as our token)")
    if lmcache_keys and args.insecure_no_auth:
        ap.error(f"--insecure-no-auth contradicts the API key of {lmcache_keys[0][0]}: drop one")
    keys += lmcache_keys
    for source, _ in keys:
        path = source.split(" ", 1)[1] if source.startswith("--") else (
            source.split("=", 1)[1] if "=" in source else None)
        if path is not None and world_readable(path):
            logger.warning("token file %s is readable by every local user; chmod 600 it unless "
                           "this host (or container) has no other users", path)
    if len({key for _, key in keys}) > 1:
        ap.error("these hold different keys: " + ", ".join(source for source, _ in keys) + "; glm-cache-server "
                 "has one token (LMCache accepts each during a rotation): give one key")
    if not keys:
        return None, "", False
    return keys[0][1], ", ".join(source for source, _ in keys), bool(lmcache_keys)


if __name__ == "__main__":
    sys.exit(main())
