"""Child processes that die with their parent.

``atexit`` handlers stop our servers when a script or notebook kernel exits normally, but
not when it is killed (nbclient kills a kernel whose setup cell failed; an operator's
``kill -9``): ``vllm serve`` and ``glm-cache-server`` children then run on, holding
gigabytes and ports. On Linux the kernel can deliver a signal to a child when its parent
dies (``PR_SET_PDEATHSIG``); we ask for SIGTERM, which both servers handle by shutting
down cleanly (vLLM stops its engine core processes too).

Linux delivers the signal when the *thread* that started the child exits, so start
long-lived children from a thread that lives as long as they should (the main thread in
scripts, notebooks and tests). Elsewhere this is a no-op and ``atexit`` is all there is.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Runs in the child between fork and exec."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def popen_tied(cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen`` whose child gets SIGTERM when this process dies (Linux)."""
    if sys.platform.startswith("linux"):
        parent = os.getpid()
        kwargs["preexec_fn"] = lambda: _die_with_parent(parent)
    return subprocess.Popen(cmd, **kwargs)
