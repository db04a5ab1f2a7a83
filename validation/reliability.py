"""Fault injection against real processes: glm-cache-server and a live vLLM engine.

    python -m validation.reliability            # the full run (about 9 minutes on 2 cores)
    python -m validation.reliability --quick    # fewer frames, shorter churn (what the tests run)

Prints one table: each fault, what was measured, and whether the rule held. The rules: a
fault costs a recompute, never a wrong token and never a stalled or dead engine; nothing a
client sends takes the server down; the server's memory stays within its budget.

Faults a process cannot be made to suffer on demand use the server's testing flag
``--debug-fault-hooks``: ``debug_corrupt`` flips a byte of a stored object (bit rot) and
``debug_die_on`` SIGKILLs the server when the next get/put arrives (a crash mid-transfer).
Everything else is done to the real processes: SIGKILL, SIGSTOP, random frames, floods.
The integrity rows attack what a cached object is bound to: values written straight into a
real Redis cluster that two servers share as L2 (forged, replayed), new weights at the same
model path, a server back with another chunk size while a prompt prefills, and a peer
without the token sending more than the message limit.
Exits non-zero if any rule failed.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import secrets
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import zmq

from cache_server.auth import PLAIN_USERNAME
from cache_server.client import CacheClient
from cache_server.client.errors import CacheServerError
from testing.server_process import ServerProcess, free_port
from testing.vllm_keys import vllm_chunk_keys

ROOT = Path(__file__).resolve().parents[1]

MIB = 1 << 20
TIMEOUT_S = 1.0
RETRY_S = 1.0


@dataclass
class Row:
    fault: str
    measured: str
    held: bool


def _status_bytes(pid: int, field: str) -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` in bytes (None if the kernel has no such field)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def rss_bytes(pid: int) -> int:
    value = _status_bytes(pid, "VmRSS")
    if value is None:
        raise RuntimeError(f"no VmRSS for pid {pid}")
    return value


def shmem_bytes(pid: int) -> int:
    """The resident shared memory in ``pid``'s RSS: for the server, the clients' /dev/shm
    segments it maps (same-host payloads), pages the clients own, not its store."""
    return _status_bytes(pid, "RssShmem") or 0


def peak_rss_bytes(pid: int) -> int:
    """``pid``'s peak RSS so far (VmHWM): a burst that was freed again still shows."""
    value = _status_bytes(pid, "VmHWM")
    if value is None:
        raise RuntimeError(f"no VmHWM for pid {pid}")
    return value


# --- server-only faults ------------------------------------------------------------------


def malformed_frames(count: int) -> Row:
    """Random garbage in flight on one connection while the server must answer each."""
    with ServerProcess("--separate-object-groups") as srv:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(srv.url)
        rng = random.Random(0)
        rss_before = rss_bytes(srv.proc.pid)
        answered = 0
        t0 = time.monotonic()
        batch = 500
        for start in range(0, count, batch):
            n = min(batch, count - start)
            for _ in range(n):
                frames = [rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(1, 3))]
                sock.send_multipart(frames)
            for _ in range(n):
                if sock.poll(10_000):
                    sock.recv_multipart()
                    answered += 1
        elapsed = time.monotonic() - t0
        rss_after = rss_bytes(srv.proc.pid)
        sock.close()
        with CacheClient(srv.url, timeout_s=5) as client:
            client.ping()
            alive = client.put("ns", [(bytes(32), 0, 0, b"ok")]) == ["stored"]
        growth = (rss_after - rss_before) / MIB
    held = answered == count and alive and growth < 20
    return Row(f"{count:,} malformed frames", f"{answered:,} answered in {elapsed:.1f} s, server alive, "
               f"RSS {rss_before / MIB:.0f} -> {rss_after / MIB:.0f} MiB", held)


