"""Build (and with --execute, run) the validation notebooks.

The cell sources live here, one list per notebook, so they are reviewed as code; the
committed ``.ipynb`` files are this script's output, executed, with their plots.

    python -m validation.build_notebooks --execute [NAME ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent

SETUP = '''\
import json, random, re, sys, time, uuid
from pathlib import Path

ROOT = Path.cwd().resolve()
while not (ROOT / "pyproject.toml").exists():
    ROOT = ROOT.parent
sys.path.insert(0, str(ROOT))

import numpy as np
import matplotlib.pyplot as plt
from IPython.display import Markdown, display
from scipy import stats

from testing.server_process import ServerProcess
from validation.serving import VllmServer, chat, complete, connector_config

CKPT = ROOT / "artifacts" / "glm5next-tiny"
from glm5next_tiny import ensure_checkpoint
ensure_checkpoint(CKPT)

# Chunk == vLLM's unified block (128 for this checkpoint), as in production (1152 at TP 4).
server = ServerProcess("--separate-object-groups", "--l1-size-gb", "2", "--chunk-size", "128").start()
engine = VllmServer(CKPT, "--enforce-eager", "--max-num-batched-tokens", "2048",
                    kv_transfer_config=connector_config(server.url)).start(progress=False)
chat(engine.base_url, [{"role": "user", "content": "warm up"}], 4)
negotiated = [l.split(": ", 1)[1] for l in server.log().splitlines() if "Negotiated chunk size" in l][0]
geometry = [l.split("Resolved geometry: ")[1] for l in engine.log().splitlines() if "Resolved geometry" in l][0]
C = int(re.search(r"chunk_size=(\\d+)", geometry).group(1))
print(negotiated)
print("Resolved geometry:", geometry)

def reset_local_cache():
    """Empty vLLM's local prefix cache, so a hit can only come from glm-cache-server."""
    for _ in range(20):
        if engine.reset_prefix_cache():
            return
        time.sleep(0.2)
    raise RuntimeError("vLLM refused to reset its prefix cache")

