"""Children we start die with us, even when we are killed (no atexit runs then)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent, init, reaps it soon).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_dead(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("tied", [True, False])
def test_a_killed_parent_takes_its_cache_server_along(tied):
    """A script holding a ServerProcess is SIGKILLed: its glm-cache-server exits too.
    The untied control (plain Popen) shows the server would otherwise run on."""
    script = textwrap.dedent(f"""
        import subprocess, sys
        from testing import server_process as process
        if not {tied}:
            process.popen_tied = subprocess.Popen  # control: what the code did before
        s = process.ServerProcess().start()
        print(s.proc.pid, flush=True)
        import time; time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        died = _wait_dead(child, 10.0)
        if not died:
            os.kill(child, signal.SIGKILL)
        assert died is tied
    finally:
        if parent.poll() is None:
            parent.kill()
