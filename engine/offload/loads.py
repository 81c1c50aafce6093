"""Expert loads on background threads: two priorities, chunks, early preemption (ProMoE).

A load moves one expert into its slot in chunks of one weight matrix each. Workers always take the
next chunk of the most urgent job: exact loads (a layer needs the expert now) before speculative
ones (prefetches), so an exact miss waits for at most the chunk that is already moving. A
speculative job that becomes needed is promoted; one that must give way is cancelled between
chunks. `ChunkScheduler` is the pure ordering logic (no threads); `LoadQueue` runs it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from enum import Enum


class JobState(Enum):
    QUEUED = "queued"
    RUNNING = "running"  # a worker is moving one of its chunks
    DONE = "done"
    CANCELLED = "cancelled"


class LoadJob:
    def __init__(self, layer: int, expert: int, slot: int, chunks: int, *, speculative: bool, fence=None) -> None:
        self.layer, self.expert, self.slot, self.chunks = layer, expert, slot, chunks
        self.prefetch = speculative  # how it started (for accounting); `urgent` is its current priority
        self.urgent = not speculative
        self.fence = fence  # CUDA: an event the copy must wait for (compute still reading the old bytes)
        self.next_chunk = 0
        self.nbytes = 0
        self.state = JobState.QUEUED
        self.cancel_requested = False
        self.error: BaseException | None = None
        self.collected = False  # the cache has accounted for it
        self._finished = threading.Event()

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def wait(self) -> None:
        self._finished.wait()
        if self.error is not None:
            raise self.error

    def __repr__(self) -> str:
        return f"LoadJob(layer={self.layer}, expert={self.expert}, {self.state.value}, chunk {self.next_chunk}/{self.chunks})"


class ChunkScheduler:
    """Which job moves its next chunk: exact jobs first (FIFO), then speculative (FIFO)."""

    def __init__(self) -> None:
        self.exact: deque[LoadJob] = deque()
        self.speculative: deque[LoadJob] = deque()

    def push(self, job: LoadJob, *, front: bool = False) -> None:
        queue = self.exact if job.urgent else self.speculative
        queue.appendleft(job) if front else queue.append(job)

    def next(self) -> LoadJob | None:
        for queue in (self.exact, self.speculative):
            if queue:
                return queue.popleft()
        return None

    def promote(self, job: LoadJob) -> None:
        """A speculative job is needed now: it moves to the exact queue (if it is waiting in one)."""
        if job.urgent:
            return
        job.urgent = True
        if job in self.speculative:
            self.speculative.remove(job)
            self.exact.append(job)

    def remove(self, job: LoadJob) -> bool:
        for queue in (self.exact, self.speculative):
            if job in queue:
                queue.remove(job)
                return True
        return False

    def __len__(self) -> int:
        return len(self.exact) + len(self.speculative)


ChunkFn = Callable[[LoadJob, int], int]  # (job, chunk index) -> bytes moved


class LoadQueue:
    def __init__(self, move_chunk: ChunkFn, workers: int = 2) -> None:
        self._move_chunk = move_chunk
        self._scheduler = ChunkScheduler()
        self._cond = threading.Condition()
        self._closed = False
        self._finished: list[LoadJob] = []  # done or cancelled, not yet collected by the cache
        self._threads = [
            threading.Thread(target=self._work, name=f"moescope-load-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: LoadJob) -> LoadJob:
        with self._cond:
            if self._closed:
                raise RuntimeError("the load queue is closed")
            self._scheduler.push(job)
            self._cond.notify()
        return job

    def promote(self, job: LoadJob) -> None:
        with self._cond:
            self._scheduler.promote(job)

    def cancel(self, job: LoadJob) -> None:
        """Stop a speculative job between chunks (returns at once; `job.wait()` for the outcome)."""
        with self._cond:
            if job.finished or job.urgent:
                return
            job.cancel_requested = True
            if self._scheduler.remove(job):  # not moving right now: stop it here
                self._finish(job, JobState.CANCELLED)

    def take_finished(self) -> list[LoadJob]:
        with self._cond:
            done, self._finished = self._finished, []
        return done

    def _finish(self, job: LoadJob, state: JobState) -> None:  # with the lock held
        job.state = state
        self._finished.append(job)
        job._finished.set()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not len(self._scheduler):
                    self._cond.wait()
                if self._closed and not len(self._scheduler):
                    return
                job = self._scheduler.next()
                job.state = JobState.RUNNING
                chunk = job.next_chunk
            try:
                moved = self._move_chunk(job, chunk)
                error = None
            except BaseException as exc:  # surfaced to whoever waits on the job
                moved, error = 0, exc
            with self._cond:
                job.nbytes += moved
                job.next_chunk += 1
                if error is not None:
                    job.error = error
                    self._finish(job, JobState.CANCELLED)
                elif job.next_chunk == job.chunks:
                    self._finish(job, JobState.DONE)
                elif job.cancel_requested and not job.urgent:
                    self._finish(job, JobState.CANCELLED)
                else:
                    # back to the head of its queue: it continues next unless a more urgent job came in
                    job.state = JobState.QUEUED
                    self._scheduler.push(job, front=True)
                    self._cond.notify()

    def close(self) -> None:
        with self._cond:
            for job in list(self._scheduler.speculative):
                self._scheduler.remove(job)
                job.cancel_requested = True
                self._finish(job, JobState.CANCELLED)
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
