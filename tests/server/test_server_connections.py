"""Connections to glm-cache-server's ZMQ port, bounded before they cost anything
(cache_server.conn_gate), against a real server process over real sockets."""

from __future__ import annotations

import resource
import socket
import urllib.request

from cache_server.client import CacheClient
from cache_server.conn_gate import MIN_PENDING_PER_PEER, PER_PEER_SHARE
from testing.server_process import ServerProcess

FLOOD = 300
WAVE = 100  # a second wave: past the listen backlog, the kernel would hand connections over in bursts
NOFILE = 256  # the RLIMIT_NOFILE, set on the running server
PER_PEER = max(MIN_PENDING_PER_PEER, NOFILE // PER_PEER_SHARE)  # pending handshakes one address may hold


def _refusals(server: ServerProcess) -> dict[str, float]:
    """``glm_cache_refused_connections_total`` by reason."""
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    head = "glm_cache_refused_connections_total{reason=\""
    return {ln[len(head):].split('"', 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith(head)}


def _closed_by_server(flood: list[socket.socket]) -> None:
    """Wait until the server has closed every one of ``flood`` (shut by the gate, or at the
    handshake window; the kernel hands the ones past the listen backlog over in bursts, on
    its SYN-ACK retransmissions), reading libzmq's greeting where it sent one."""
    for s in flood:
        s.settimeout(120)  # generous: a hang fails, a slow machine does not
        while s.recv(4096):
            pass


def test_a_flood_of_idle_connections_is_cut_and_engines_are_still_answered():
    """300 connections that never send a greeting, against a server allowed 256 descriptors
    (the issue's RLIMIT_NOFILE, set on the running server): the accept gate shuts silent
    ones past the per-address cap once their grace is over, libzmq the rest at the handshake
    window; an engine already connected is answered throughout, and a new engine of the
    flood's own address, connecting amid a second wave of 100, is answered too (it greets within
    its grace; silent ones are shut instead). Before: the descriptors ran out and a new
    engine's ping failed."""
    with ServerProcess() as srv:
        resource.prlimit(srv.proc.pid, resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
        with CacheClient(srv.url, timeout_s=30.0, shm=False) as engine:
            engine.ping()
            flood = [socket.create_connection(("127.0.0.1", srv.port), timeout=120) for _ in range(FLOOD)]
            try:
                engine.ping()  # connected before: never touched
                wave = [socket.create_connection(("127.0.0.1", srv.port), timeout=120) for _ in range(WAVE)]
                flood += wave
                with CacheClient(srv.url, timeout_s=30.0, shm=False) as newcomer:
                    newcomer.ping()  # amid the second wave, from the same address
                    engine.ping()
                _closed_by_server(flood)
                engine.ping()
            finally:
                for s in flood:
                    s.close()
        assert _refusals(srv)["pending_cap"] > 0  # the gate shut some (how many depends on when the kernel hands them over)


def test_engines_that_speak_are_not_held_to_the_cap_on_silent_handshakes():
    """Against the same limit, 48 clients of one address connecting at once (replicas
    starting together): each sends its greeting within milliseconds, so the gate no longer
    counts it, and every one is answered although they outnumber the per-address cap."""
    with ServerProcess() as srv:
        resource.prlimit(srv.proc.pid, resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
        clients = [CacheClient(srv.url, timeout_s=30.0, shm=False) for _ in range(PER_PEER + 16)]
        try:
            for c in clients:
                c.ping()
        finally:
            for c in clients:
                c.close()
        assert _refusals(srv)["pending_cap"] == 0



def test_a_connection_that_never_greets_is_shut_at_the_greeting_deadline():
    """Two connections, far below every cap: one sends nothing, one the first 10 bytes of a
    ZMTP greeting (a peer holding a handshake half-open). The gate shuts both once
    SILENT_S has passed since each was accepted, counted as ``silent``; without the
    deadline they would stay until libzmq's handshake window and never be counted. An
    engine connected meanwhile is answered."""
    with ServerProcess() as srv:
        assert _refusals(srv) == {"pending_cap": 0.0, "silent": 0.0}
        quiet = socket.create_connection(("127.0.0.1", srv.port), timeout=120)
        half = socket.create_connection(("127.0.0.1", srv.port), timeout=120)
        try:
            half.sendall(b"\xff" + bytes(8) + b"\x7f")  # the greeting's signature, then nothing
            with CacheClient(srv.url, timeout_s=30.0, shm=False) as engine:
                engine.ping()
                _closed_by_server([quiet, half])
                engine.ping()
        finally:
            quiet.close()
            half.close()
        assert _refusals(srv) == {"pending_cap": 0.0, "silent": 2.0}
