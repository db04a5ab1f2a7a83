"""Server-only demo: a short client session against a real glm-cache-server (no engine).

Starts the server, negotiates the chunk size the way a vLLM engine with GLM-5.3-Flash at
TP 4 would (alignment 1152), stores a prompt's chunks as separate object groups (MLA
latent + indexer per chunk, a KDA state at a chunk boundary), looks the prompt up by
strict prefix and reads the hit back. ``validation/demo.py`` is the full demo with vLLM.
"""

from __future__ import annotations

import json
import os
import random
import sys

from cache_server.chunk_keys import chunk_hashes
from cache_server.client import CacheClient
from testing.server_process import ServerProcess

ATTN_GROUP, STATE_GROUP = 4, 0  # group ids as vLLM numbers them: KDA state groups first


def main() -> int:
    with ServerProcess("--separate-object-groups", "--l1-size-gb", "0.5") as server, \
            CacheClient(server.url, timeout_s=5.0) as client:
        print(f"glm-cache-server running at {server.url}, HTTP {server.http_url}")
        namespace = "demo:glm-5.3-flash:tp4"
        hello = client.hello(namespace, alignment=1152)
        chunk = hello["chunk_size"]
        print(f"1. negotiation: alignment 1152, configured minimum {hello['min_chunk_size']} "
              f"-> chunk size {chunk}")
        print("   server log:", next(line for line in server.log().splitlines() if "Negotiated" in line))

        rng = random.Random(0)
        prompt = [rng.randrange(150_000) for _ in range(3 * chunk + 100)]
        hashes = chunk_hashes(prompt, chunk, cache_salt="demo-user")
        attn = [os.urandom(64 * 1024) for _ in hashes]  # stand-ins for MLA latent + indexer pages
        state = os.urandom(256 * 1024)  # stand-in for every KDA layer's state at the boundary
        results = client.put(namespace, [(h, ATTN_GROUP, 0, a) for h, a in zip(hashes, attn)])
        results += client.put(namespace, [(hashes[-1], STATE_GROUP, 0, state)])
        print(f"2. store: {len(prompt)} tokens -> {len(hashes)} whole chunks of attention objects and a KDA "
              f"state at chunk {len(hashes)}: {results}")

        n_strict = (len(prompt) - 1) // chunk
        hit, lease = client.lookup(namespace, hashes[:n_strict], [ATTN_GROUP], [STATE_GROUP])
        print(f"3. strict-prefix lookup of the same prompt: {hit} chunks = {hit * chunk} tokens of {len(prompt)} "
              f"(at most C*floor((N-1)/C) = {chunk * n_strict}); the rest is recomputed")

        got = client.get(namespace, [(h, ATTN_GROUP, 0) for h in hashes[:hit]] + [(hashes[hit - 1], STATE_GROUP, 0)])
        ok = [bytes(g) for g in got] == attn[:hit] + [state]
        client.release(lease)
        print(f"4. hit: read back {sum(g.nbytes for g in got)} bytes, identical to what was stored: {ok}")

        exact = [rng.randrange(150_000) for _ in range(2 * chunk)]
        ex_hashes = chunk_hashes(exact, chunk, cache_salt="demo-user")
        client.put(namespace, [(h, ATTN_GROUP, 0, b"a") for h in ex_hashes] + [(h, STATE_GROUP, 0, b"s") for h in ex_hashes])
        ex_hit, _ = client.lookup(namespace, ex_hashes[:(len(exact) - 1) // chunk], [ATTN_GROUP], [STATE_GROUP],
                                  lease=False)
        print(f"5. a prompt of exactly {len(exact)} tokens, stored whole with states at both chunks, resumes at "
              f"{ex_hit * chunk}, not {len(exact)}: the last chunk is recomputed, so the KDA state never sees a token "
              "twice")
        other = chunk_hashes(prompt, chunk, cache_salt="another-user")
        print(f"6. the same prompt under another cache_salt: "
              f"{client.lookup(namespace, other[:n_strict], [ATTN_GROUP], [STATE_GROUP])[0]} chunks hit")
        status = server.status()
        print("7. /status:", json.dumps({k: status[k] for k in ("objects", "bytes_by_group", "hits", "misses",
                                                                  "evictions", "active_leases")}))
        return 0 if ok and hit == n_strict and ex_hit == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