def strict_hit(n):
    return C * ((n - 1) // C)

def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    display(Markdown("\\n".join(lines)))
'''

TEARDOWN = '''\
engine.stop()
server_exit_code = server.stop()
'''

COLD_VS_RELOAD = [
    ("markdown", """\
# Cold vs reloaded log-probs (document QA)

The seed recipe's validation (seeds/003) on our stack: GLM-5.3-Flash (a generated tiny
checkpoint) in vLLM's CPU build with the plugin, `GlmCacheConnector` and
`glm-cache-server`.

* **Cold**: each prompt sent with a fresh `cache_salt`, so neither vLLM's prefix cache nor
  the server can help.
* **Reloaded**: each prompt stored once under the conversation's salt, vLLM's local prefix
  cache reset, then sent again: every reused token comes from the cache server.

On CPU the engine is deterministic, so instead of one prompt 16 times (as on GPUs, where
run-to-run noise gives a distribution) we ask 16 different questions about one document:
16 prompts, each cold and reloaded. The comparison is the first generated token's
log-prob: its distribution under both conditions (Welch's t-test) and exact equality per
prompt."""),
    ("code", SETUP),
    ("code", '''\
WORDS = ("cache state token prompt model layer block chunk server engine request vector latent pool "
         "index sparse expert router stream gate decay value key query memory host device prefix "
         "resume snapshot boundary hash group").split()
rng = random.Random(0)
doc = " ".join(f"{i + 1}. " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."
               for i in range(160))
questions = [f"Question {i + 1}: what does sentence {rng.randint(1, 160)} say about the {rng.choice(WORDS)}?"
             for i in range(N_QUESTIONS)]
prompts = [[{"role": "system", "content": "Answer from this document. " + doc}, {"role": "user", "content": q}]
           for q in questions]

cold = [chat(engine.base_url, p, max_tokens=16, cache_salt=f"cold-{uuid.uuid4().hex}") for p in prompts]
salt = f"qa-{uuid.uuid4().hex[:8]}"
for p in prompts:
    chat(engine.base_url, p, max_tokens=16, cache_salt=salt)  # computed and stored
reloaded = []
for p in prompts:
    reset_local_cache()
    reloaded.append(chat(engine.base_url, p, max_tokens=16, cache_salt=salt))
print(f"{len(prompts)} prompts of {min(r.prompt_tokens for r in cold)}-{max(r.prompt_tokens for r in cold)} tokens")
'''),
    ("code", '''\
rows = []
for i, (c, r) in enumerate(zip(cold, reloaded)):
    rows.append((i + 1, c.prompt_tokens, c.cached_tokens, r.cached_tokens, strict_hit(c.prompt_tokens),
                 f"{c.token_logprobs[0]:.6f}", f"{r.token_logprobs[0]:.6f}", c.text == r.text))
table(["prompt", "tokens", "cold hit", "reloaded hit", "C*floor((N-1)/C)", "cold first log-prob",
       "reloaded first log-prob", "same tokens"], rows)
'''),
    ("code", '''\
cold_lp = np.array([c.token_logprobs[0] for c in cold])
rel_lp = np.array([r.token_logprobs[0] for r in reloaded])
fig, ax = plt.subplots(figsize=(7, 3.5))
bins = np.linspace(min(cold_lp.min(), rel_lp.min()) - 0.05, max(cold_lp.max(), rel_lp.max()) + 0.05, 20)
ax.hist(cold_lp, bins=bins, alpha=0.6, label=f"cold (mean {cold_lp.mean():.3f})")
ax.hist(rel_lp, bins=bins, alpha=0.6, histtype="step", linewidth=2, label=f"reloaded (mean {rel_lp.mean():.3f})")
ax.set_xlabel("log-prob of the first generated token")
ax.set_ylabel("prompts")
ax.set_title("First-token log-prob: cold vs reloaded from glm-cache-server")
ax.legend()
plt.tight_layout()
plt.show()
'''),
    ("code", '''\
t = stats.ttest_ind(cold_lp, rel_lp, equal_var=False)
exact_lp = int(np.sum(cold_lp == rel_lp))
exact_tokens = sum(c.text == r.text for c, r in zip(cold, reloaded))
hits = [r.cached_tokens for r in reloaded]
print(f"Welch's t-test: t = {t.statistic:.4f}, p = {t.pvalue:.4f}")
print(f"first-token log-prob exactly equal: {exact_lp}/{len(cold)}")
print(f"generated tokens exactly equal:     {exact_tokens}/{len(cold)}")
print(f"reloaded hit tokens: {min(hits)}-{max(hits)} (mean {np.mean(hits):.0f}); cold hit tokens: "
      f"{sum(c.cached_tokens for c in cold)}")
assert all(c.cached_tokens == 0 for c in cold), "a cold run was served from a cache"
assert all(0 < h <= strict_hit(r.prompt_tokens) for h, r in zip(hits, reloaded)), "hit outside the strict prefix"
assert exact_tokens == len(cold) and exact_lp == len(cold), "a reloaded output differs from cold"
'''),
    ("markdown", """\
## Drafts on: MTP speculative decoding

The same 16 prompts on a second engine sharing the server, with the checkpoint's MTP layer
drafting two tokens a step (`--speculative-config` with `disable_padded_drafter_batch`,
which the connector needs to cache draft rows). Its namespace names the draft, so it shares
no object with the engine above. Draft rows are cached with the attention; chunk keys cover
the token after each chunk. Rejection sampling keeps greedy output the target's, so the
check is the same: cold vs reloaded first-token log-prob and tokens, plus vLLM's acceptance
counters for both phases (the tiny checkpoint's MTP layer is derived from its last layer,
so few drafts are accepted; `validation/bench_drafts.py` compares speeds). Hits can be a
chunk shorter than drafts off: this engine sets no `--prefix-cache-retention-interval`, and
with drafts vLLM keeps a prompt's KDA snapshots one block earlier (its EAGLE block drop)."""),
    ("code", '''\
MTP = {"method": "mtp", "num_speculative_tokens": 2, "disable_padded_drafter_batch": True}
drafts_engine = VllmServer(CKPT, "--enforce-eager", "--max-num-batched-tokens", "2048",
                           "--speculative-config", json.dumps(MTP),
                           kv_transfer_config=connector_config(server.url)).start(progress=False)
print(next(("GlmCacheConnector: " + l.split("GlmCacheConnector: ", 1)[1] for l in drafts_engine.log().splitlines()
            if "GlmCacheConnector: " in l and "drafts (k=" in l), "(the connector's drafts line is not in the log)"))

def spec_counters(url):
    import urllib.request
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    value = lambda name: sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\\S+)$", text, re.M))
    return value("vllm:spec_decode_num_drafts_total"), value("vllm:spec_decode_num_accepted_tokens_total")

