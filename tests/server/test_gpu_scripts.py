"""The GPU device-check scripts run here on the CPU (their fallback), so that a session lent a
GPU finds them working: the layouts export, and the arena reload check, which must land
every object in the arena, write the pages byte-exact and say why nothing was page-locked."""

from __future__ import annotations

import json

from validation import gpu_arena_check, gpu_pages_check


def test_arena_check_runs_on_the_cpu_and_lands_every_page_exactly(tmp_path, capsys):
    layouts = tmp_path / "layouts.json"
    gpu_pages_check.export(layouts, tp=4, num_blocks=3)
    assert gpu_arena_check.main([str(layouts), "--chunks", "3", "--reps", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["exact"] is True and out["chunks"] == 3
    # every object was stored in, and read from, the server's arena (none by copy)
    assert out["arena"]["used_bytes"] == out["bytes"] and out["arena"]["full_total"] == 0
    assert out["arena"]["granted_total"] >= 2  # pinned reads: the first reload and the timed one
    assert out["locked_gbps"] is None and out["not_locked_because"] == "no CUDA device (CPU run)"
    assert out["pageable_gbps"] > 0 and out["pinned_h2d_gbps"] > 0
