"""A command run under a memory cap: a cgroup v1 memory group of its own, whose limit counts the
page cache the command's reads and writes fill as well as its resident memory, as a machine with
that much RAM would hold it to.

Where the kernel offers no such group to this process (no cgroup v1 memory controller, or no right
to make a group in it: not root, a cgroup v2 machine), `unavailable()` says why in one line and a
benchmark skips with it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

MEMORY_V1 = Path("/sys/fs/cgroup/memory")


@dataclass
class CappedRun:
    returncode: int | None  # None: stopped at the timeout
    stdout: str
    stderr: str
    seconds: float
    peak_rss_bytes: int  # the command's own peak resident memory (its ru_maxrss)
    group_peak_bytes: int  # the group's peak charge: resident memory and page cache together
    limit_hits: int  # times the group reached its limit (memory.failcnt): the kernel reclaimed, or killed
    oom_killed: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def unavailable(root: Path = MEMORY_V1) -> str | None:
    """Why a command cannot run under a cap here; None where it can."""
    if not (root / "memory.limit_in_bytes").is_file():
        return f"no cgroup v1 memory controller at {root} (cgroup v2 or none): the memory cap is not measured here"
    probe = root / f"moescope-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"cannot make a memory cgroup under {root} ({exc.strerror}; it needs root): the memory cap is not measured here"
    return None


def _read_int(path: Path) -> int:
    return int(path.read_text().split()[0])


def _oom_kills(group: Path) -> int:
    for line in (group / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def run_capped(cmd: list[str], cap_bytes: int, *, timeout: float, env: dict | None = None,
               cwd: Path | None = None, root: Path = MEMORY_V1) -> CappedRun:
    """`cmd` in a new memory group limited to `cap_bytes`; the group is removed afterwards."""
    group = root / f"moescope-memcap-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(cap_bytes))
        procs = str(group / "cgroup.procs")

        def join_group() -> None:  # in the child before exec: nothing it allocates escapes the cap
            with open(procs, "w") as handle:
                handle.write(str(os.getpid()))

        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            start = time.perf_counter()
            child = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=cwd, preexec_fn=join_group)
            status, usage = _wait(child, timeout)
            seconds = time.perf_counter() - start
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        returncode = os.waitstatus_to_exitcode(status) if status is not None else None
        return CappedRun(returncode, stdout, stderr, seconds, usage.ru_maxrss * 1024,
                         _read_int(group / "memory.max_usage_in_bytes"), _read_int(group / "memory.failcnt"),
                         _oom_kills(group) > 0)
    finally:
        _remove(group)


def _wait(child: subprocess.Popen, timeout: float):
    """(wait status, or None when it was stopped at `timeout`; its resource usage): wait4 gives the
    child's own peak resident memory, which a running max over all children would not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
            return status, usage
        time.sleep(0.05)
    child.kill()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return None, usage


def _remove(group: Path) -> None:
    """The group gone: its page cache charge moved to the parent first (a v1 group that still holds
    charges can be removed, but force_empty drops what it can so that nothing lingers)."""
    with contextlib.suppress(OSError):
        (group / "memory.force_empty").write_text("0")
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)  # the killed child's exit still under way
