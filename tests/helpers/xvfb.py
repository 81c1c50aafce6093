"""A private X server for tests that open the real window on Qt's xcb platform (Debian: apt-get install xvfb)."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

START_TIMEOUT_S = 30


def start_xvfb(screen: str = "1600x1000x24") -> tuple[subprocess.Popen, str]:
    """Starts Xvfb on a free display number (it writes the number to a pipe once it accepts
    connections: no polling, no sleeps); returns the server and the DISPLAY value."""
    read_fd, write_fd = os.pipe()
    server = subprocess.Popen(["Xvfb", "-displayfd", str(write_fd), "-screen", "0", screen, "-nolisten", "tcp"],
                              pass_fds=(write_fd,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        ready, _, _ = select.select([pipe], [], [], START_TIMEOUT_S)
        number = pipe.readline().strip() if ready else ""
    if not number:
        server.kill()
        server.wait()
        raise AssertionError(f"Xvfb did not start within {START_TIMEOUT_S} s (exit status {server.poll()})")
    return server, f":{number}"


def stop_xvfb(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@contextmanager
def xvfb_display(screen: str = "1600x1000x24") -> Iterator[str]:
    """DISPLAY of a private X server for the duration; skips the test where Xvfb is not installed."""
    if shutil.which("Xvfb") is None:
        pytest.skip("Xvfb is not installed (apt-get install xvfb; .ci/run installs it)")
    server, display = start_xvfb(screen)
    try:
        yield display
    finally:
        stop_xvfb(server)
