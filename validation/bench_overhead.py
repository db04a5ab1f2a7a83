"""What the connector costs when it brings nothing back.

1. Admission of one 300k-token prompt at production shape (C = 1152, 4 TP ranks,
   260 chunks, a real glm-cache-server holding them all): hashing the prefix, the lookup
   RPC, and the whole admission through the connector's scheduler side (first call to
   the answer, the lookup running on its background thread), next to the scheduler
   thread's own time per call, for three prompts: one never seen (a long prefix nobody
   here has hashed is probed with its first chunk's key first, so a miss is not hashed
   whole), one the server holds but this replica has not seen (probe, then the lookup
   thread hashes it and looks it up), and a conversation's next turn (history hashes from
   the memo). Both key schemes (``chunk_keys``): "lmcache", our blake3 chain over the
   token ids, and "vllm" (what the default "auto" picks here), the block hashes vLLM's engine computes for every
   request on arrival (nothing hashed by us). Goal: a whole admission in 2 ms or less.
2. Generation throughput with the connector on vs off on the same workload: 8 requests
   of 600 prompt tokens + 192 generated, tiny GLM-5.3-Flash checkpoint, vLLM CPU
   ``LLM``, the server on the same machine. Engines built the same way (the one with
   the connector talks to the server), repetitions rotated so machine noise hits each
   alike; fresh prompts each repetition (no hits: pure overhead). A third engine with a
   connector that does nothing (``validation/null_connector.py``) splits the cost into
   vLLM's connector machinery (null/off) and ours (on/null); CPU seconds per process and
   thread say where the time goes. Goal: on/off >= 0.97.

    python -m validation.bench_overhead [--reps 5] [--admission-reps 50] [--skip-engines]
                                        [--skip-admission] [--no-null] [--pinned-too]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from cache_server.chunk_keys import chunk_hashes
from cache_server.client import CacheClient
from testing.server_process import ServerProcess

PROMPT_TOKENS = 300_000
C_PROD = 1152
RANKS = 4
C_TINY = 256


def _ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1e3:.3f} ms (min {min(values) * 1e3:.3f}, " \
           f"max {max(values) * 1e3:.3f})"


def bench_admission(reps: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for scheme in ("lmcache", "vllm"):
        out.update(_admission(reps, scheme))
    return out


def _admission(reps: int, scheme: str) -> dict[str, float]:
    """The admission rows for one ``chunk_keys`` setting: "lmcache" (keys hashed from the
    token ids by us) or "vllm" (keys read off the block hashes vLLM computed on arrival)."""
    from testing.sched_harness import request, scheduler_side

    rng = random.Random(0)
    tokens = [rng.randrange(0, 150_000) for _ in range(PROMPT_TOKENS)]
    n_chunks = PROMPT_TOKENS // C_PROD  # 260; strict prefix: the same (300000 % 1152 != 0)
    vllm_keys = scheme == "vllm"
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C_PROD), "--l1-size-gb", "1") as srv:
        # GLM-5.3-Flash's shape: the sparse-MLA rows are the same on every rank (stored
        # once), the KDA states are per rank.
        side = scheduler_side(srv.url, block=C_PROD, tp=RANKS, timeout_s=2.0, retry_after_s=5.0, latent_rows=True,
                              chunk_keys=scheme)
        assert (side.keys.scheme.span is not None) == vllm_keys
        replicated = side.remote.replicated_groups()
        ns = side.namespace
        # vLLM hashes every request's blocks on arrival (Request.block_hashes, here at
        # C_PROD tokens a block): not counted in any row below.
        arrived = request("keys", tokens, "bench", hash_block=C_PROD)
        hashes = side.request_keys(arrived, n_chunks) if vllm_keys else chunk_hashes(tokens, C_PROD, "bench")
        side._requests.clear()
        side.keys.memo.entries.clear()
        assert len(hashes) == n_chunks
        attn = [g.group_id for g in side._geometry.attn_groups]
        state = [g.group_id for g in side._geometry.state_groups]
        client = CacheClient(srv.url)
        # Every chunk's attention (once: replicated), the state at the strict prefix on every rank.
        assert replicated == attn, replicated
        items = [(h, g, 0, b"a" * 64) for h in hashes for g in attn]
        items += [(hashes[-1], g, r, b"s" * 64) for g in state for r in range(RANKS)]
        for i in range(0, len(items), 512):
            client.put(ns, items[i:i + 512])

        hash_t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            if vllm_keys:
                side._requests.clear()
                side.request_keys(arrived, n_chunks)
            else:
                chunk_hashes(tokens, C_PROD, "bench")
            hash_t.append(time.perf_counter() - t0)
        side._requests.clear()
        rpc_t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            n, lease, held, _ = client.lookup_held(ns, hashes, attn, state, RANKS, 0, lease=True,
                                                   replicated_groups=replicated)
            rpc_t.append(time.perf_counter() - t0)
            client.release(lease)
        assert n == n_chunks and held == n_chunks, (n, held)

        def admit(req) -> tuple[float, float, float, int, tuple]:
            t0 = time.perf_counter()
            first = side.get_num_new_matched_tokens(req, 0)
            t1 = time.perf_counter()
            # vLLM asks again next step; here the moment the lookup thread is done (polling
            # in a loop would take the GIL from the thread it waits for).
            side._requests[req.request_id].lookup.future.result()
            k = 1
            while True:
                t2 = time.perf_counter()
                got = side.get_num_new_matched_tokens(req, 0)
                if got[0] is not None:
                    break
                k += 1
            t3 = time.perf_counter()
            assert first == (None, False), first
            side.request_finished_all_groups(req, ([],))
            return t3 - t0, t1 - t0, t3 - t2, k, got

        fresh: list[tuple] = []
        held_rows: list[tuple] = []
        turn: list[tuple] = []
        for i in range(reps):
            # A prompt never seen (with our keys a long prefix nobody here has hashed is
            # probed with its first chunk's key first).
            new = [rng.randrange(0, 150_000) for _ in range(PROMPT_TOKENS)]
            got = admit(request(f"fresh-{i}", new, "bench", hash_block=C_PROD))
            assert got[4] == (0, False)  # nothing of it on the server
            fresh.append(got)
            # A prompt the server holds whole, first seen by this replica (another saved
            # it): with our keys the probe hits and the lookup thread hashes all of it.
            side.keys.memo.entries.clear()
            got = admit(request(f"held-{i}", tokens, "bench", hash_block=C_PROD))
            assert got[4] == (n_chunks * C_PROD, True), got[4]
            held_rows.append(got)
            side.keys.memo.entries.clear()
            side._requests.clear()
            # The next turn of a conversation whose previous turn (first 290k tokens)
            # was admitted before: with our keys its history's hashes come from the memo.
            side.request_keys(request(f"prev-{i}", tokens[:290_000], "bench", hash_block=C_PROD), 290_000 // C_PROD)
            side._requests.clear()
            got = admit(request(f"turn-{i}", tokens, "bench", hash_block=C_PROD))
            assert got[4] == (n_chunks * C_PROD, True), got[4]
            turn.append(got)
            side.keys.memo.entries.clear()
        side.shutdown()
        client.close()
    print(f"\n== Admission, chunk_keys={scheme}: {PROMPT_TOKENS} tokens, C={C_PROD}, {n_chunks} chunks, TP {RANKS} "
          f"{len(attn)} attention + {len(state)} state group(s), real server, {reps} reps")
    what = "read vLLM's block hashes" if vllm_keys else "hash the prefix (chunk_hashes)"
    print(f"  {what:<40}{_ms(hash_t)}")
    print(f"  lookup RPC (lookup + held)              {_ms(rpc_t)}")
    for name, rows in (("a prompt never seen (miss)", fresh), ("a prompt the server holds, new here (hit)", held_rows),
                       ("next turn, 290k tokens seen (hit)", turn)):
        print(f"  whole admission, {name}: first call to answer {_ms([r[0] for r in rows])}   goal <= 2 ms")
        print(f"    scheduler thread, first call (hash, submit)   {_ms([r[1] for r in rows])}")
        print(f"    scheduler thread, answering call              {_ms([r[2] for r in rows])}")
        print(f"    calls until answered: median {statistics.median([r[3] for r in rows]):.0f}")

    def med(rows: list[tuple]) -> float:
        return statistics.median([r[0] for r in rows]) * 1e3

    return {f"{scheme}_hash_ms": statistics.median(hash_t) * 1e3, f"{scheme}_rpc_ms": statistics.median(rpc_t) * 1e3,
            f"{scheme}_fresh_admission_ms": med(fresh), f"{scheme}_held_admission_ms": med(held_rows),
            f"{scheme}_next_turn_admission_ms": med(turn)}


def _engine(ckpt: str, server_url: str | None, null: bool = False, transfer_cpus: str = "auto"):
    """``server_url``: with GlmCacheConnector; ``null``: with a connector that does nothing."""
    from vllm import LLM

    kw = {}
    if server_url is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "GlmCacheConnector", "kv_connector_module_path": "connector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"server": server_url, "transfer_cpus": transfer_cpus},
        }
    elif null:
        kw["kv_transfer_config"] = {"kv_connector": "NullConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "validation.null_connector"}
    return LLM(model=ckpt, dtype="float32", enable_prefix_caching=True, gpu_memory_utilization=0.15,
               max_model_len=4096, enforce_eager=True, max_num_batched_tokens=C_TINY,
               prefix_cache_retention_interval=C_TINY, seed=0, **kw)


class _CpuMeter:
    """CPU seconds that each process of one engine, the benchmark's own process (vLLM's
    front end) and the server spend during a workload, summed over their threads
    (/proc/<pid>/task/<tid>/schedstat, nanoseconds). The worker thread by thread: its main
    thread (the model forward), the connector's threads (named ``glm-*`` in the OS: save,
    load, fetch) and the rest (ZMQ's, gloo's); and how long the main thread was runnable
    but waiting for its core (which vLLM pins it to), with its involuntary context switches."""

    def __init__(self, engine_core: int, worker: int, server: int) -> None:
        self.pids = {"front end": os.getpid(), "engine core": engine_core, "worker": worker, "server": server}
        self.worker = worker

    @staticmethod
    def _read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read()
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            return None

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, pid in self.pids.items():
            out[name] = sum(t[1] for t in self._tasks(pid))
        ours = other = wakes = 0.0
        for tid, run_s, wait_s, slices, comm in self._tasks(self.worker):
            if tid == self.worker:
                out["worker main thread"] = run_s
                out["worker main, waiting for core"] = wait_s
            elif comm.startswith("glm-"):
                ours += run_s
                wakes += slices
            else:
                other += run_s
        out["worker glm-* threads (ours)"] = ours
        out["worker glm-* runs (count)"] = wakes
        out["worker other threads"] = other
        for line in (self._read(f"/proc/{self.worker}/task/{self.worker}/status") or "").splitlines():
            if line.startswith("nonvoluntary_ctxt_switches"):
                out["worker main preempted (count)"] = float(line.split()[1])
        return out

    def _tasks(self, pid: int) -> list[tuple[int, float, float, int, str]]:
        """(tid, seconds on a CPU, seconds runnable but waiting, times run, OS name) per thread."""
        out = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            sched = self._read(f"/proc/{pid}/task/{tid}/schedstat")
            comm = self._read(f"/proc/{pid}/task/{tid}/comm")
            if sched is not None and comm is not None:
                run_ns, wait_ns, slices = (int(x) for x in sched.split()[:3])
                out.append((int(tid), run_ns / 1e9, wait_ns / 1e9, slices, comm.strip()))
        return out

    @staticmethod
    def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {k: after[k] - before[k] for k in before}


def _engine_pids(known: set[int]) -> tuple[int, int]:
    """The engine core and worker processes started since ``known`` was taken."""
    import psutil

    new = [c for c in psutil.Process().children(recursive=True) if c.pid not in known]
    core = [c.pid for c in new if c.name().startswith("VLLM::EngineCor")]
    worker = [c.pid for c in new if c.name().startswith("VLLM::Worker")]
    assert len(core) == 1 and len(worker) == 1, [(c.pid, c.name()) for c in new]
    return core[0], worker[0]


def _children() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children(recursive=True)}


def _workload(llm, seed: int, salt: str = "") -> float:
    """Generated tokens per second for 8 fresh requests of 600 + 192 tokens. Each engine
    its own ``cache_salt``: engines with the connector share one server, and one must
    not find the prompts another just saved."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(16, 512) for _ in range(600)], cache_salt=salt)
               for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=192, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n == 8 * 192
    return n / dt


