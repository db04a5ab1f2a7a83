"""Fault injection against real processes: glm-cache-server and a live vLLM engine.

    python validation/reliability.py            # the full run (about 6 minutes on 2 cores)
    python validation/reliability.py --quick    # fewer frames, shorter churn (what the tests run)

Prints one table: each fault, what was measured, and whether the rule held. The rules: a
fault costs a recompute, never a wrong token and never a stalled or dead engine; nothing a
client sends takes the server down; the server's memory stays within its budget.

Faults a process cannot be made to suffer on demand use the server's testing flag
``--debug-fault-hooks``: ``debug_corrupt`` flips a byte of a stored object (bit rot) and
``debug_die_on`` SIGKILLs the server when the next get/put arrives (a crash mid-transfer).
Everything else is done to the real processes: SIGKILL, SIGSTOP, random frames, floods.
Exits non-zero if any rule failed.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testing.server_process import ServerProcess, free_port  # noqa: E402
from cache_server.client import CacheClient  # noqa: E402
from testing.vllm_keys import vllm_chunk_keys  # noqa: E402

MIB = 1 << 20
TIMEOUT_S = 1.0
RETRY_S = 1.0


@dataclass
class Row:
    fault: str
    measured: str
    held: bool


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def shmem_bytes(pid: int) -> int:
    """The resident shared memory in ``pid``'s RSS: for the server, the clients' /dev/shm
    segments it maps (same-host payloads), pages the clients own, not its store."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    return 0


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


# --- faults with a live engine -----------------------------------------------------------


class Harness:
    """One vLLM engine (tiny GLM-5.3-Flash, the plugin) with GlmCacheConnector, and the
    server it talks to, restartable on the same ports."""

    C = 128

    def __init__(self, ckpt: Path) -> None:
        from vllm import LLM

        self.port, self.http_port = free_port(), free_port()
        self.server = self._start_server()
        self.llm = LLM(
            model=str(ckpt), dtype="float32", enable_prefix_caching=True, gpu_memory_utilization=0.15,
            max_model_len=4096, enforce_eager=True, seed=0,
            kv_transfer_config={
                "kv_connector": "GlmCacheConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"server": self.server.url, "timeout_s": TIMEOUT_S,
                                              "retry_after_s": RETRY_S},
            },
        )

    def _start_server(self) -> ServerProcess:
        return ServerProcess("--separate-object-groups", "--chunk-size", str(self.C), "--l1-size-gb", "1",
                             "--debug-fault-hooks", port=self.port, http_port=self.http_port).start()

    def restart_server(self) -> None:
        self.server.kill()
        self.server = self._start_server()
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
        flipped = sum(c.request({"op": "debug_corrupt", "ns": ns, "keys": [[first, int(g), 0]],
                                 "offset": 333})[0]["corrupted"] for g in stats["bytes_by_group"])
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


def urllib_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10k frames, 20 s churn, 3 s SIGSTOP")
    args = ap.parse_args(argv)
    frames, churn_s, stop_s = (10_000, 20.0, 3.0) if args.quick else (100_000, 180.0, 10.0)

    from glm5next_plugin.tiny_checkpoint import write_checkpoint

    rows = [malformed_frames(frames), churn_rss(churn_s, 256)]
    ckpt = write_checkpoint(Path(tempfile.mkdtemp(prefix="glm-reliability-")) / "tiny", seed=3)
    h = Harness(ckpt)
    try:
        for scenario in (killed_during_load, killed_during_save, flipped_byte, l1_full, concurrent_reloads):
            rows.append(scenario(h))
        rows.append(stopped_server(h, stop_s))
    finally:
        h.close()

    width = max(len(r.fault) for r in rows)
    print(f"\nglm-cache-server reliability ({'quick' if args.quick else 'full'} run; `python validation/reliability.py"
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