def churn_rss(seconds: float, budget_mb: int) -> Row:
    """Puts of 1-8 MiB objects for a while: RSS stays within the byte budget + 10%."""
    with ServerProcess("--separate-object-groups", "--l1-size-gb", str(budget_mb / 1024)) as srv:
        baseline = rss_bytes(srv.proc.pid)
        rng = random.Random(1)
        peak, puts, t0 = baseline, 0, time.monotonic()
        shared = 0  # clients' shared-memory segments in the server's RSS at its peak
        blobs = [os.urandom(s * MIB) for s in (1, 2, 4, 8)]
        with CacheClient(srv.url, timeout_s=10) as client:
            while time.monotonic() - t0 < seconds:
                items = [(rng.randbytes(32), rng.randint(0, 3), 0, rng.choice(blobs)) for _ in range(4)]
                client.put(f"ns-{rng.randint(0, 3)}", items)
                puts += len(items)
                if puts % 16 == 0:
                    rss, shm = rss_bytes(srv.proc.pid), shmem_bytes(srv.proc.pid)
                    if rss - shm > peak:
                        peak, shared = rss - shm, shm
                    if rng.random() < 0.1:
                        client.clear(f"ns-{rng.randint(0, 3)}")
            used = client.stats()["used_bytes"]
        rss, shm = rss_bytes(srv.proc.pid), shmem_bytes(srv.proc.pid)
        if rss - shm > peak:
            peak, shared = rss - shm, shm
    limit = baseline + budget_mb * MIB * 1.1
    return Row(f"churn {seconds:.0f} s, L1 {budget_mb} MiB",
               f"{puts:,} puts, used {used / MIB:.0f} MiB, RSS peak {peak / MIB:.0f} MiB without the client's "
               f"shm segment ({shared / MIB:.0f} MiB) (baseline {baseline / MIB:.0f} + budget x 1.1 = "
               f"{limit / MIB:.0f})", peak <= limit)


def unauthenticated_oversized(frames: int = 80) -> Row:
    """Peers without the token (none, a wrong one) each send one message of ``frames``
    frames of 1.5 MiB against a 2 MiB limit (libzmq's MAXMSGSIZE bounds a frame, not a
    message): refused at the handshake, they never make the server buffer the message, so
    its peak RSS stays flat; a peer with the token still gets ``too_large`` for an
    oversized message."""
    token = secrets.token_hex(16)
    frame = os.urandom(3 << 19)  # 1.5 MiB
    with ServerProcess("--max-message-mb", "2", "--max-object-size-mb", "1", auth_token=token) as srv:
        with CacheClient(srv.url, timeout_s=5, auth_token=token) as client:
            client.ping()  # the server's threads are up
        time.sleep(0.5)
        before = peak_rss_bytes(srv.proc.pid)
        ctx = zmq.Context()
        socks = []
        for password in (None, secrets.token_hex(16).encode()):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            if password is not None:
                sock.plain_username, sock.plain_password = PLAIN_USERNAME, password
            sock.connect(srv.url)
            try:  # queued for the connection; once the handshake is refused there is none to queue for
                sock.send_multipart([msgpack.packb({"op": "ping", "id": 1}), *[frame] * frames], copy=False,
                                    flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            socks.append(sock)
        time.sleep(2.0)  # libzmq retries the handshake every 100 ms meanwhile
        grown = peak_rss_bytes(srv.proc.pid) - before
        for sock in socks:
            sock.close()
        ctx.term()
        with CacheClient(srv.url, timeout_s=5, auth_token=token) as client:
            client.ping()  # still serving
            try:
                client.request({"op": "ping"}, [frame] * 2)
                code = "answered"
            except CacheServerError as e:
                code = e.code
    offered = 2 * frames * len(frame)
    held = grown < 8 * MIB and code == "too_large"
    return Row(f"{frames} x 1.5 MiB frames, no token", f"2 peers without the token offered {offered / MIB:.0f} MiB "
               f"(limit 2 MiB): server peak RSS +{grown / MIB:.1f} MiB, still serving; an authenticated "
               f"oversized message: {code}", held)


# --- faults with a live engine -----------------------------------------------------------


class Harness:
    """One vLLM engine (tiny GLM-5.3-Flash, the plugin) with GlmCacheConnector, and the
    server it talks to, restartable on the same ports (with other flags: an L2, another
    chunk size). The engine prefills ``C`` tokens a step and retains a state every ``C``
    (as the connector asks of an engine whose chunk may grow past its block), so a prompt
    prefills over many steps and a server can come and go in the middle of one."""

    C = 128

    def __init__(self, ckpt: Path) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.server = self._start_server()
        self.llm = self._start_engine(ckpt)

    def _start_engine(self, ckpt: Path) -> Any:
        from vllm import LLM

        return LLM(
            model=str(ckpt), dtype="float32", enable_prefix_caching=True, gpu_memory_utilization=0.15,
            max_model_len=4096, enforce_eager=True, seed=0, max_num_batched_tokens=self.C, max_num_seqs=self.C,
            prefix_cache_retention_interval=self.C,
            kv_transfer_config={
                "kv_connector": "GlmCacheConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"server": self.server.url, "timeout_s": TIMEOUT_S,
                                              "retry_after_s": RETRY_S},
            },
        )

    def replace_engine(self, ckpt: Path, rewrite: Any = None) -> None:
        """Shut the engine down, call ``rewrite()`` (new files at the model path) and start
        an engine with the same arguments on ``ckpt``, against the same server."""
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        if rewrite is not None:
            rewrite()
        self.llm = self._start_engine(ckpt)

    def _start_server(self, *extra: str, chunk: int | None = None) -> ServerProcess:
        return ServerProcess("--separate-object-groups", "--chunk-size", str(chunk or self.C), "--l1-size-gb", "1",
                             "--debug-fault-hooks", *extra, port=self.port, http_port=self.http_port).start()

    def restart_server(self, *extra: str, chunk: int | None = None, notice: bool = False) -> None:
        """SIGKILL the server (L1 is lost) and start one on the same ports with ``extra``
        flags. ``notice``: first let the connector see the death (a request whose lookup
        fails at the client timeout), so it negotiates afresh with the new server, as after
        any crash it saw."""
        self.server.kill()
        if notice:
            t0 = time.monotonic()
            self.one(prompt(300, 7), f"notice-{uuid.uuid4().hex[:8]}")
            time.sleep(max(0.0, TIMEOUT_S + 0.3 - (time.monotonic() - t0)))
        self.server = self._start_server(*extra, chunk=chunk)
        time.sleep(RETRY_S + 0.2)  # the connector's back-off after it saw the failure

    def client(self) -> CacheClient:
        return CacheClient(self.server.url, timeout_s=5)

    def run(self, prompts: list[list[int]], salts: list[str], max_tokens: int = 16) -> list[tuple]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
        inputs = [TokensPrompt(prompt_token_ids=p, cache_salt=s) for p, s in zip(prompts, salts)]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outs]

    def one(self, prompt: list[int], salt: str) -> tuple[list[int], int]:
        return self.run([prompt], [salt])[0]

    def reset_local(self) -> None:
        for _ in range(50):
            if self.llm.reset_prefix_cache():
                return
            time.sleep(0.1)
        raise RuntimeError("vLLM refused to reset its prefix cache")

    def strict_hit(self, n: int) -> int:
        return self.C * ((n - 1) // self.C)

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        self.server.stop()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 500) for _ in range(n)]


