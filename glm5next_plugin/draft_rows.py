"""Exact draft rows on vLLM's default (padded) drafter batch.

An MTP (or EAGLE) draft layer's cache row at position ``p`` is computed from the target's
hidden state at ``p`` and the token at ``p + 1``: vLLM's drafter shifts the step's tokens
left by one and puts "the next token" at each request's last position. For a request whose
prompt is still being prefilled (its sample is discarded), the next token is a prompt
token. vLLM 0.32/0.33's non-padded path takes it (``prepare_next_token_ids_cpu``:
``get_token_id(num_computed + num_scheduled)``), but its padded path, the default, takes
the request's last known token (``prepare_next_token_ids_padded``: ``get_token_id(
num_tokens_no_spec - 1)``, the prompt's last token). So on the default batch the draft row
at the end of every partial prefill step is computed from the wrong token: it depends on
how the prompt ends and on where its prefill steps ended, not only on the prefix, in
vLLM's own prefix cache as much as in any external one (the draft proposed there is
discarded; only the row stays, and later drafts attend to it).

:func:`install` gives the padded path the same next token as the non-padded one, for the
GLM-5.3-Flash architectures only: the drafter learns each step's scheduled token counts
from the model runner's ``execute_model`` and, for a partial prefill, answers the prompt
token after the step where vLLM asks for the backup token. Nothing else of the padded path
changes (the backup is read on the host, as before, and only for requests whose sample is
discarded), so async scheduling stays on. Every draft row then equals the row a one-shot
prefill computes, which is what lets the connector cache MTP on vLLM's defaults
(:func:`exact_rows`). SGLang fixed the same defect in its EAGLE worker
(sgl-project/sglang#26329).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("vllm.glm5next_plugin")

_FLAG = "glm5next_exact_draft_rows"
_SCHEDULED = "_glm5next_num_scheduled"
ARCHITECTURES = ("Glm5NextForConditionalGeneration", "Glm5NextForCausalLM")


class _NextToken:
    """A request as the padded path reads it, answering the prompt token after this step as
    its backup token."""

    def __init__(self, request: Any, token: int) -> None:
        self._request = request
        self._token = token

    def get_token_id(self, idx: int) -> int:
        return self._token

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class _PartialPrefills(Mapping):
    """vLLM's request states, with each partial prefill's backup token the next prompt token."""

    def __init__(self, requests: Mapping[str, Any], batch: Any, scheduled: Mapping[str, int]) -> None:
        self._requests = requests
        self._fixed: dict[str, _NextToken] = {}
        for i in range(int(batch.num_reqs)):
            req_id = batch.req_ids[i]
            n = scheduled.get(req_id)
            if n is None or req_id not in requests:
                continue
            end = int(batch.num_computed_tokens_cpu[i]) + int(n)
            if end < int(batch.num_tokens_no_spec[i]):  # its sample is discarded: a prompt token is next
                state = requests[req_id]
                self._fixed[req_id] = _NextToken(state, state.get_token_id(end))

    def __getitem__(self, req_id: str) -> Any:
        fixed = self._fixed.get(req_id)
        return fixed if fixed is not None else self._requests[req_id]

    def __iter__(self):
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)


def _serves_glm(vllm_config: Any) -> bool:
    archs = getattr(getattr(getattr(vllm_config, "model_config", None), "hf_config", None), "architectures", None)
    return bool(set(archs or ()) & set(ARCHITECTURES))


def install() -> bool:
    """Patch vLLM's padded drafter path (idempotent); False where this vLLM has no such path
    (then :func:`exact_rows` is False and the connector keeps refusing the padded batch)."""
    proposer, runner = _classes()
    if proposer is None or runner is None:
        return False
    prepare = getattr(proposer, "prepare_next_token_ids_padded", None)
    execute = getattr(runner, "execute_model", None)
    if prepare is None or execute is None:
        return False
    if getattr(prepare, _FLAG, False):
        return True

    def prepare_next_token_ids_padded(self: Any, sampled_token_ids: Any, requests: Any, gpu_input_batch: Any, *args: Any,
                                      **kwargs: Any) -> Any:
        scheduled = getattr(self, _SCHEDULED, None)
        if scheduled is not None and _serves_glm(self.vllm_config):
            requests = _PartialPrefills(requests, gpu_input_batch, scheduled)
        return prepare(self, sampled_token_ids, requests, gpu_input_batch, *args, **kwargs)

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        drafter = getattr(self, "drafter", None)
        if drafter is not None:
            setattr(drafter, _SCHEDULED, scheduler_output.num_scheduled_tokens)
        return execute(self, scheduler_output, *args, **kwargs)

    setattr(prepare_next_token_ids_padded, _FLAG, True)
    setattr(execute_model, _FLAG, True)
    prepare_next_token_ids_padded.__wrapped__ = prepare  # type: ignore[attr-defined]
    execute_model.__wrapped__ = execute  # type: ignore[attr-defined]
    proposer.prepare_next_token_ids_padded = prepare_next_token_ids_padded
    runner.execute_model = execute_model
    return True


def exact_rows(vllm_config: Any) -> bool:
    """Whether this engine's draft rows at partial prefill ends come from the next prompt
    token on vLLM's padded drafter batch too: GLM-5.3-Flash with this process's vLLM patched
    (vLLM loads the plugin in every process it starts, so its workers are patched alike)."""
    if not _serves_glm(vllm_config):
        return False
    proposer, runner = _classes()
    return bool(proposer is not None and runner is not None
                and getattr(proposer.prepare_next_token_ids_padded, _FLAG, False)
                and getattr(runner.execute_model, _FLAG, False))


def _classes() -> tuple[Any, Any]:
    """vLLM's drafter base class (whose padded path every EAGLE/MTP proposer inherits) and
    its model runner; None where this vLLM has another shape."""
    try:
        from vllm.v1.spec_decode import llm_base_proposer
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return None, None
    proposer = getattr(llm_base_proposer, "SpecDecodeBaseProposer", None)
    return proposer, GPUModelRunner
