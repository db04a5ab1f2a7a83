"""Per layout and TP size: vLLM's unified block, the cached groups, per-layer pages, and
per-rank bytes per 1152-token chunk (attention) and per state snapshot (KDA), computed
from the KV cache config vLLM builds for GLM-5.3-Flash (testing/glm_flash_kv_layouts.py);
then memory plans for the recipes' GPUs (derived, not run: weights at FP8 from the
parameter count of the fixture's text config: transformers' defaults with the served
index_kpool; and what is left for vLLM's cache).

    python -m validation.geometry_report
"""

from __future__ import annotations

from testing import glm_flash_kv_layouts as L


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def report() -> str:
    cfg = L.text_config()
    out: list[str] = []
    for layout in L.LAYOUTS:
        for tp in L.TP_SIZES:
            built = L.build(layout, tp, num_blocks=1, cfg=cfg)
            geo = L.resolve(built)
            kv = built.kv_cache_config
            out.append(f"== {layout} TP {tp}: unified block {built.block_size} tokens, "
                       f"kv layout {built.kv_layout.name}")
            for gid, grp in enumerate(kv.kv_cache_groups):
                if geo.group_tokens_per_block[gid] == 0:
                    out.append(f"  vLLM group {gid}: {len(grp.layer_names)} layers, "
                               f"{type(grp.kv_cache_spec).__name__}: not prefix-cacheable, skipped")
            for g in geo.groups:
                kinds: dict[tuple[int, str, int], int] = {}
                for p in g.layers:
                    key = (p.page_bytes, p.dtype, p.states_per_page)
                    kinds[key] = kinds.get(key, 0) + 1
                desc = ", ".join(f"{n} x {pb} B ({dt}, {st} rows/block)" for (pb, dt, st), n in kinds.items())
                kind = "KDA state" if g.is_state else "attention"
                out.append(f"  object group {g.group_id} {g.name} (vLLM group {g.vllm_group}, {kind}, "
                           f"replicated_across_tp={g.replicated_across_tp}): "
                           f"{len(g.layers)} layers: {desc}")
            attn_per_token = sum(g.object_bytes_per_block for g in geo.attn_groups) / built.block_size
            per_chunk = attn_per_token * L.CHUNK_TOKENS
            state = sum(g.object_bytes_per_block for g in geo.state_groups)
            latent = sum(p.page_bytes for g in geo.attn_groups for p in g.layers
                         if p.name.endswith(".attn")) / built.block_size * L.CHUNK_TOKENS
            line = (f"  per rank: attention {_mb(per_chunk)} per {L.CHUNK_TOKENS}-token chunk"
                    f" ({attn_per_token:.0f} B/token)")
            if latent:
                line += f", of which MLA latent {_mb(latent)}"
            if built.block_size != L.CHUNK_TOKENS and L.CHUNK_TOKENS % built.block_size:
                line += f" [note: {L.CHUNK_TOKENS} is not a multiple of this block]"
            out.append(line)
            out.append(f"  per rank: KDA state snapshot {_mb(state)} (34 layers x "
                       f"{geo.state_groups[0].layers[0].page_bytes} B)")
    return "\n".join(out)


GIB = 1 << 30
# (name, GB per GPU as sold, GPU count): the recipes' deployments.
DEPLOYMENTS = [("H200", 141, 4), ("RTX PRO 6000", 96, 2), ("RTX PRO 6000", 96, 4), ("RTX PRO 6000", 96, 8)]
GPU_MEMORY_UTILIZATION = 0.9
ACTIVATION_RESERVE_GIB = 6.0  # per GPU, for activations, CUDA graphs and the runtime (an assumption)


def parameter_count(cfg) -> int:
    """Parameters of the text model plus lm_head of the fixture's text config
    (vision tower and MTP heads left out), counted on the meta device."""
    import torch
    from transformers.models.glm5_next import modeling_glm5_next as m

    with torch.device("meta"):
        model = m.Glm5NextTextModel(cfg)
    return sum(p.numel() for p in model.parameters()) + cfg.vocab_size * cfg.hidden_size


def memory_plans() -> str:
    cfg = L.text_config()
    params = parameter_count(cfg)
    weights = params * 1.0  # FP8: one byte a parameter (block scales and bf16 norms ignored)
    out = [f"== memory plans (derived): {params / 1e9:.1f} B parameters, FP8 weights about "
           f"{weights / GIB:.0f} GiB; gpu_memory_utilization {GPU_MEMORY_UTILIZATION}, "
           f"{ACTIVATION_RESERVE_GIB:.0f} GiB/GPU for activations"]
    for name, gb, n in DEPLOYMENTS:
        built = L.build("native", n, num_blocks=1, cfg=cfg)
        usable = gb * 1e9 * GPU_MEMORY_UTILIZATION / GIB
        left = usable - weights / n / GIB - ACTIVATION_RESERVE_GIB
        line = f"  {n} x {name} ({gb} GB): weights {weights / n / GIB:.1f} GiB/GPU of {usable:.1f} usable -> "
        if left <= 0:
            out.append(line + f"does NOT fit ({left:.1f} GiB left)")
            continue
        line += f"{left:.1f} GiB/GPU for KV and KDA state"
        if built is not None:
            geo = L.resolve(built)
            attn_per_token = sum(g.object_bytes_per_block for g in geo.attn_groups) / built.block_size
            state = sum(g.object_bytes_per_block for g in geo.state_groups)
            line += (f": {left * GIB / attn_per_token / 1e6:.1f} M tokens of attention, or "
                     f"{left * GIB / state:.0f} KDA state slots (block {built.block_size}, "
                     f"{attn_per_token:.0f} B/token, {state / 1e6:.1f} MB/slot)")
        out.append(line)
    return "\n".join(out)


if __name__ == "__main__":
    print(report())
    print(memory_plans())
