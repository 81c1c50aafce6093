"""Progress of long load steps (converting weights to a block format) with the time they have left.

A step reports (fraction done, what it is doing) to a `ProgressFn`; `with_time_left` wraps one so
that each message also says about how long the step has left, extrapolated from the time it took
so far. `TextProgress` draws such reports for a terminal: one line redrawn in place where stderr
is a terminal, otherwise a line per tenth done, so logs stay short.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

ProgressFn = Callable[[float, str], None]

# before this much of the step and this many seconds, an extrapolation says little
MIN_FRACTION = 0.02
MIN_SECONDS = 2.0


def duration_text(seconds: float) -> str:
    """'45 s', '3 min 10 s', '1 h 5 min': rounded the way a person reads a countdown."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        minutes, rest = divmod(seconds, 60)
        rest = rest // 10 * 10  # ten-second steps: the estimate is not finer than that
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    hours, minutes = divmod(seconds // 60, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def with_time_left(progress: ProgressFn | None, clock: Callable[[], float] = time.monotonic) -> ProgressFn | None:
    """`progress`, with ", about N left" added to each message once an estimate means something.
    The clock starts at the first report; a fraction lower than the last one starts a new step."""
    if progress is None:
        return None
    start, last = clock(), 0.0

    def report(fraction: float, message: str) -> None:
        nonlocal start, last
        now = clock()
        if fraction < last:
            start = now
        last = fraction
        elapsed = now - start
        if MIN_FRACTION <= fraction < 1.0 and elapsed >= MIN_SECONDS:
            message = f"{message}, about {duration_text(elapsed * (1 - fraction) / fraction)} left"
        progress(fraction, message)

    return report


class TextProgress:
    """A ProgressFn that draws on a text stream: a bar redrawn in place on a terminal, else a line
    at each tenth (and at each new kind of work) so a log file keeps the story and stays short.
    Nothing is drawn for the first `quiet_s` seconds (default: 1 on a terminal, 10 in a log): a
    load that is quick says nothing, and a script reading stderr sees only its own lines."""

    WIDTH = 24

    def __init__(self, stream: TextIO | None = None, prefix: str = "moescope: ", quiet_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.prefix = prefix
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        quiet_s = quiet_s if quiet_s is not None else 1.0 if self.live else 10.0
        self.clock, self.speak_at = clock, clock() + quiet_s
        self._tenth = -1
        self._drawn = 0  # characters of the line drawn in place

    def __call__(self, fraction: float, message: str) -> None:
        fraction = min(max(fraction, 0.0), 1.0)
        if self.clock() < self.speak_at:
            return
        if self.live:
            filled = int(fraction * self.WIDTH)
            line = f"\r{self.prefix}[{'#' * filled}{' ' * (self.WIDTH - filled)}] {fraction:4.0%} {message}"
            self.stream.write(line.ljust(self._drawn))
            self._drawn = len(line)
            if fraction >= 1.0:
                self.end()
        else:
            tenth = int(fraction * 10)
            if tenth != self._tenth:
                self._tenth = tenth
                self.stream.write(f"{self.prefix}{fraction:.0%} {message}\n")
        self.stream.flush()

    def end(self) -> None:
        """Leave the line drawn in place (the next output starts below it)."""
        if self.live and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = 0