def acceptance_length(before, after):
    drafts, accepted = after[0] - before[0], after[1] - before[1]
    return 1 + accepted / drafts if drafts else float("nan")

c0 = spec_counters(drafts_engine.base_url)
cold_d = [chat(drafts_engine.base_url, p, max_tokens=16, cache_salt=f"cold-{uuid.uuid4().hex}") for p in prompts]
c1 = spec_counters(drafts_engine.base_url)
salt_d = f"qa-drafts-{uuid.uuid4().hex[:8]}"
for p in prompts:
    chat(drafts_engine.base_url, p, max_tokens=16, cache_salt=salt_d)  # computed and stored
reloaded_d = []
c2 = spec_counters(drafts_engine.base_url)
for p in prompts:
    for _ in range(20):
        if drafts_engine.reset_prefix_cache():
            break
        time.sleep(0.2)
    reloaded_d.append(chat(drafts_engine.base_url, p, max_tokens=16, cache_salt=salt_d))
c3 = spec_counters(drafts_engine.base_url)
cold_d_lp = np.array([c.token_logprobs[0] for c in cold_d])
rel_d_lp = np.array([r.token_logprobs[0] for r in reloaded_d])
table(["", "drafts off", "MTP drafts"],
      [("first-token log-prob exactly equal, cold vs reloaded", f"{exact_lp}/{len(cold)}",
        f"{int(np.sum(cold_d_lp == rel_d_lp))}/{len(cold_d)}"),
       ("generated tokens exactly equal, cold vs reloaded", f"{exact_tokens}/{len(cold)}",
        f"{sum(c.text == r.text for c, r in zip(cold_d, reloaded_d))}/{len(cold_d)}"),
       ("same tokens as drafts off (cold)", "-", f"{sum(c.text == d.text for c, d in zip(cold, cold_d))}/{len(cold)}"),
       ("reloaded hit tokens (mean)", f"{np.mean(hits):.0f}", f"{np.mean([r.cached_tokens for r in reloaded_d]):.0f}"),
       ("mean acceptance length, cold / reloaded", "-",
        f"{acceptance_length(c0, c1):.3f} / {acceptance_length(c2, c3):.3f}")])

