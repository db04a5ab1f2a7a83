"""Train the tiny checkpoint's MTP layer on its target's own greedy outputs; write
``glm5next_tiny/tiny_mtp_seed3.safetensors``, which ``glm5next-tiny --seed 3`` ships as
the checkpoint's MTP layer.

A developer tool that regenerates a data file of the tiny-checkpoint generator's package
(:mod:`glm5next_tiny`, ``glm5next_tiny.mtp_layer.trained_mtp_path``), not of the product
plugin: the model plugin (``glm5next_plugin``) never reads it. It uses the plugin only to
run the target (``glm5next_plugin.standalone``) and the MTP layer (``glm5next_plugin.mtp``).

    python -m validation.train_tiny_mtp [--seed 3] [--out PATH] [--data CACHE.json]

What is trained: only the MTP layer's tensors (``eh_proj``, ``enorm``/``hnorm``, the
attention and MoE block, ``shared_head.norm``), starting from the derived layer
(``glm5next_tiny.mtp_layer.mtp_state``); the target, its embedding and its ``lm_head`` (which the
MTP layer shares) stay as they are. The layer learns what vLLM's MTP drafter asks of it:

- draft 1 from position ``p``: the target's hidden state ``h_p`` and the embedding of token
  ``p + 1`` must give the target's greedy token after ``p + 1``, teacher-forced over whole
  sequences (the target's own greedy continuations);
- draft 2 (``num_speculative_tokens`` 2) from position ``m``, after the verify step whose
  newest token is at ``m``: the layer's own output at ``m - 1`` as the hidden state and the
  first draft's token, attending the true rows before ``m`` (as
  ``tests/engine/test_plugin_mtp.py``'s ``draft_chain`` and vLLM's proposer run it), must give
  the target's token at ``m + 2``.

Sequences, each a prompt and the standalone target's greedy continuation:

- broad: short prompts (the end of a demo-style document chat through the chat template,
  and random token ids) continued to 128 tokens, and (first phase only) random token ids
  teacher-forced. The random target is chaotic (changing one token 1-6 positions back
  changes its next token 63-97% of the time; a 2-layer MLP of width 1024 given the last 8
  tokens' embeddings and ``h_t`` memorises 310k rows and predicts 5-9% of unseen ones), so
  one layer learns little that carries to unseen text: its first draft agrees with the
  target at 8.8% of held-out continuation rows (6.5-11.6% after demo-style chats, 5.7%
  after random ids), where the derived layer gives 3-4% and chance is 1/512;
- fitted: the prompts ``validation/bench_drafts.py`` sends (its ``--prompts-from demo``
  chat turns and its random-token prompts, 3 each) with ``FITTED_TOKENS`` greedy tokens,
  enough for its 64 generated tokens and the drafts of the last verify steps. On those the
  layer reproduces the target: 92% of first drafts teacher-forced, and chained with k=2,
  84% of verify steps accept both drafts on the demo's turns, 100% on the random prompts
  (vLLM measures the same). That acceptance is what lets bench_drafts compare resumed and
  cold drafting; it is fitted, not what the layer does elsewhere.

Two phases: broad and random sequences (``--broad-epochs``), then broad and fitted ones,
each fitted sequence ``--fitted-repeat`` times an epoch (``--epochs``). The script prints
both sets' agreement before, between and after; the file's metadata keeps them.

Deterministic for a given ``--threads`` (fixed seeds, float32, the same order of work):
15 minutes on the 2-core dev machine at load 2.5 with 1 thread (5 minutes of greedy
continuations, the standalone model recomputing the whole sequence for every token, then
10 of training); 2 threads there ran 7-30x slower. The file's metadata holds the digest of
the target it was trained on; ``glm5next_tiny.write_checkpoint`` uses it only for that target
(byte-identical target tensors), and the derived layer otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SEED = 3
FITTED_TOKENS = 67  # bench_drafts' 64 generated tokens, plus what its last verify steps draft
BROAD_LEN = 128  # broad sequences stay at or under 131 tokens, where sparse MLA attends everything (fast)


# --- data ---------------------------------------------------------------------------------------
@torch.no_grad()
def greedy(target, ids: list[int], n: int) -> list[int]:
    """``ids`` and the target's ``n`` greedy tokens after them (standalone: the whole sequence
    again for every token)."""
    lm = target.model.language_model
    out = list(ids)
    for _ in range(n):
        out.append(int(target.lm_head(lm(torch.tensor(out))[-1]).argmax()))
    return out


def broad_prompts(tok, n: int, seed: int) -> list[list[int]]:
    """Short prompts: even ones the end of a demo-style document chat (``validation.demo``'s
    words and questions) through the chat template, odd ones random token ids."""
    from validation.demo import QUESTIONS, document

    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            messages = [{"role": "system", "content": "Answer from this document. "
                         + document(rng.randint(1, 4), rng.randrange(10**6))},
                        {"role": "user", "content": rng.choice(QUESTIONS)}]
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            out.append(ids[-rng.randint(16, 64):])
        else:
            out.append([rng.randrange(16, 512) for _ in range(rng.randint(8, 64))])
    return out


def fitted_prompts(ckpt: Path) -> list[list[int]]:
    from validation.bench_drafts import demo_prompts, random_prompts

    return demo_prompts(ckpt, 3, 180) + random_prompts(3, 1000)


@torch.no_grad()
def example(target, seq: list[int], prompt_len: int) -> dict:
    """One sequence with the target's hidden states and greedy next tokens at every position."""
    ids = torch.tensor(seq)
    hidden = target.model.language_model(ids)
    return {"ids": ids, "hidden": hidden, "next": target.lm_head(hidden).argmax(-1), "prompt_len": prompt_len,
            "logp": target.lm_head(hidden).log_softmax(-1)}


