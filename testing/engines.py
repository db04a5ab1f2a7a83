"""vLLM engines with GlmCacheConnector, as the end-to-end tests start them."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The connector's timeout_s where a test sets none: generous (the connector's own default is
# 2 s), as most engine tests check hits, which a loaded 2-core machine must not turn into
# cold runs by answering a lookup or a load late. Twice the longest stall of the whole
# machine measured here (30.4 s, testing/stalls.py): a request in flight across one is still
# answered in time. Tests of a deadline set their own, and pause the server (SIGSTOP).
TIMEOUT_S = 60.0


def connector_engine(model: str | Path, server_url: str, *, dtype: str = "bfloat16",
                     connector: dict[str, Any] | None = None, **engine_args: Any) -> Any:
    """A CPU ``vllm.LLM`` with prefix caching and the connector. ``connector`` goes into
    ``kv_connector_extra_config`` (``timeout_s``, ``retry_after_s``, ...; ``timeout_s`` is
    :data:`TIMEOUT_S` unless given); other keyword arguments go to ``vllm.LLM``."""
    from vllm import LLM

    return LLM(
        model=str(model),
        dtype=dtype,
        enable_prefix_caching=True,
        gpu_memory_utilization=0.15,
        max_model_len=4096,
        enforce_eager=True,
        kv_transfer_config={
            "kv_connector": "GlmCacheConnector",
            "kv_connector_module_path": "connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"server": server_url, "timeout_s": TIMEOUT_S, **(connector or {})},
        },
        **engine_args,
    )


def random_prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids the tiny checkpoint's vocabulary holds, reproducible by ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(16, 512) for _ in range(n)]


def tiny_glm_engine(tmp_path_factory: Any, server_url: str, chunk: int, **engine_args: Any) -> Any:
    """The tiny GLM-5.3-Flash (seed 3), float32, with the connector on ``server_url``, a
    prefill step and a retained state every ``chunk`` tokens (one state per chunk)."""
    import glm5next_tiny

    ckpt = tmp_path_factory.mktemp("tiny_glm")
    glm5next_tiny.main([str(ckpt), "--seed", "3"])
    return connector_engine(ckpt, server_url, dtype="float32", max_num_batched_tokens=chunk,
                            prefix_cache_retention_interval=chunk, seed=0, **engine_args)


def generate_one(llm: Any, prompt: list[int], salt: str, max_tokens: int) -> tuple[list[int], float, int]:
    """Greedy continuation of one prompt: (tokens, log-prob of the first, cached tokens)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    (o,) = llm.generate([TokensPrompt(prompt_token_ids=prompt, cache_salt=salt)], params,
                        use_tqdm=False)
    c = o.outputs[0]
    return list(c.token_ids), c.logprobs[0][c.token_ids[0]].logprob, o.num_cached_tokens or 0


def assert_boundary_reloads_equal_cold(llm: Any, run: Callable[..., tuple], prompt: Callable[[int, int], list[int]],
                                       chunk: int, k: int, seed: int, salt: str) -> None:
    """The paper's boundary sweep at one k: prompts of k*C-1, k*C and k*C+1 tokens, each
    computed cold (a fresh salt), then, after vLLM's local cache is reset, reloaded from
    the server at the strict prefix ``C * floor((n-1)/C)``, with the same continuation.
    ``run(llm, prompt, salt)`` returns (tokens, log-prob(s), cached tokens)."""
    for i, n in enumerate([k * chunk - 1, k * chunk, k * chunk + 1]):
        ids = prompt(n, seed + i)
        cold = run(llm, ids, f"{salt}-{n}")
        llm.reset_prefix_cache()
        reloaded = run(llm, ids, f"{salt}-{n}")
        assert cold[2] == 0
        assert reloaded[2] == chunk * ((n - 1) // chunk), f"length {n}"
        assert reloaded[0] == cold[0], f"length {n}: continuation differs from cold"
        assert reloaded[1] == cold[1], f"length {n}"


class CacheGroupProbe:
    """A vLLM worker extension (``worker_extension_cls="testing.engines.CacheGroupProbe"``) that
    tells a test, through ``LLM.collective_rpc``, what each of vLLM's KV cache groups
    holds: the connector stores a group's objects under its index."""

    def kv_cache_group_kinds(self) -> list[str]:
        """``"state"`` (recurrent state, vLLM's ``MambaSpec``) or ``"attention"`` per group."""
        from vllm.v1.kv_cache_interface import MambaSpec

        groups = self.model_runner.kv_cache_config.kv_cache_groups  # type: ignore[attr-defined]
        return ["state" if isinstance(g.kv_cache_spec, MambaSpec) else "attention" for g in groups]


# vLLM's engine client waits 5 s for the engine core to exit after SIGTERM and then kills it;
# on CPU the core never exits sooner (it waits on its worker process, which does not exit on
# its own), so every stop cost 5 s. The core's own teardown (abort, leave its loop) takes
# well under a second; tests that need what an engine saved wait for it before stopping.
STOP_GRACE_S = 1.0


def stop_engine(llm: Any) -> None:
    """Stop an in-process ``vllm.LLM``'s engine core and worker (idempotent)."""
    llm.llm_engine.engine_core.shutdown(timeout=STOP_GRACE_S)