def killed_during_load(h: Harness) -> Row:
    p, salt = prompt(1000, 11), "kill-load"
    cold = h.one(p, salt)
    h.reset_local()
    with h.client() as c:
        c.request({"op": "debug_die_on", "on": "get"})
    t0 = time.monotonic()
    during = h.one(p, salt)
    took = time.monotonic() - t0
    died = h.server.proc.wait(timeout=10) == -signal.SIGKILL
    h.restart_server()
    p2, salt2 = prompt(900, 12), "after-restart"
    cold2 = h.one(p2, salt2)  # saved to the restarted server
    h.reset_local()
    again = h.one(p2, salt2)
    held = (died and during[0] == cold[0] and again[0] == cold2[0] and again[1] == h.strict_hit(900))
    return Row("kill -9 during a load", f"server died mid-get: {died}; output == cold: {during[0] == cold[0]} "
               f"({took:.1f} s); after restart: hit {again[1]}, output == cold: {again[0] == cold2[0]}", held)


def killed_during_save(h: Harness) -> Row:
    with h.client() as c:
        c.request({"op": "debug_die_on", "on": "put"})
    p, salt = prompt(700, 21), "kill-save"
    first = h.one(p, salt)
    died = h.server.proc.wait(timeout=10) == -signal.SIGKILL
    second = h.one(prompt(300, 22), "kill-save-2")  # the engine keeps serving with the server gone
    h.restart_server()
    h.reset_local()
    again = h.one(p, salt)  # the save died with the server: computed cold again, saved now
    h.reset_local()
    reloaded = h.one(p, salt)
    held = died and len(second[0]) == 16 and again[0] == first[0] and reloaded[0] == first[0] \
        and reloaded[1] == h.strict_hit(700)
    return Row("kill -9 during a save", f"server died mid-put: {died}; engine kept serving; after restart "
               f"reloaded hit {reloaded[1]}, output == first: {reloaded[0] == first[0]}", held)