def bench_throughput(reps: int, null: bool = True, pinned: bool = False) -> dict[str, float]:
    import glm5next_tiny

    # vLLM-CPU reserves one more core per rank whenever any KV connector is configured
    # (vllm/utils/ompmultiprocessing.py: "reserve one more core for nixl_connector"). On
    # a 2-core machine that leaves nothing to reserve, so the engine with the connector
    # gets a different thread layout (2 torch threads spinning against its own scheduler
    # process) and runs 3-4x slower for reasons that are not the connector's work. Both
    # engines get the same reservation here, as an operator of a small machine would set.
    reserved = os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    print(f"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved} for every engine")
    names = ["off", "null", "on"] if null else ["off", "on"]
    if pinned:  # GlmCacheConnector with its transfer threads left on the model's core
        names.append("pinned")

    with tempfile.TemporaryDirectory() as tmp, \
            ServerProcess("--separate-object-groups", "--chunk-size", str(C_TINY), "--l1-size-gb", "1") as srv:
        glm5next_tiny.main([tmp, "--seed", "3"])
        llms, meters = {}, {}
        for name in names:
            known = _children()
            llms[name] = _engine(tmp, srv.url if name in ("on", "pinned") else None, null=name == "null",
                                 transfer_cpus="off" if name == "pinned" else "auto")
            meters[name] = _CpuMeter(*_engine_pids(known), srv.proc.pid)
        for name in names:
            _workload(llms[name], 999, name)  # warm-up (first-run allocations) on each
        tput: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for r in range(reps):
            # each engine first, middle and last in turn, so machine noise hits all alike
            k = r % len(names)
            for name in names[k:] + names[:k]:
                before = meters[name].sample()
                tput[name].append(_workload(llms[name], 1000 + r, name))  # same prompts for all
                cpu[name].append(_CpuMeter.delta(before, meters[name].sample()))
            print(f"  rep {r}: " + ", ".join(f"{n} {tput[n][-1]:.1f} tok/s" for n in names))
        stats = CacheClient(srv.url).stats()
    med = {n: statistics.median(tput[n]) for n in names}
    print(f"\n== Generation throughput, 8 x (600 prompt + 192 generated), tiny GLM, vLLM CPU, {reps} reps")
    print("  off: no connector; null: vLLM's connector machinery with a connector that does nothing "
          "(validation/null_connector.py); on: GlmCacheConnector"
          + ("; pinned: GlmCacheConnector with transfer_cpus off (its threads on the model's core)" if pinned else ""))
    for n in names:
        print(f"  connector {n:6s}  median {med[n]:.1f} tok/s  {['%.1f' % x for x in tput[n]]}")

    def ratio(a: str, b: str, what: str) -> None:
        per = [x / y for x, y in zip(tput[a], tput[b])]
        print(f"  {a}/{b} ({what}): ratio of medians {med[a] / med[b]:.3f}; per-rep "
              f"{['%.3f' % x for x in per]}, median {statistics.median(per):.3f}")

    ratio("on", "off", "goal >= 0.97")
    if null:
        ratio("null", "off", "vLLM's connector machinery")
        ratio("on", "null", "GlmCacheConnector's own cost")
    if pinned:
        ratio("on", "pinned", "transfer threads off the model's core vs on it")
    print(f"  server: {stats['puts_stored']} objects stored, {stats['puts_existing']} re-sent, "
          f"{stats['lookups']} lookups, {stats['hits']} hits")
    assert stats["hits"] == 0, "a workload found saved prompts: not pure overhead"
    print(f"  CPU seconds per workload, median of {reps} (load average now {os.getloadavg()[0]:.2f}):")
    for key in cpu["off"][0]:
        print(f"    {key:30s} " + "  ".join(f"{n} {statistics.median(d[key] for d in cpu[n]):9.3f}"
                                             for n in names))
    out = {n: med[n] for n in names}
    out["ratio"] = med["on"] / med["off"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="throughput repetitions per engine")
    ap.add_argument("--admission-reps", type=int, default=50)
    ap.add_argument("--skip-engines", action="store_true", help="admission only")
    ap.add_argument("--skip-admission", action="store_true", help="throughput only")
    ap.add_argument("--pinned-too", action="store_true",
                    help="throughput: a fourth engine whose connector threads stay on the model's core")
    ap.add_argument("--no-null", action="store_true",
                    help="throughput: no third engine with a do-nothing connector (vLLM's share of the cost)")
    args = ap.parse_args(argv)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (shared: figures are noisy)")
    res = {}
    if not args.skip_admission:
        res["admission"] = bench_admission(args.admission_reps)
    if not args.skip_engines:
        res["throughput"] = bench_throughput(args.reps, null=not args.no_null, pinned=args.pinned_too)
    print("\n" + repr(res))


if __name__ == "__main__":
    main()
