"""testing.stalls.StallWatch: a wake-up later than the stall bound is one stall of the CPU
its thread is pinned to, with its start and length; on-time wake-ups are none; a watcher
that is late now names its CPU as standing still."""

from __future__ import annotations

import os
import time
from pathlib import Path

from testing.stalls import StallWatch


def _watch(ticks: list[float], cpu: int | None = None) -> StallWatch:
    clock = iter(ticks)
    watch: StallWatch

    def sleep(_s: float) -> None:  # the last tick read, the loop ends
        sleep.calls += 1
        if sleep.calls == len(ticks) - 1:
            watch._stop.set()

    sleep.calls = 0
    watch = StallWatch(stall_s=5.0, cpus=[cpu], clock=lambda: next(clock), sleep=sleep, wall=lambda: 1000.0)
    watch.run(cpu)
    return watch


def test_a_late_wake_up_is_one_stall_with_its_start_and_length():
    watch = _watch([0.0, 0.1, 0.2, 30.2, 30.3, 30.4])
    assert watch.stalls == [(None, 1000.0 - 30.0, 30.0)]
    assert watch.describe(watch.stalls) == "the machine: 00:16:10 UTC for 30.0 s"


def test_wake_ups_within_the_bound_are_no_stall():
    watch = _watch([0.0, 0.1, 4.9, 5.0, 9.9])
    assert watch.stalls == [] and watch.describe(watch.stalls) == "none"


def test_stalls_are_told_per_cpu():
    stalls = [(1, 0.0, 240.0), (0, 60.0, 30.0), (1, 600.0, 6.0)]
    assert StallWatch.describe(stalls) == ("cpu 0: 00:01:00 UTC for 30.0 s; "
                                           "cpu 1: 00:00:00 UTC for 240.0 s, 00:10:00 UTC for 6.0 s")


def test_a_cpu_whose_watcher_is_late_now_stands_still():
    now = [100.0]
    watch = StallWatch(stall_s=5.0, cpus=[0, 1], clock=lambda: now[0])
    watch._beats = {0: 99.9, 1: 90.0}  # cpu 1's watcher last ran 10 s ago
    assert watch.standing_still() == [1]
    watch._beats[1] = 99.95
    assert watch.standing_still() == []


def test_each_cpu_has_a_watcher_pinned_to_it():
    cpus = sorted(os.sched_getaffinity(0))
    watch = StallWatch(interval_s=0.01).start()
    try:
        deadline = time.monotonic() + 60
        while len(watch._beats) < len(cpus):
            assert time.monotonic() < deadline, watch._beats
            time.sleep(0.01)
        pinned = {}
        for t in watch._threads:
            status = Path(f"/proc/self/task/{t.native_id}/status").read_text()
            pinned[t.name] = next(line.split(":")[1].strip() for line in status.splitlines()
                                  if line.startswith("Cpus_allowed_list"))
        assert pinned == {f"stall-watch-{c}": str(c) for c in cpus}
        assert watch.standing_still() == []
    finally:
        watch.stop()
    assert not any(t.is_alive() for t in watch._threads)


def test_the_soak_does_not_count_a_cpu_standing_still_against_its_last_wait(monkeypatch):
    """validation.soak.Soak.join_clients: while a CPU stands still, a replica's request in
    flight cannot be answered, so that time is not counted against CLIENT_JOIN_S."""
    import threading
    import types

    from validation import soak

    answered = threading.Event()

    class Watch:
        calls = 0

        def standing_still(self):  # cpu 1 stands still for the first four turns of the wait
            Watch.calls += 1
            if Watch.calls < 5:
                return [1]
            answered.set()
            return []

    monkeypatch.setattr(soak, "CLIENT_JOIN_S", 2.5)  # less than the four turns the CPU stood still
    s = soak.Soak.__new__(soak.Soak)
    request = types.SimpleNamespace(name="pd0", replica="replica1", sent_s=0.0)
    s.stall_watch, s._lock, s._in_flight, s.t0 = Watch(), threading.Lock(), {1: request}, 0.0
    client = threading.Thread(target=lambda: answered.wait(120), daemon=True)
    client.start()
    assert s.join_clients([client]) == []
    assert Watch.calls >= 5 and not client.is_alive()


def test_the_soak_reads_a_late_replica_again_and_never_sums_a_partial_read(monkeypatch):
    """validation.soak: a replica's ``/metrics`` that does not answer at first (its API server
    waits for a CPU that stands still) is read again; one that never answers makes the
    figures unknown (None), never a sum without it (CI at b029576: a fault window's lookups
    read -75 sent and one lookup "lost")."""
    import http.server
    import threading
    import types

    from validation import soak

    failures = {"flaky": 2, "dead": 10**9}

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            name = self.path.split("/")[1]
            if failures[name] > 0:
                failures[name] -= 1
                self.send_error(503)
                return
            body = b"vllm:glm_cache_lookups_sent_total 7.0\nvllm:glm_cache_lookups_unanswered_total 1.0\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"

        def replica(name):
            return soak.Replica(name, types.SimpleNamespace(base_url=f"{url}/{name}", proc=None))

        flaky, dead = replica("flaky"), replica("dead")
        got = flaky.counters()
        assert got is not None and got["sent"] == 7.0 and got["unanswered"] == 1.0 and failures["flaky"] == 0
        monkeypatch.setattr(soak, "COUNTERS_READ_S", 1.5)
        assert dead.counters() is None
        s = soak.Soak.__new__(soak.Soak)
        s.replicas, s.server, s.log = [replica("flaky"), dead], types.SimpleNamespace(late=lambda: None), print
        assert s.counters()["replicas"] == {k: None for k in soak.REPLICA_COUNTERS}
        s.replicas = [replica("flaky")]
        assert s.counters()["replicas"]["sent"] == 7.0
    finally:
        httpd.shutdown()