fig, ax = plt.subplots(figsize=(7, 3.5))
ax.scatter(cold_lp, rel_lp, marker="o", label="drafts off")
ax.scatter(cold_d_lp, rel_d_lp, marker="x", s=60, label="MTP drafts")
lo, hi = min(cold_lp.min(), cold_d_lp.min()) - 0.05, max(cold_lp.max(), cold_d_lp.max()) + 0.05
ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8)
ax.set_xlabel("cold first-token log-prob")
ax.set_ylabel("reloaded first-token log-prob")
ax.set_title("Cold vs reloaded, drafts off and on (on the diagonal: equal)")
ax.legend()
plt.tight_layout()
plt.show()
assert all(c.cached_tokens == 0 for c in cold_d), "a cold run was served from a cache"
assert all(0 < r.cached_tokens <= strict_hit(r.prompt_tokens) for r in reloaded_d), "hit outside the strict prefix"
assert all(c.text == r.text for c, r in zip(cold_d, reloaded_d)), "a reloaded output with drafts differs from cold"
assert np.array_equal(cold_d_lp, rel_d_lp), "a reloaded first-token log-prob with drafts differs from cold"
drafts_engine.stop()
'''),
    ("markdown", """\
## Images in the prompt

The same engine, now with a picture in each prompt: the 16 prompts again, each with a
random 112x112 picture (16 image tokens, through the plugin's vision tower) at the start of
the system prompt, before the document. The picture is part of every chunk key from its
first placeholder on: vLLM's block hashes name it and where it sits, and the connector also
names its processed pixels, so a client-supplied media id never reaches another client's
KV. Cold vs reloaded as above; then each question again with another picture under the
same salt, which may resume only before the picture (here: nothing, it is in the first
chunk)."""),
    ("code", '''\
import base64, io
from PIL import Image

