"""testing.stalls.StallWatch: a wake-up later than the stall bound is one stall, with its
start and length; on-time wake-ups are none."""

from __future__ import annotations

from testing.stalls import StallWatch


def _watch(ticks: list[float]) -> StallWatch:
    clock = iter(ticks)
    watch: StallWatch

    def sleep(_s: float) -> None:  # the last tick read, the loop ends
        sleep.calls += 1
        if sleep.calls == len(ticks) - 1:
            watch._stop.set()

    sleep.calls = 0
    watch = StallWatch(stall_s=5.0, clock=lambda: next(clock), sleep=sleep, wall=lambda: 1000.0)
    watch.run()
    return watch


def test_a_late_wake_up_is_one_stall_with_its_start_and_length():
    watch = _watch([0.0, 0.1, 0.2, 30.2, 30.3, 30.4])
    assert watch.stalls == [(1000.0 - 30.0, 30.0)]
    assert "for 30.0 s" in watch.describe(watch.stalls)


def test_wake_ups_within_the_bound_are_no_stall():
    watch = _watch([0.0, 0.1, 4.9, 5.0, 9.9])
    assert watch.stalls == [] and watch.describe(watch.stalls) == "none"
