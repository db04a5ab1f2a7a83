"""Per layout and TP size: vLLM's unified block, the cached groups, per-layer pages, and
per-rank bytes per 1152-token chunk (attention) and per state snapshot (KDA), computed
from the KV cache config vLLM builds for GLM-5.3-Flash (validation/glm_flash_kv_layouts.py).

    /work/main/.venv/bin/python validation/geometry_report.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from validation import glm_flash_kv_layouts as L  # noqa: E402


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
                    out.append(f"  group {gid}: {len(grp.layer_names)} layers, "
                               f"{type(grp.kv_cache_spec).__name__}: not prefix-cacheable, skipped")
            for g in geo.groups:
                kinds: dict[tuple[int, str, int], int] = {}
                for p in g.layers:
                    key = (p.page_bytes, p.dtype, p.states_per_page)
                    kinds[key] = kinds.get(key, 0) + 1
                desc = ", ".join(f"{n} x {pb} B ({dt}, {st} rows/block)" for (pb, dt, st), n in kinds.items())
                kind = "KDA state" if g.is_state else "attention"
                out.append(f"  group {g.group_id} ({kind}, replicated_across_tp={g.replicated_across_tp}): "
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


if __name__ == "__main__":
    print(report())
