"""Generate a tiny GLM-5.3-Flash-architecture checkpoint (random weights, real names).

The ``glm5next-tiny`` command (also ``python -m glm5next_tiny``); what it writes is
described in :mod:`glm5next_tiny`.
"""

from __future__ import annotations

import argparse

from .checkpoint import write_checkpoint


def main(argv: list[str] | None = None) -> None:
    """CLI entry point (``glm5next-tiny``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="directory to write the checkpoint into")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument(
        "--layer-types",
        default="LLILI",
        help="one letter per layer: L = KDA (linear_attention), I = sparse MLA (indexed_attention)",
    )
    p.add_argument("--dense-layers", type=int, default=1, help="leading layers with a dense MLP")
    p.add_argument("--index-topk", type=int, default=128)
    p.add_argument("--index-kpool", type=int, default=4, help="tokens per indexer pool (GLM-5.3-Flash: 4)")
    p.add_argument(
        "--index-n-heads",
        type=int,
        default=16,
        help="indexer heads; with few heads (2) many pools score exactly 0 (a tie-heavy checkpoint)",
    )
    p.add_argument("--index-head-dim", type=int, default=16)
    p.add_argument(
        "--qk-rope-head-dim",
        type=int,
        default=0,
        help="rope key part per MLA head (GLM-5.3-Flash: 0); transformers' config class refuses a value above 0 on "
        "load (see glm5next_tiny.config)",
    )
    p.add_argument("--linear-num-heads", type=int, default=2)
    p.add_argument("--linear-head-dim", type=int, default=16)
    p.add_argument("--n-routed-experts", type=int, default=8)
    p.add_argument("--num-experts-per-tok", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--max-position-embeddings", type=int, default=8192)
    p.add_argument(
        "--mtp-layers",
        type=int,
        default=1,
        help="num_nextn_predict_layers: MTP layers after the target's (GLM-5.3-Flash: 1; 0 writes none)",
    )
    p.add_argument(
        "--derived-mtp",
        dest="trained_mtp",
        action="store_false",
        help="the MTP layer derived from the target (glm5next_tiny.mtp_layer.mtp_state) even where a trained one fits (seed 3, default sizes)",
    )
    args = vars(p.parse_args(argv))  # option names are write_checkpoint's keyword names
    path = write_checkpoint(args.pop("out_dir"), **args)
    print(f"wrote {path}")