def picture(seed, size=112):
    r = random.Random(seed)
    img = Image.frombytes("RGB", (size, size), bytes(r.randrange(256) for _ in range(size * size * 3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}

def with_picture(p, seed):  # the picture first, then the document, then the question
    return [{"role": "system", "content": [picture(seed), {"type": "text", "text": p[0]["content"]}]}, p[1]]

image_prompts = [with_picture(p, 100 + i) for i, p in enumerate(prompts)]
cold_i = [chat(engine.base_url, p, max_tokens=16, cache_salt=f"cold-{uuid.uuid4().hex}") for p in image_prompts]
salt_i = f"qa-images-{uuid.uuid4().hex[:8]}"
for p in image_prompts:
    chat(engine.base_url, p, max_tokens=16, cache_salt=salt_i)  # computed and stored
reloaded_i, swapped_i = [], []
for i, p in enumerate(image_prompts):
    reset_local_cache()
    reloaded_i.append(chat(engine.base_url, p, max_tokens=16, cache_salt=salt_i))
    reset_local_cache()
    swapped_i.append(chat(engine.base_url, with_picture(prompts[i], 900 + i), max_tokens=16, cache_salt=salt_i))
cold_i_lp = np.array([c.token_logprobs[0] for c in cold_i])
rel_i_lp = np.array([r.token_logprobs[0] for r in reloaded_i])
table(["", "text", "image in the prompt"],
      [("prompt tokens", f"{min(c.prompt_tokens for c in cold)}-{max(c.prompt_tokens for c in cold)}",
        f"{min(c.prompt_tokens for c in cold_i)}-{max(c.prompt_tokens for c in cold_i)}"),
       ("first-token log-prob exactly equal, cold vs reloaded", f"{exact_lp}/{len(cold)}",
        f"{int(np.sum(cold_i_lp == rel_i_lp))}/{len(cold_i)}"),
       ("generated tokens exactly equal, cold vs reloaded", f"{exact_tokens}/{len(cold)}",
        f"{sum(c.text == r.text for c, r in zip(cold_i, reloaded_i))}/{len(cold_i)}"),
       ("reloaded hit tokens (mean)", f"{np.mean(hits):.0f}", f"{np.mean([r.cached_tokens for r in reloaded_i]):.0f}"),
       ("hit tokens with another picture, same salt (mean)", "-",
        f"{np.mean([s.cached_tokens for s in swapped_i]):.0f}"),
       ("the picture changes the first log-prob", "-",
        f"{sum(a != b for a, b in zip(cold_lp, cold_i_lp))}/{len(cold_i)} prompts")])

fig, ax = plt.subplots(figsize=(7, 3.5))
ax.scatter(cold_lp, rel_lp, marker="o", label="text")
ax.scatter(cold_i_lp, rel_i_lp, marker="^", s=50, label="image in the prompt")
lo, hi = min(cold_lp.min(), cold_i_lp.min()) - 0.05, max(cold_lp.max(), cold_i_lp.max()) + 0.05
ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8)
ax.set_xlabel("cold first-token log-prob")
ax.set_ylabel("reloaded first-token log-prob")
ax.set_title("Cold vs reloaded, text and image prompts (on the diagonal: equal)")
ax.legend()
plt.tight_layout()
plt.show()
assert all(c.cached_tokens == 0 for c in cold_i), "a cold run was served from a cache"
assert all(0 < r.cached_tokens <= strict_hit(r.prompt_tokens) for r in reloaded_i), "hit outside the strict prefix"
assert all(c.text == r.text for c, r in zip(cold_i, reloaded_i)), "a reloaded image prompt's output differs from cold"
assert np.array_equal(cold_i_lp, rel_i_lp), "a reloaded image prompt's first-token log-prob differs from cold"
assert all(s.cached_tokens < r.cached_tokens for s, r in zip(swapped_i, reloaded_i)), "another picture resumed past it"
'''),
    ("code", TEARDOWN),
]

BOUNDARY_SWEEP = [
    ("markdown", """\
# Boundary sweep (the paper's nine-length serial workload)

Prompt lengths `k*C-1`, `k*C`, `k*C+1` for k = 1, 2, 3 around the negotiated chunk `C`,
served one at a time: each prompt cold (fresh `cache_salt`), then stored (itself and, as a
later conversation turn would, a prompt one token longer), vLLM's local cache reset, and
reloaded; 64-token greedy continuations compared token by token.

With the strict-prefix rule a hit is at most `C*floor((N-1)/C)` tokens, so a prompt of
exactly `k*C` tokens resumes one chunk early and recomputes it. The last section turns the
rule off for diagnosis, on a second engine sharing the server (`strict_prefix: false` in
its `kv_connector_extra_config`: operator policy, never a per-request switch, and such an
engine never saves) to show what the rule prevents: seed 004's bug, where a full hit
restores the KDA state after all N tokens while vLLM recomputes the last one."""),
    ("code", SETUP),
    ("code", '''\
def sweep(reloader, seed):
    """Cold and stored through the strict `engine`; reloaded through `reloader`."""
    rows = []
    rng = random.Random(seed)
    for k in KS:
        for n in (k * C - 1, k * C, k * C + 1):
            prompt = [rng.randrange(16, 500) for _ in range(n)]
            cold = complete(engine.base_url, prompt, 64, cache_salt=f"cold-{uuid.uuid4().hex}")
            salt = f"sweep-{uuid.uuid4().hex[:8]}"
            complete(engine.base_url, prompt, 64, cache_salt=salt)
            # A later turn of the same conversation: its prompt extends this one, so its
            # computation leaves a KDA snapshot where this prompt ends when that is a chunk boundary.
            complete(engine.base_url, prompt + [rng.randrange(16, 500)], 1, cache_salt=salt)
            reset_local_cache()
            rel = complete(reloader.base_url, prompt, 64, cache_salt=salt)
            first_diff = next((i for i, (a, b) in enumerate(zip(cold.token_ids, rel.token_ids)) if a != b), None)
            rows.append(dict(n=n, hit=rel.cached_tokens, strict=strict_hit(n),
                             match=cold.token_ids == rel.token_ids, first_diff=first_diff,
                             dlogprob=abs(cold.token_logprobs[0] - rel.token_logprobs[0])))
    return rows

strict_rows = sweep(engine, seed=1)
table(["length", "hit tokens", "C*floor((N-1)/C)", "64 tokens match", "first differing token",
       "|first log-prob diff|"],
      [(r["n"], r["hit"], r["strict"], r["match"], r["first_diff"], f"{r['dlogprob']:.2e}") for r in strict_rows])
print(f"strict prefix: {sum(r['match'] for r in strict_rows)}/{len(strict_rows)} continuations identical to cold")
assert all(r["hit"] == r["strict"] for r in strict_rows), "hit is not the strict prefix"
assert all(r["match"] for r in strict_rows), "a reloaded continuation differs from cold"
'''),
    ("markdown", """\
## Diagnostic: strict prefix off

Same workload, reloaded through a second engine whose connector runs with
`strict_prefix: false` (the stores still go through the strict engine: a non-strict engine
never saves). At lengths `k*C` the lookup may now
cover the whole prompt: the state stored at `k*C` already holds the prompt's last token,
vLLM recomputes that token to get logits, and the KDA state sees it twice."""),
    ("code", '''\
loose_engine = VllmServer(CKPT, "--enforce-eager", "--max-num-batched-tokens", "2048",
                          kv_transfer_config=connector_config(server.url, strict_prefix=False)).start(progress=False)
loose_rows = sweep(loose_engine, seed=1)
loose_engine.stop()
table(["length", "hit tokens", "C*floor((N-1)/C)", "64 tokens match", "first differing token",
       "|first log-prob diff|"],
      [(r["n"], r["hit"], r["strict"], r["match"], r["first_diff"], f"{r['dlogprob']:.2e}") for r in loose_rows])
full = [r for r in loose_rows if r["n"] % C == 0]
print(f"strict prefix off: {sum(r['match'] for r in loose_rows)}/{len(loose_rows)} identical; at k*C lengths "
      f"{sum(not r['match'] for r in full)}/{len(full)} diverge")
assert all(r["hit"] == r["n"] for r in full), "without strict prefix a k*C prompt should hit in full"
'''),
    ("code", '''\
fig, ax = plt.subplots(figsize=(7, 3.2))
x = np.arange(len(strict_rows))
ax.bar(x - 0.2, [r["dlogprob"] + 1e-12 for r in strict_rows], 0.4, label="strict prefix (default)")
ax.bar(x + 0.2, [r["dlogprob"] + 1e-12 for r in loose_rows], 0.4, label="strict prefix off (diagnosis)")
ax.set_yscale("log")
ax.set_xticks(x, [str(r["n"]) for r in strict_rows])
ax.set_xlabel("prompt length (tokens)")
ax.set_ylabel("|first-token log-prob: reloaded - cold|")
ax.set_title(f"Boundary sweep around C = {C}")
ax.legend()
plt.tight_layout()
plt.show()
'''),
    ("code", TEARDOWN),
]

TTFT = [
    ("markdown", """\
# Time to first token: cold vs reloaded from glm-cache-server vs vLLM's local hit

For each prompt length: a cold send (fresh `cache_salt`), a send that stores, a resend
that hits vLLM's own prefix cache, and a resend after resetting vLLM's local cache, which
reloads from glm-cache-server. Median of three rounds, measured from a streaming client.
The tiny checkpoint makes prefill cheap, so absolute times are small and the ratios say
more than the milliseconds."""),
    ("code", SETUP),
    ("code", '''\
lengths = LENGTHS
rounds = ROUNDS
results = {n: {"cold": [], "reloaded": [], "local": [], "hit": []} for n in lengths}
rng = random.Random(2)
for rnd in range(rounds):
    for n in lengths:
        prompt = [rng.randrange(16, 500) for _ in range(n)]
        results[n]["cold"].append(complete(engine.base_url, prompt, 4, cache_salt=f"cold-{uuid.uuid4().hex}").ttft_s)
        salt = f"ttft-{uuid.uuid4().hex[:8]}"
        complete(engine.base_url, prompt, 4, cache_salt=salt)
        results[n]["local"].append(complete(engine.base_url, prompt, 4, cache_salt=salt).ttft_s)
        reset_local_cache()
        r = complete(engine.base_url, prompt, 4, cache_salt=salt)
        results[n]["reloaded"].append(r.ttft_s)
        results[n]["hit"].append(r.cached_tokens)
med = {n: {k: float(np.median(v)) for k, v in d.items()} for n, d in results.items()}
table(["prompt tokens", "hit tokens (reloaded)", "cold ms", "reloaded ms", "local hit ms", "reloaded / cold"],
      [(n, int(med[n]["hit"]), f"{med[n]['cold'] * 1e3:.1f}", f"{med[n]['reloaded'] * 1e3:.1f}",
        f"{med[n]['local'] * 1e3:.1f}", f"{med[n]['reloaded'] / med[n]['cold']:.2f}") for n in lengths])
'''),
    ("code", '''\
fig, ax = plt.subplots(figsize=(7, 3.8))
for key, label in (("cold", "cold"), ("reloaded", "reloaded from glm-cache-server"), ("local", "vLLM local hit")):
    ax.plot(lengths, [med[n][key] * 1e3 for n in lengths], marker="o", label=label)
ax.set_xlabel("prompt tokens")
ax.set_ylabel("TTFT (ms, median, log scale)")
ax.set_yscale("log")
ax.set_title("Time to first token, GLM-5.3-Flash tiny on CPU")
ax.legend()
plt.tight_layout()
plt.show()
assert all(med[n]["hit"] == strict_hit(n) for n in lengths), "reloaded hit is not the strict prefix"
'''),
    ("code", TEARDOWN),
]

NOTEBOOKS = {"cold_vs_reload": COLD_VS_RELOAD, "boundary_sweep": BOUNDARY_SWEEP, "ttft": TTFT}


# Each notebook's sizes, in one cell after its title: what the committed notebook ran.
PARAMETERS = {
    "cold_vs_reload": {"N_QUESTIONS": 16},
    "boundary_sweep": {"KS": (1, 2, 3)},
    "ttft": {"LENGTHS": [512, 1024, 2048, 4096, 8000], "ROUNDS": 3},
}
# The sizes tests/engine/test_notebooks.py runs each notebook at: every cell, claim and plot, on
# less data (4 questions; k = 1: lengths C-1, C, C+1, where strict prefix off already
# diverges; two lengths, one round), to keep the suite's time.
SMALL = {
    "cold_vs_reload": {"N_QUESTIONS": 4},
    "boundary_sweep": {"KS": (1,)},
    "ttft": {"LENGTHS": [512, 2048], "ROUNDS": 1},
}


def parameters_cell(values: dict) -> str:
    return "# Parameters (tests/engine/test_notebooks.py runs smaller ones)\n" + "".join(f"{k} = {v!r}\n" for k, v in values.items())


def build(name: str, parameters: dict | None = None) -> nbformat.NotebookNode:
    """Notebook ``name`` with its committed sizes, or with ``parameters`` in their place."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for i, (kind, source) in enumerate(NOTEBOOKS[name]):
        cell = nbformat.v4.new_markdown_cell(source) if kind == "markdown" else nbformat.v4.new_code_cell(source)
        nb.cells.append(cell)
        if i == 0:  # the title
            nb.cells.append(nbformat.v4.new_code_cell(parameters_cell(parameters or PARAMETERS[name])))
    return nb


def execute(nb: nbformat.NotebookNode, timeout_s: int = 900) -> nbformat.NotebookNode:
    """Run a notebook headless in validation/ (raises CellExecutionError on a failing cell)."""
    NotebookClient(nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=list(NOTEBOOKS), help=f"any of {', '.join(NOTEBOOKS)}")
    ap.add_argument("--execute", action="store_true", help="run each notebook and save it with its outputs")
    args = ap.parse_args()
    unknown = set(args.names) - set(NOTEBOOKS)
    if unknown:
        ap.error(f"unknown notebooks {sorted(unknown)}; expected {', '.join(NOTEBOOKS)}")
    for name in args.names:
        nb = build(name)
        if args.execute:
            t0 = time.monotonic()
            print(f"executing {name} ...", flush=True)
            execute(nb)
            print(f"  done in {time.monotonic() - t0:.0f}s", flush=True)
        nbformat.write(nb, HERE / f"{name}.ipynb")
    return 0


if __name__ == "__main__":
    sys.exit(main())
