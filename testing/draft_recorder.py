"""A vLLM scheduler that writes down the draft tokens it schedules, for tests and benchmarks
that compare speculative decoding across runs (resumed vs cold).

vLLM reports acceptance only as engine-wide counters; the draft token ids themselves never
leave the engine. The scheduler sees them: every step's ``scheduled_spec_decode_tokens``
maps a request to the drafts it verifies this step. ``DraftRecorder`` is vLLM's own
scheduler plus one JSON line per decoding request and step (drafts or none), appended to
the file named by ``additional_config["draft_log"]``::

    {"prompt_len": 255, "salt": "cold-255", "computed": 256, "drafts": [17, 402]}

Use it through vLLM's ``scheduler_cls`` engine argument
(``scheduler_cls="testing.draft_recorder.DraftRecorder"``, with
``additional_config={"draft_log": path}``). vLLM's CPU platform turns async scheduling
off, so the synchronous ``Scheduler`` is the one to extend there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler


class DraftRecorder(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self.vllm_config.additional_config or {}
        self._log = Path(extra["draft_log"]) if extra.get("draft_log") else None

    def schedule(self, *args: Any, **kwargs: Any):
        out = super().schedule(*args, **kwargs)
        if self._log is None:
            return out
        lines = []
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            computed = req.num_computed_tokens - n  # schedule() has already advanced it by n
            drafts = list(out.scheduled_spec_decode_tokens.get(req_id, ()))
            if computed + n - len(drafts) <= req.num_prompt_tokens - 1 and not drafts:
                continue  # a prompt chunk before the last prompt token: nothing drafted or sampled
            lines.append(json.dumps({"prompt_len": req.num_prompt_tokens, "salt": req.cache_salt,
                                     "computed": computed, "drafts": drafts}) + "\n")
        if lines:
            with self._log.open("a") as f:
                f.writelines(lines)
        return out


def read_drafts(path: str | Path, salt: str, after: int = 0) -> list[tuple[int, list[int]]]:
    """The (computed tokens, draft ids) of every step of the request(s) with ``salt``, from
    line ``after`` of the log on (:func:`log_lines` before a request: only its steps)."""
    p = Path(path)
    if not p.exists():
        return []
    rows = [json.loads(line) for line in p.read_text().splitlines()[after:] if line]
    return [(r["computed"], r["drafts"]) for r in rows if r["salt"] == salt]


def log_lines(path: str | Path) -> int:
    p = Path(path)
    return len(p.read_text().splitlines()) if p.exists() else 0