# --- the layer, step by step ----------------------------------------------------------------------
def first_drafts(layer, embed, ex: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's first-draft output (row ``p``: hidden ``h_p``, token ``p + 1``) and the
    rows it leaves in its attention cache: MTPLayer.forward, with the cache rows kept."""
    ids, hidden = ex["ids"], ex["hidden"]
    pos = torch.arange(len(ids) - 1)
    e = embed(ids[1:]).masked_fill((pos == 0).unsqueeze(-1), 0)
    x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(hidden[:-1])], dim=-1))
    a = layer.input_layernorm(x)
    rows = layer.self_attn.cache_rows(a)
    r = x + layer.self_attn.attend(a, layer.self_attn.close_pools(rows), pos)
    return layer.shared_head.norm(r + layer.mlp(layer.post_attention_layernorm(r))), rows


def second_drafts(layer, embed, ex: dict, out: torch.Tensor, rows: torch.Tensor, ms: list[int]) -> torch.Tensor:
    """The second draft's output at each position ``m`` in ``ms`` (the newest token of a
    verify step at ``m``, its first draft correct): hidden = the first draft's output at
    ``m - 1``, token ``m + 1``, over the true rows before ``m`` and its own."""
    attn = layer.self_attn
    res = []
    for m in ms:
        e = embed(ex["ids"][m + 1 : m + 2])
        x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(out[m - 1 : m])], dim=-1))
        a = layer.input_layernorm(x)
        seq_rows = attn.close_pools(torch.cat([rows[:m], attn.cache_rows(a)]))
        r = x + attn.attend(a, seq_rows, torch.tensor([m]))
        res.append(layer.shared_head.norm(r + layer.mlp(layer.post_attention_layernorm(r))))
    return torch.cat(res)


def decode_positions(ex: dict) -> list[int]:
    """The newest token's position ``m`` of every verify step a greedy decode can reach whose
    second draft has a target token to be checked against."""
    return list(range(ex["prompt_len"], len(ex["ids"]) - 2))


@torch.no_grad()
def chain_acceptance(layer, target, ex: dict, k: int = 2) -> list[int]:
    """Accepted drafts per position (``k`` drafts a step) over a greedy decode of the
    sequence, as vLLM's MTP proposer and greedy rejection sampler give them (the
    offline chain of tests/engine/test_plugin_mtp.py). Returns [verify steps, accepted at 1, ...]."""
    embed = target.model.language_model.embed_tokens
    out, rows = first_drafts(layer, embed, ex)
    first = target.lm_head(out).argmax(-1)
    seq = ex["ids"].tolist()
    counts = [0] * (k + 1)
    m = ex["prompt_len"]
    while m + k < len(seq):
        drafts, prev = [int(first[m - 1])], out[m - 1 : m]
        emb, hid = embed(ex["ids"][1 : m + 1]), ex["hidden"][:m]
        while len(drafts) < k and drafts[-1] == seq[m + len(drafts)]:
            emb = torch.cat([emb, embed(torch.tensor(drafts[-1:]))])
            hid = torch.cat([hid, prev])
            prev = layer(emb, hid, torch.arange(emb.shape[0]))[-1:]
            drafts.append(int(target.lm_head(prev).argmax()))
        a = 0
        while a < len(drafts) and drafts[a] == seq[m + 1 + a]:
            a += 1
        counts[0] += 1
        for i in range(a):
            counts[1 + i] += 1
        m += a + 1
    return counts


@torch.no_grad()
def teacher_forced(layer, target, data: list[dict]) -> float:
    """Share of decode rows (row ``p >= prompt_len - 1``) whose first draft is the target's
    greedy token."""
    embed = target.model.language_model.embed_tokens
    hit = total = 0
    for ex in data:
        out, _ = first_drafts(layer, embed, ex)
        ok = target.lm_head(out).argmax(-1)[:-1] == ex["next"][1:-1]
        hit += int(ok[ex["prompt_len"] - 1 :].sum())
        total += len(ok[ex["prompt_len"] - 1 :])
    return hit / total


# --- training -------------------------------------------------------------------------------------
def train(layer, target, broad: list[dict], fitted: list[dict], epochs: int, lr: float, log,
          fitted_repeat: int = 1) -> None:
    """Adam over the layer's tensors, one sequence a step: each epoch every broad sequence
    once and every fitted one ``fitted_repeat`` times, in a shuffled order."""
    embed = target.model.language_model.embed_tokens
    head = target.lm_head
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    work = [("broad", ex) for ex in broad] + [("fitted", ex) for ex in fitted] * fitted_repeat
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * len(work), pct_start=0.05)
    t0 = time.monotonic()
    for ep in range(epochs):
        random.Random(1000 + ep).shuffle(work)
        total = 0.0
        for kind, ex in work:
            out, rows = first_drafts(layer, embed, ex)
            logp = head(out[:-1]).log_softmax(-1)
            labels = ex["next"][1:-1]  # row p: the target's greedy token after p + 1
            weights = torch.ones(len(labels))
            weights[ex["prompt_len"] - 1 :] = 4.0  # the rows greedy decoding drafts from
            loss = (F.nll_loss(logp, labels, reduction="none") * weights).sum() / weights.sum()
            if kind == "broad":  # the target's whole next-token distribution: more to learn from per row
                loss = loss + F.kl_div(logp, ex["logp"][1:-1], log_target=True, reduction="batchmean")
            else:
                ms = decode_positions(ex)
                second = head(second_drafts(layer, embed, ex, out, rows, ms)).log_softmax(-1)
                loss = loss + F.nll_loss(second, ex["next"][torch.tensor(ms) + 1])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item()
        log(f"epoch {ep + 1}/{epochs}: loss {total / len(work):.3f} ({time.monotonic() - t0:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=SEED, help="the checkpoint's seed (glm5next-tiny --seed)")
    ap.add_argument("--out", help="default: glm5next_tiny/tiny_mtp_seed{SEED}.safetensors (the generator's package "
                    "data), which glm5next_tiny.write_checkpoint picks up for that target")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (the result depends on it; on 2 busy cores 2 threads ran 30x slower than 1)")
    ap.add_argument("--broad", type=int, default=160, help="broad sequences (short prompts continued to 128 tokens)")
    ap.add_argument("--held-out", type=int, default=16, help="broad sequences kept out of training, for the report")
    ap.add_argument("--random", type=int, default=600,
                    help="random-token sequences of 128 (teacher-forced only, no continuation) for the first phase")
    ap.add_argument("--broad-epochs", type=int, default=10, help="first phase: broad and random sequences")
    ap.add_argument("--epochs", type=int, default=30, help="second phase: broad and fitted sequences")
    ap.add_argument("--fitted-repeat", type=int, default=8, help="times each fitted sequence is trained on per epoch")
    ap.add_argument("--lr", type=float, default=3e-3, help="first phase's peak learning rate")
    ap.add_argument("--fit-lr", type=float, default=2e-3, help="second phase's peak learning rate")
    ap.add_argument("--data", help="JSON file caching the greedy sequences (read if there, else written)")
    args = ap.parse_args(argv)

    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    import glm5next_tiny
    from glm5next_plugin import mtp
    from glm5next_plugin.standalone import load_standalone

    def log(line: str) -> None:
        print(line, flush=True)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.monotonic()
    ckpt = Path(tempfile.mkdtemp(prefix="train-tiny-mtp-")) / "tiny"
    out = Path(args.out) if args.out else glm5next_tiny.trained_mtp_path(args.seed)
    glm5next_tiny.write_checkpoint(ckpt, seed=args.seed, trained_mtp=False)
    target = load_standalone(ckpt)
    for p in target.parameters():
        p.requires_grad_(False)
    text_config = AutoConfig.from_pretrained(ckpt).text_config
    tok = AutoTokenizer.from_pretrained(ckpt)

    cache = Path(args.data) if args.data else None
    if cache is not None and cache.is_file():
        seqs = json.loads(cache.read_text())
        log(f"greedy sequences from {cache}")
    else:
        seqs = {"broad": [], "fitted": []}
        for ids in broad_prompts(tok, args.broad + args.held_out, seed=11):
            seqs["broad"].append([len(ids), greedy(target, ids, BROAD_LEN - len(ids))])
        log(f"broad: {len(seqs['broad'])} greedy sequences ({time.monotonic() - t0:.0f} s)")
        for ids in fitted_prompts(ckpt):
            seqs["fitted"].append([len(ids), greedy(target, ids, FITTED_TOKENS)])
            log(f"fitted: {len(ids)}-token prompt + {FITTED_TOKENS} greedy tokens ({time.monotonic() - t0:.0f} s)")
        if cache is not None:
            cache.write_text(json.dumps(seqs))
    broad = [example(target, s, p) for p, s in seqs["broad"]]
    fitted = [example(target, s, p) for p, s in seqs["fitted"]]
    broad, held = broad[: args.broad], broad[args.broad :]
    gen = torch.Generator().manual_seed(5)
    randoms = [example(target, torch.randint(16, 512, (BROAD_LEN,), generator=gen).tolist(), 1)
               for _ in range(args.random)]

    layer = mtp.MTPLayer(text_config)
    derived = glm5next_tiny.mtp_state(checkpoint_state(ckpt), text_config)
    prefix = f"model.language_model.layers.{text_config.num_hidden_layers}."
    layer.load_state_dict({k[len(prefix):]: v for k, v in derived.items() if k.startswith(prefix)})
    # the step-by-step forward here is the layer's own (draft 1 over a whole sequence)
    ex = fitted[0]
    pos = torch.arange(len(ex["ids"]) - 1)
    with torch.no_grad():
        ref = layer(target.model.language_model.embed_tokens(ex["ids"][1:]), ex["hidden"][:-1], pos)
        torch.testing.assert_close(first_drafts(layer, target.model.language_model.embed_tokens, ex)[0], ref)

    def report(name: str) -> dict:
        out = {"held_out_first_draft": teacher_forced(layer, target, held),
               "fitted_first_draft": teacher_forced(layer, target, fitted)}
        for label, data in (("fitted_chain", fitted), ("held_out_chain", held)):
            c = [sum(x) for x in zip(*(chain_acceptance(layer, target, ex) for ex in data))]
            out[label] = [round(a / c[0], 4) for a in c[1:]]
        log(f"{name}: teacher-forced first draft, held out {out['held_out_first_draft']:.3f}, fitted "
            f"{out['fitted_first_draft']:.3f}; chained acceptance per position (k=2), fitted {out['fitted_chain']}, "
            f"held out {out['held_out_chain']}")
        return out

    before = report("derived layer")
    if args.broad_epochs:
        train(layer, target, broad + randoms, [], args.broad_epochs, args.lr, log)
        report("after the first phase")
    train(layer, target, broad, fitted, args.epochs, args.fit_lr, log, args.fitted_repeat)
    after = report("trained layer")

    full = checkpoint_state(ckpt)
    target_state = {k: v for k, v in full.items() if not k.startswith(prefix)}
    tensors = {k: v.detach().float().contiguous() for k, v in layer.state_dict().items()}
    meta = {"target_digest": glm5next_tiny.target_digest(target_state), "seed": str(args.seed),
            "trained_by": "validation/train_tiny_mtp.py", "threads": str(args.threads),
            "broad_epochs": str(args.broad_epochs), "random": str(args.random), "lr": str(args.lr),
            "epochs": str(args.epochs), "fit_lr": str(args.fit_lr), "fitted_repeat": str(args.fitted_repeat),
            "broad": str(args.broad),
            "fitted_tokens": str(FITTED_TOKENS),
            "derived": json.dumps(before), "trained": json.dumps(after),
            # the fitted sequences (prompt length, prompt + greedy tokens): the tests check on them
            "fitted": json.dumps(seqs["fitted"])}
    save_file(tensors, str(out), metadata=meta)
    log(f"wrote {out} ({out.stat().st_size} bytes) in {time.monotonic() - t0:.0f} s")
    return 0


def checkpoint_state(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


if __name__ == "__main__":
    sys.exit(main())
