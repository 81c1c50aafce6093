"""A conversion's progress as the user sees it: the time left in each message, and the CLI's bar."""

from __future__ import annotations

import io

from engine.system.progress import TextProgress, duration_text, with_time_left


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_messages_say_the_time_left_once_an_estimate_means_something():
    clock, seen = Clock(), []
    report = with_time_left(lambda f, m: seen.append(m), clock)
    report(0.0, "converting experts to Q4_K: MoE layer 0 of 16")
    clock.now += 30
    report(0.25, "converting experts to Q4_K: MoE layer 4 of 16")  # a quarter in 30 s: 90 s to go
    clock.now += 30
    report(0.5, "converting experts to Q4_K: MoE layer 8 of 16")
    clock.now += 60
    report(1.0, "converting experts to Q4_K: MoE layer 16 of 16")
    assert seen == ["converting experts to Q4_K: MoE layer 0 of 16",
                    "converting experts to Q4_K: MoE layer 4 of 16, about 1 min 30 s left",
                    "converting experts to Q4_K: MoE layer 8 of 16, about 1 min left",
                    "converting experts to Q4_K: MoE layer 16 of 16"]


def test_a_new_step_starts_its_own_estimate():
    clock, seen = Clock(), []
    report = with_time_left(lambda f, m: seen.append(m), clock)
    report(0.0, "experts")
    clock.now += 100
    report(0.9, "experts")
    report(0.1, "dense weights")  # lower than before: a new step, whose clock starts now
    clock.now += 10
    report(0.5, "dense weights")
    assert seen[-2:] == ["dense weights", "dense weights, about 10 s left"]


def test_durations_read_like_a_countdown():
    assert [duration_text(s) for s in (4.4, 59, 61, 125, 3600, 5000)] == \
        ["4 s", "59 s", "1 min", "2 min", "1 h", "1 h 23 min"]


def test_a_log_gets_a_line_a_tenth_and_a_quick_load_gets_none():
    clock, out = Clock(), io.StringIO()
    bar = TextProgress(out, quiet_s=1.0, clock=clock)
    bar(0.5, "opening")  # within the quiet second: a quick load says nothing
    assert out.getvalue() == ""
    clock.now += 2
    for i in range(41):
        bar(i / 40, "converting")
    lines = out.getvalue().splitlines()
    assert lines[0] == "moescope: 0% converting" and lines[-1] == "moescope: 100% converting"
    assert len(lines) == 11


def test_a_terminal_gets_one_bar_redrawn_in_place():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    clock, out = Clock(), Terminal()
    bar = TextProgress(out, quiet_s=0.0, clock=clock)
    bar(0.25, "converting experts to Q4_K: MoE layer 4 of 16, about 1 min left")
    bar(1.0, "done")
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, ended when the work is
    assert "[######" in text and "about 1 min left" in text
