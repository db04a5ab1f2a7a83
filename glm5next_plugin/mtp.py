"""GLM-5.3-Flash's multi-token-prediction (MTP) layer as a vLLM draft model, in plain PyTorch.

The checkpoint carries ``num_nextn_predict_layers`` (1 in GLM-5.3-Flash) extra layers after
the ``num_hidden_layers`` target layers, under the target's names
(``model.language_model.layers.{N}.*``, flat checkpoints ``model.layers.{N}.*``, ``N =
num_hidden_layers``). With ``--speculative-config '{"method":"mtp",...}'`` vLLM builds the
draft from the target's own checkpoint: the config rewrite (:func:`hf_config_override`)
names architecture ``Glm5NextMTPModel``, which the plugin registers as
:class:`Glm5NextMTPModel`.

One MTP layer proposes the token after next. For the token at position ``p`` with the
target's final hidden state ``h`` (after the target's final norm; vLLM passes it as
``hidden_states``) and the embedding ``e`` of the token at ``p + 1`` (vLLM shifts the ids)::

    e = 0 at position 0                      (as vLLM's native MTP does)
    x = eh_proj([enorm(e) | hnorm(h)])
    r = x + self_attn(input_layernorm(x))    (sparse MLA with its own latent + indexer rows)
    y = shared_head.norm(r + mlp(post_attention_layernorm(r)))
    logits = lm_head(y)                      (the target's lm_head)

A plain pre-norm residual block: no mHC streams. ``y`` is also the hidden state the next
draft step starts from (vLLM feeds it back as ``hidden_states``), so the forward returns it
twice, as vLLM 0.32 expects of ``Glm5NextMTPModel`` (``model_returns_tuple``). The MLP is
the type of the target's last layer (``mlp_layer_types[-1]``: MoE in GLM-5.3-Flash), as
vLLM's native layer chooses for an index past ``mlp_layer_types``.

The attention layer is :class:`glm5next_plugin.mla_layer.SparseMLALayer`, so its cache rows
have the target's sparse-MLA row format and size and vLLM puts them in the same KV cache
group as the target's MLA layers. The draft owns no embedding and no head: vLLM's proposer
gives it the target's (``model.embed_tokens`` and ``lm_head``, set in its ``load_model``),
so the checkpoint's single copies serve both. Copies an MTP layer may carry
(``layers.{N}.embed_tokens``, ``layers.{N}.shared_head.head``, as DeepSeek-style checkpoints
do) are skipped on load for that reason.

Index sharing across draft steps (``index_share_for_mtp_iteration``, vLLM native's
optimization) is not implemented: every draft step selects its own pools. That changes
drafts at most, never what the target accepts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .blocks import MLP, MoE, RMSNorm
from .mla_layer import SparseMLALayer, SparseMLAProjections
from .model import check_supported, check_tp_divides
from .tp import TP1, TPInfo, tp_info
from .weight_loading import cast_for_inference, load_by_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.glm5next_plugin.mtp")

MTP_ARCHITECTURE = "Glm5NextMTPModel"
# vLLM's name for the draft config of GLM-5.3-Flash (one of its MTPModelTypes, which is what
# makes vLLM accept method "mtp" for it).
MTP_MODEL_TYPE = "glm5_next_mtp"
# The flat text-only model type, which vLLM 0.32's rewrite does not map (it maps glm5_next).
FLAT_MODEL_TYPE = "glm5_next_text"


def num_mtp_layers(config: PretrainedConfig) -> int:
    """``num_nextn_predict_layers`` of a text config (0 where the field is absent)."""
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


def mtp_mlp_is_moe(config: PretrainedConfig) -> bool:
    """Whether the MTP layers' MLP is an MoE: the type of the target's last layer, as vLLM's
    native MTP reads ``mlp_layer_types`` for an index past its end."""
    types = list(getattr(config, "mlp_layer_types", None) or [])
    kind = types[-1] if types else "sparse"
    return kind == "sparse" and getattr(config, "n_routed_experts", None) is not None


class SharedHead(nn.Module):
    """``shared_head.norm``: the MTP layer's final norm. The head itself is the target's
    ``lm_head`` (the checkpoint stores no second copy here)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(nn.Module):
    """One MTP layer (module names as in the checkpoint under ``layers.{N}.``).

    With ``vllm_config`` the attention keeps its rows in vLLM's paged cache
    (:class:`SparseMLALayer` registered under ``{prefix}.self_attn``); without it, one whole
    fresh sequence per call (tests and tools)."""

    def __init__(self, config: PretrainedConfig, vllm_config: VllmConfig | None = None, prefix: str = "", tp: TPInfo = TP1) -> None:
        super().__init__()
        self.tp = tp
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = (
            SparseMLALayer(config, vllm_config, f"{prefix}.self_attn", tp)
            if vllm_config is not None
            else SparseMLAProjections(config, tp)
        )
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        if mtp_mlp_is_moe(config):
            self.mlp = MoE(config, tp)
        else:
            self.mlp = MLP(hidden, config.intermediate_size, config.swiglu_limit, tp)
        self.shared_head = SharedHead(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``embeds``: embeddings of the tokens one ahead ``[T, H]``; ``hidden``: the target's
        (or the previous draft step's) final hidden states at ``positions`` ``[T, H]``.
        Returns the normed hidden state the head reads ``[T, H]``."""
        # vLLM's native MTP (like DeepSeek's) zeroes the embedding read at position 0; so do
        # we, for the same drafts (enorm(0) = 0)
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))], dim=-1))
        # under TP both blocks return this rank's partial sum (row-parallel outputs)
        x = x + self.tp.all_reduce(self.self_attn(self.input_layernorm(x)))
        x = x + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))
        return self.shared_head.norm(x)


class MultiTokenPredictor(nn.Module):
    """The MTP layers ``layers.{N}`` .. ``layers.{N + n - 1}`` (``N = num_hidden_layers``),
    keyed by their checkpoint index. Draft step ``k`` runs layer ``k mod n``.

    ``embed_tokens`` is not built here: the vLLM draft gets the target's module from vLLM's
    proposer, :func:`load_standalone_mtp` sets the one it is given."""

    def __init__(self, config: PretrainedConfig, vllm_config: VllmConfig | None = None, prefix: str = "model", tp: TPInfo = TP1) -> None:
        super().__init__()
        n = num_mtp_layers(config)
        if n < 1:
            raise ValueError(
                "glm5next plugin: this checkpoint has no MTP layer (num_nextn_predict_layers is 0 or absent); "
                "speculative method 'mtp' needs one"
            )
        self.start = config.num_hidden_layers
        self.layers = nn.ModuleDict(
            {
                str(i): MTPLayer(config, vllm_config, f"{prefix}.layers.{i}", tp)
                for i in range(self.start, self.start + n)
            }
        )
        self._by_step = list(self.layers.values())

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, step: int = 0
    ) -> torch.Tensor:
        return self._by_step[step % len(self._by_step)](embeds, hidden, positions)


def mtp_weights(
    weights: Iterable[tuple[str, torch.Tensor]], start: int, n: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The MTP layers' tensors of a whole checkpoint, renamed to :class:`Glm5NextMTPModel`'s
    parameters: ``model.language_model.layers.{i}.X`` (nested) or ``model.layers.{i}.X``
    (flat) -> ``model.layers.{i}.X`` for ``start <= i < start + n``. The target's tensors and
    the MTP layers' copies of the shared embedding and head are left out."""
    nested, flat = "model.language_model.layers.", "model.layers."
    for name, tensor in weights:
        if name.startswith(nested):
            rest = name[len(nested) :]
        elif name.startswith(flat):
            rest = name[len(flat) :]
        else:
            continue
        idx, _, leaf = rest.partition(".")
        if not idx.isdigit() or not start <= int(idx) < start + n:
            continue
        if leaf.startswith(("embed_tokens.", "shared_head.head.")):
            continue  # the target's embedding and lm_head serve the draft
        yield f"{flat}{rest}", tensor


class Glm5NextMTPModel(nn.Module):
    """vLLM draft class for ``--speculative-config '{"method":"mtp",...}'`` on GLM-5.3-Flash.

    vLLM builds it with the target's ``vllm_config``; its own config is
    ``vllm_config.speculative_config.draft_model_config.hf_text_config``. After loading,
    vLLM's proposer sets ``model.embed_tokens`` and ``lm_head`` to the target's modules."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        draft = vllm_config.speculative_config.draft_model_config
        self.config = draft.hf_text_config
        check_supported(draft.hf_config)
        check_tp_divides(self.config, vllm_config.parallel_config.tensor_parallel_size)
        self.tp = tp_info(vllm_config)
        self.model = MultiTokenPredictor(
            self.config, vllm_config, f"{prefix}.model" if prefix else "model", self.tp
        )
        cast_for_inference(self, vllm_config.model_config.dtype)
        logger.info(
            "glm5next plugin: MTP draft (PyTorch), layers %s, %s MLP, tensor parallel rank %d of %d",
            list(self.model.layers.keys()),
            "MoE" if mtp_mlp_is_moe(self.config) else "dense",
            self.tp.rank,
            self.tp.size,
        )

    def _shared(self, name: str, owner: nn.Module) -> nn.Module:
        module = getattr(owner, name, None)
        if module is None:
            raise RuntimeError(
                f"glm5next plugin: the MTP draft has no {name}; it uses the target's, which vLLM's "
                "speculative proposer sets in load_model"
            )
        return module

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._shared("embed_tokens", self.model)(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        intermediate_tensors: object = None,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden for the logits, hidden for the next draft step): the same tensor."""
        embeds = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        out = self.model(embeds, hidden_states, positions, spec_step_idx)
        return out, out

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        return self._shared("lm_head", self)(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the MTP layers' tensors out of the whole checkpoint (nested or flat names);
        a missing or unexpected MTP tensor raises with its name."""
        n = len(self.model.layers)
        return load_by_name(
            self,
            mtp_weights(weights, self.model.start, n),
            self.model.start + n,
            self.config.n_routed_experts if mtp_mlp_is_moe(self.config) else 0,
        )


# --- the draft config ---------------------------------------------------------------------
_vllm_hf_config_override = None


def hf_config_override(hf_config: PretrainedConfig, *args: Any, **kwargs: Any) -> PretrainedConfig:
    """vLLM's draft-config rewrite, extended to flat text-only checkpoints.

    vLLM 0.32 maps model type ``glm5_next`` to ``glm5_next_mtp`` / ``Glm5NextMTPModel`` but
    leaves ``glm5_next_text`` (``Glm5NextForCausalLM``) alone, so method ``mtp`` fails on a
    flat checkpoint. This maps it the same way (``n_predict`` from
    ``num_nextn_predict_layers``) and hands every other config, and any further arguments
    (vLLM 0.33's ``transformers_mtp_overrides``, for its Transformers backend), to vLLM's
    rewrite unchanged. A module-level function: vLLM pickles the draft config's overrides to
    its engine process.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type in ("glm5_next", FLAT_MODEL_TYPE):
        text = getattr(hf_config, "text_config", None) or hf_config
        if num_mtp_layers(text) == 0:
            raise ValueError(
                "glm5next plugin: --speculative-config method 'mtp' drafts with the checkpoint's MTP layer, and this "
                "checkpoint has none (num_nextn_predict_layers is 0 or absent); use method 'ngram', or regenerate a "
                "tiny checkpoint (glm5next-tiny writes one MTP layer)")
    plain = not args and kwargs.get("transformers_mtp_overrides") is None
    if plain and model_type == FLAT_MODEL_TYPE:
        hf_config.model_type = MTP_MODEL_TYPE
        hf_config.update(
            {
                "n_predict": num_mtp_layers(hf_config),
                "architectures": [MTP_ARCHITECTURE],
                "index_share_for_mtp_iteration": getattr(hf_config, "index_share_for_mtp_iteration", False),
            }
        )
        return hf_config
    return _vllm_override()(hf_config, *args, **kwargs)


def _vllm_override() -> Callable[..., PretrainedConfig]:
    """vLLM's own ``SpeculativeConfig.hf_config_override`` (saved when ours was installed;
    in a process where it never was, the class still holds vLLM's)."""
    if _vllm_hf_config_override is not None:
        return _vllm_hf_config_override
    from vllm.config.speculative import SpeculativeConfig

    return SpeculativeConfig.hf_config_override


def install_config_override() -> None:
    """Make vLLM's draft-config rewrite :func:`hf_config_override` (idempotent). vLLM looks
    the static method up on the class each time it builds a draft config."""
    global _vllm_hf_config_override
    from vllm.config.speculative import SpeculativeConfig

    current = SpeculativeConfig.hf_config_override
    if current is hf_config_override:
        return
    _vllm_hf_config_override = current
    SpeculativeConfig.hf_config_override = staticmethod(hf_config_override)


def load_standalone_mtp(ckpt: str | Path, text_config: PretrainedConfig | None = None,
                        embed_tokens: nn.Module | None = None) -> MultiTokenPredictor:
    """The MTP layers of checkpoint directory ``ckpt`` without vLLM (tests and tools), in
    eval mode; ``embed_tokens`` is the target's embedding (e.g. a
    :class:`glm5next_plugin.standalone.StandaloneLM`'s)."""
    from pathlib import Path

    from safetensors.torch import load_file

    if text_config is None:
        from transformers import AutoConfig

        text_config = AutoConfig.from_pretrained(ckpt).text_config
    mtp = MultiTokenPredictor(text_config)
    n = len(mtp.layers)
    weights = load_file(str(Path(ckpt) / "model.safetensors")).items()
    own = ((name[len("model.") :], t) for name, t in mtp_weights(weights, mtp.start, n))
    load_by_name(mtp, own, mtp.start + n, text_config.n_routed_experts if mtp_mlp_is_moe(text_config) else 0)
    if embed_tokens is not None:  # after loading: it is the target's, not one of the MTP tensors
        mtp.embed_tokens = embed_tokens
    return mtp.eval()