def stopped_server(h: Harness, seconds: float) -> Row:
    p, salt = prompt(800, 31), "sigstop"
    cold = h.one(p, salt)
    h.reset_local()
    os.kill(h.server.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        during = h.one(p, salt)
        first_s = time.monotonic() - t0
        t1 = time.monotonic()
        h.one(prompt(400, 32), "sigstop-2")
        second_s = time.monotonic() - t1
        time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
    finally:
        os.kill(h.server.proc.pid, signal.SIGCONT)
    time.sleep(RETRY_S + 0.2)
    h.reset_local()
    after = h.one(p, salt)
    held = during[0] == cold[0] and after[0] == cold[0] and after[1] == h.strict_hit(800) \
        and first_s < TIMEOUT_S * 4 + 5
    return Row(f"server SIGSTOPped {seconds:.0f} s", f"requests during the stop {first_s:.1f} s and "
               f"{second_s:.1f} s, output == cold; after SIGCONT hit {after[1]}, output == cold: "
               f"{after[0] == cold[0]}", held)


def flipped_byte(h: Harness) -> Row:
    p, salt = prompt(900, 41), "bitrot"
    cold = h.one(p, salt)
    with h.client() as c:
        stats = c.stats()
        ns = next(iter(stats["namespaces"]))
        first = vllm_chunk_keys(p, h.C, h.C, salt)[0]  # the engine's keys (vLLM's block hashes)
        # The first chunk's attention, which every load of the prefix reads (its states are
        # read only by a resume there): the group of the largest objects (a chunk's rows,
        # against one state snapshot).
        g = max(stats["bytes_by_group"], key=lambda g: stats["bytes_by_group"][g] / stats["objects_by_group"][g])
        flipped = int(c.request({"op": "debug_corrupt", "ns": ns, "keys": [[first, int(g), 0]],
                                 "offset": 333})[0]["corrupted"])
        h.reset_local()
        after = h.one(p, salt)
        metrics = urllib_get(h.server.http_url + "/metrics")
    line = [ln for ln in metrics.splitlines() if ln.startswith('glm_cache_deleted_objects_total{reason="checksum"}')]
    deleted = float(line[0].split()[-1]) if line else 0.0
    held = flipped >= 1 and after[0] == cold[0] and deleted >= flipped
    return Row("a flipped byte in a stored object", f"{flipped} object(s) flipped; output == cold: "
               f"{after[0] == cold[0]} (hit {after[1]}); server deleted {deleted:.0f} on the loader's report", held)


def l1_full(h: Harness) -> Row:
    """L1 full of another tenant's objects, all of them leased by that tenant's lookups:
    leases may pin at most ``--max-leased-fraction`` of the budget (0.5), so the engine's
    saves still find room (the oldest leases are dropped), and outputs stay right."""
    with h.client() as c:
        budget = c.stats()["capacity_bytes"]
        size = 8 * MIB
        junk = [os.urandom(16) + bytes(32 - 16) for _ in range(budget // size)]
        stored = sum(c.put("junk-tenant", [(hsh, 0, 0, bytes(size))]) == ["stored"] for hsh in junk)
        for i in range(0, stored, 8):  # many lookups, each pinning a few objects
            c.lookup("junk-tenant", junk[i:i + 8], [0], [], 1)
        stats = c.stats()
        leased = stats["leased_bytes"]
        p, salt = prompt(800, 51), "l1-full"
        first = h.one(p, salt)
        h.reset_local()
        second = h.one(p, salt)
        no_space = c.stats()["puts_no_space"] - stats["puts_no_space"]
        c.clear("junk-tenant")
    held = second[0] == first[0] and second[1] == h.strict_hit(800) and leased <= budget // 2
    return Row("L1 full, another tenant's leases", f"{stored} x 8 MiB stored, leases pin {leased / MIB:.0f} of "
               f"{budget / MIB:.0f} MiB (cap 50%); engine puts refused: {no_space}; repeat hit {second[1]}, "
               f"output == first: {second[0] == first[0]}", held)


def concurrent_reloads(h: Harness, n: int = 16) -> Row:
    prompts = [prompt(300 + 37 * i, 60 + i) for i in range(n)]
    salts = [f"batch-{uuid.uuid4().hex[:8]}-{i}" for i in range(n)]
    cold = h.run(prompts, salts)
    h.reset_local()
    reloaded = h.run(prompts, salts)
    same = sum(a[0] == b[0] for a, b in zip(cold, reloaded))
    hits = sum(b[1] == h.strict_hit(len(p)) for b, p in zip(reloaded, prompts))
    return Row(f"{n} concurrent requests reloaded", f"{same}/{n} outputs equal to the same {n} sent cold "
               f"together; {hits}/{n} hit the strict prefix", same == n and hits == n)


# --- integrity: what an object is bound to -----------------------------------------------


def wait_saved(h: Harness, ids: list[int], salt: str, timeout_s: float = 30.0) -> tuple[str, list[int]]:
    """Wait until the server holds every group's object at the strict resume point of
    ``ids`` (the engine saves behind its steps); returns (namespace, group ids)."""
    keys = vllm_chunk_keys(ids, h.C, h.C, salt)  # the engine's keys (vLLM's block hashes)
    last = keys[h.strict_hit(len(ids)) // h.C - 1]
    deadline = time.monotonic() + timeout_s
    with h.client() as c:
        while True:
            stats = c.stats()
            groups = sorted(int(g) for g in stats["bytes_by_group"])
            for ns in stats["namespaces"]:
                if groups and all(x is not None for x in c.get(ns, [(last, g, 0) for g in groups])):
                    return ns, groups
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine's objects of {salt!r} did not reach the server")
            time.sleep(0.1)


def weights_swapped(h: Harness, ckpt: Path) -> Row:
    """An operator replaces the checkpoint at the model path with another of the same shape
    (a fine-tune, a re-pushed revision) and restarts vLLM against the same server: the new
    engine resumes nothing from the old weights' objects and outputs its own cold run."""
    from glm5next_tiny import write_checkpoint

    p, salt = prompt(1500, 81), "weights-swap"
    old = h.one(p, salt)
    old_ns, _ = wait_saved(h, p, salt)
    with h.client() as c:
        old_objects = c.stats()["namespaces"][old_ns]["objects"]

    def rewrite() -> None:
        shutil.rmtree(ckpt)
        write_checkpoint(ckpt, seed=4)  # the same config and shapes as seed 3's, other weights

    with h.client() as c:
        before = set(c.stats()["namespaces"])
    h.replace_engine(ckpt, rewrite)
    new = h.one(p, salt)
    h.reset_local()
    cold = h.one(p, f"{salt}-cold")
    with h.client() as c:
        spaces = c.stats()["namespaces"]
    new_ns = sorted(set(spaces) - before)
    held = (old_objects > 0 and old_ns in spaces and len(new_ns) == 1 and new[1] == 0 and cold[1] == 0
            and new[0] == cold[0] and new[0] != old[0])
    return Row("new weights at the same path", f"old engine's {old_objects} objects on the server; new engine "
               f"namespace {'new' if new_ns else 'the OLD one'}, resumed {new[1]} of {len(p)} tokens; output == "
               f"its own cold run: {new[0] == cold[0]} (!= old weights' output: {new[0] != old[0]})", held)


def forged_l2_values(h: Harness) -> Row:
    """Two servers share an L2 (a real three-node Redis cluster). Whoever can write to the
    store but lacks ``--l2-secret-file`` plants values under a real object's key at the
    resume point of a prompt the engine saved through server A: one built with the public
    value format under a guessed secret (forged), one copied from another chunk's key
    (replayed). Server B (A's successor on the engine's ports, empty L1) refuses each at
    promotion, deletes it and counts it; the engine's outputs equal cold."""
    from redis.cluster import ClusterNode, RedisCluster

    from cache_server import protocol as p
    from cache_server.chunk_tree import UNKNOWN_PARENT
    from cache_server.l2 import redis_key
    from cache_server.l2_values import decode_value, encode_value, mac_key
    from testing.redis_nodes import RedisNodes, store_binaries

    if store_binaries() is None:
        return Row("forged / replayed L2 values", "no redis-server or valkey-server on PATH", False)
    secret = secrets.token_hex(32)
    fd, secret_file = tempfile.mkstemp(prefix="glm-l2-secret-")  # created 0600
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    key_bytes = mac_key(secret.encode())
    l2 = ["--l2", "", "--l2-secret-file", secret_file]
    nodes = RedisNodes(3, cluster=True, maxmemory_mb=256).start()
    try:
        l2[1] = nodes.url
        h.restart_server(*l2, notice=True)  # server A
        runs = {"forged": (prompt(900, 71), "l2-forged"), "replayed": (prompt(900, 72), "l2-replayed")}
        cold = {attack: h.one(ids, salt) for attack, (ids, salt) in runs.items()}
        for ids, salt in runs.values():
            ns, groups = wait_saved(h, ids, salt)
        with h.client() as c:
            deadline = time.monotonic() + 30
            while (s := c.stats())["l2"]["written_objects"] < s["objects"] or s["l2"]["queue_items"]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"L2 writes did not complete: {s['l2']}")
                time.sleep(0.05)
        r = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", port) for port in nodes.ports])
        planted = {}
        for attack, (ids, salt) in runs.items():
            keys = vllm_chunk_keys(ids, h.C, h.C, salt)
            # An object every lookup of the whole strict prefix must read: one at its resume point.
            target = (ns, keys[h.strict_hit(len(ids)) // h.C - 1], groups[0], 0)
            genuine = r.get(redis_key("glmkv", target))
            decoded = decode_value(target, genuine, key_bytes=key_bytes) if genuine is not None else "absent"
            if isinstance(decoded, str):
                raise RuntimeError(f"the engine's object {target[1].hex()[:12]} is not in L2 ({decoded})")
            if attack == "forged":
                payload = os.urandom(len(decoded[0]))
                value = encode_value(target, payload, p.checksum(payload, ns, target[1:]), None, UNKNOWN_PARENT,
                                     key_bytes=mac_key(b"a-guess-at-the-secret-0123456789"))
            else:
                value = r.get(redis_key("glmkv", (ns, keys[0], groups[0], 0)))  # genuine, but another key's
            r.set(redis_key("glmkv", target), value)
            planted[attack] = (target, value)
        h.restart_server(*l2, notice=True)  # server B: the same L2, nothing in L1
        h.reset_local()
        after = {attack: h.one(ids, salt) for attack, (ids, salt) in runs.items()}
        with h.client() as c:
            l2_status = c.stats()["l2"]
        metrics = urllib_get(h.server.http_url + "/metrics")
        line = [ln for ln in metrics.splitlines() if ln.startswith('glm_cache_l2_errors_total{kind="auth"}')]
        counted = float(line[0].split()[-1]) if line else 0.0
        gone = 0  # planted values no longer in the store: deleted (and maybe the genuine one re-saved since)
        for target, value in planted.values():
            now = r.get(redis_key("glmkv", target))
            if now is None or (now != value and not isinstance(decode_value(target, now, key_bytes=key_bytes), str)):
                gone += 1
        h.reset_local()
        again = h.one(*runs["forged"])  # B holds the genuine objects again (re-saved after the cold run)
        r.close()
    finally:
        nodes.stop()
        os.unlink(secret_file)
        h.restart_server(notice=True)  # back to a server without L2
    same = sum(after[a][0] == cold[a][0] for a in runs)
    held = (same == 2 and all(after[a][1] < h.strict_hit(900) for a in runs) and counted == 2 and l2_status["errors"] == {"auth": 2}
            and gone == 2 and l2_status["up"] and again[0] == cold["forged"][0] and again[1] == h.strict_hit(900))
    return Row("forged / replayed L2 values", f"planted at the resume point of 2 prompts; through server B: resumed "
               f"{after['forged'][1]} and {after['replayed'][1]}, {same}/2 outputs == cold; refused and counted "
               f"(l2_errors auth): {counted:.0f}, /status {l2_status['errors']}, planted values gone: {gone}/2, "
               f"L2 up: {l2_status['up']}; then a reload hit {again[1]}", held)


def chunk_size_changed(h: Harness) -> Row:
    """The server dies while a long prompt prefills and comes back with twice the chunk
    size while that request is still under way: every output equals its cold run, and
    every reload resumes on the new grid only (a multiple of the new chunk), the requests
    sent after the return at the new grid's deepest point.

    The connector negotiates afresh on a waiting request's lookup, which vLLM's scheduler
    makes only when a step has token budget left; a prompt prefilling alone takes all of
    it (one chunk a step), so the new grid arrives once its prefill is done, while it
    decodes: it decodes long enough (1000 tokens) to be under way then."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    new_c, n = 2 * h.C, 3000
    engine = h.llm.llm_engine
    prompts = [prompt(n, 90 + i) for i in range(3)]
    salts = [f"grid-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]
    cold = [r[0] for r in h.run(prompts, [f"{s}-cold" for s in salts], max_tokens=8)]
    outputs: dict[str, Any] = {}

    def step_until(done: Any, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"requests did not finish in {timeout_s:.0f} s: {sorted(outputs)}")
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out

    def add(i: int, max_tokens: int) -> None:
        engine.add_request(f"grid-long-{i}", TokensPrompt(prompt_token_ids=prompts[i], cache_salt=salts[i]),
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))

    with h.client() as c:
        stored = c.stats()["puts_stored"]
        add(0, 1000)
        deadline = time.monotonic() + 30
        while (saved := c.stats()["puts_stored"] - stored) == 0:  # it prefills, saving chunks of C
            if time.monotonic() > deadline:
                raise RuntimeError("the long prompt saved nothing")
            time.sleep(0.01)
    h.server.kill()
    # A lookup against the dead server fails (after the client timeout): the link backs off
    # and forgets the handshake, so the next one negotiates afresh. (The probe itself waits
    # for budget behind the long request; its lookup does not.)
    t0 = time.monotonic()
    engine.add_request("grid-probe", TokensPrompt(prompt_token_ids=prompt(700, 99), cache_salt="grid-probe"),
                       SamplingParams(temperature=0.0, max_tokens=1))
    step_until(lambda: time.monotonic() - t0 > TIMEOUT_S * 1.25 + 0.5)
    h.restart_server(chunk=new_c)
    for i in (1, 2):
        add(i, 8)
    with h.client() as c:  # the next lookup negotiates the new chunk size
        step_until(lambda: bool(c.stats()["namespaces"]), timeout_s=30)
    under_way = "grid-long-0" not in outputs
    step_until(lambda: {"grid-long-0", "grid-long-1", "grid-long-2", "grid-probe"} <= outputs.keys())
    live = sum(list(outputs[f"grid-long-{i}"].outputs[0].token_ids)[:8] == cold[i] for i in range(3))
    h.reset_local()
    reloaded = h.run(prompts, salts, max_tokens=8)
    same = sum(r[0] == cold[i] for i, r in enumerate(reloaded))
    hits = [r[1] for r in reloaded]
    on_grid = sum(x % new_c == 0 for x in hits)
    best = new_c * ((n - 1) // new_c)
    held = under_way and live == 3 and same == 3 and on_grid == 3 and max(hits) == best
    return Row(f"chunk size {h.C} -> {new_c} mid-prefill", f"server killed after {saved} save(s) of a {n}-token "
               f"prompt's prefill, back with --chunk-size {new_c} (that request under way: {under_way}): {live}/3 "
               f"outputs == cold; reloads hit {hits} ({on_grid}/3 multiples of {new_c}; the first is that request's), "
               f"{same}/3 == cold", held)


def urllib_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10k frames, 20 s churn, 3 s SIGSTOP")
    args = ap.parse_args(argv)
    frames, churn_s, stop_s = (10_000, 20.0, 3.0) if args.quick else (100_000, 180.0, 10.0)

    from glm5next_tiny import write_checkpoint

    rows = [malformed_frames(frames), churn_rss(churn_s, 256), unauthenticated_oversized()]
    ckpt = write_checkpoint(Path(tempfile.mkdtemp(prefix="glm-reliability-")) / "tiny", seed=3)
    h = Harness(ckpt)
    try:
        for scenario in (killed_during_load, killed_during_save, flipped_byte, l1_full, concurrent_reloads):
            rows.append(scenario(h))
        rows.append(stopped_server(h, stop_s))
        rows.append(weights_swapped(h, ckpt))  # from here on, the engine runs the seed-4 weights
        for scenario in (forged_l2_values, chunk_size_changed):
            rows.append(scenario(h))
    finally:
        h.close()

    width = max(len(r.fault) for r in rows)
    print(f"\nglm-cache-server reliability ({'quick' if args.quick else 'full'} run; `python -m validation.reliability"
          f"{' --quick' if args.quick else ''}`)")
    print(f"{'fault'.ljust(width)} | held | measured")
    print("-" * (width + 100))
    for r in rows:
        print(f"{r.fault.ljust(width)} | {'yes ' if r.held else 'NO  '} | {r.measured}")
    failed = [r.fault for r in rows if not r.held]
    print(f"{len(rows) - len(failed)} held, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
