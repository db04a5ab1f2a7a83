"""The README's demo command runs end to end: checkpoint, server, vllm serve, chat, reload."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def test_demo_reloads_every_turn_and_matches_cold(tmp_path):
    r = subprocess.run([sys.executable, "-m", "validation.demo", "--checkpoint", str(tmp_path / "ckpt"),
                        "--turns", "2", "--sentences", "80"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Negotiated chunk size to 128" in r.stdout and "Resolved geometry:" in r.stdout
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+) \|.*\|\s+(True|False)$", r.stdout, re.M)
    assert len(rows) == 2
    for _turn, prompt, hit, match in rows:
        assert 0 < int(hit) <= 128 * ((int(prompt) - 1) // 128) and match == "True"
    assert "outputs reloaded from the cache equal cold outputs: True" in r.stdout
