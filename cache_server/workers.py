"""The server's worker threads, and the replies they put aside while a job runs elsewhere.

The proxy hands requests to the workers round-robin, whether they are busy or not, so a
worker must never sit on one request: a lookup waiting for an L2 promotion, or a router's
query (answered on the server's query thread), comes back from the handler as a
:class:`Waiting`, which the worker answers when the job is done or at its deadline (its
completion wakes the worker through a pipe), while it answers the requests that come
after it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from cache_server import protocol as p

if TYPE_CHECKING:
    from concurrent.futures import Future

logger = logging.getLogger("glm_cache_server")

Reply = tuple[dict[str, Any], list[Any]]  # a handler's reply header and payload frames


class Job(Protocol):
    """Work under way off the worker: an L2 promotion (:class:`cache_server.l2.Promotion`)
    or a query on the query thread."""

    future: Future[Any] | None
    deadline: float  # monotonic: answered by then, done or not


@dataclass
class Later:
    """A handler's answer that waits for a :class:`Job`: ``finish`` answers once it is ready."""

    job: Job
    finish: Callable[[], Reply]


class Waiting:
    """A request whose reply waits for a job (its future, done or not by its deadline);
    ``answer`` makes its reply frames from the :class:`Later` at the time."""

    def __init__(self, later: Later, answer: Callable[[], list[Any] | Later]) -> None:
        assert later.job.future is not None
        self._answer = answer
        self.future = later.job.future
        self.deadline = later.job.deadline

    def ready(self) -> bool:
        return self.future.done() or time.monotonic() >= self.deadline

    def wait(self) -> None:
        """Block until :meth:`ready`."""
        try:
            self.future.result(timeout=max(0.0, self.deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - a timeout, or the job's failure: the tier counts it at finish
            pass

    def answer(self) -> list[Any]:
        """The reply frames, now."""
        out = self._answer()
        assert not isinstance(out, Later)
        return out


def receive(sock: zmq.Socket[Any], max_frames: int = p.MAX_FRAMES) -> list[zmq.Frame]:
    """One message from the proxy: the sender's identity, then the request's frames, of
    which at most one more than it may have is kept: ``max_frames``, and no more payload
    frames than its header has room for keys (:func:`~cache_server.protocol.max_payload_frames`).
    The frames past those are read and dropped as they come, so a message of a million empty
    frames (2 MB sent) costs no Python object per frame (it was 720 MiB of them); the request,
    one frame over its bound, is then refused as too large."""
    frames = [sock.recv(copy=False)]
    keep = 1 + max_frames
    while sock.getsockopt(zmq.RCVMORE):
        frame = sock.recv(copy=False)
        if len(frames) == 1:  # the header
            keep = 1 + min(max_frames, 1 + p.max_payload_frames(frame.buffer.nbytes))
        if len(frames) <= keep:
            frames.append(frame)
    return frames


def work(ctx: zmq.Context[Any], where: str, stop: threading.Event,
         handle: Callable[[list[Any], bytes], list[Any] | Waiting], max_frames: int = p.MAX_FRAMES,
         busy: dict[int, float] | None = None) -> None:
    """One worker: take a request from the proxy at ``where``, answer it with ``handle``
    (request frames and the sender's identity to reply frames, or a :class:`Waiting`),
    until ``stop``. A request of more than ``max_frames`` frames reaches ``handle`` cut to
    one frame more than that. ``busy`` (thread id -> monotonic time) holds when this worker
    began what it is doing, while it does it: a watchdog reads it (:class:`Watchdog`)."""
    me = threading.get_ident()
    busy = {} if busy is None else busy
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(where)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(wake_r, zmq.POLLIN)
    waiting: list[tuple[zmq.Frame, Waiting]] = []

    def wake(_future: Any) -> None:
        try:
            os.write(wake_w, b"\0")
        except OSError:  # the worker has stopped
            pass

    def send(identity: zmq.Frame, reply: list[Any]) -> None:
        try:
            sock.send_multipart([identity, *reply], copy=False)
        except zmq.ZMQError as e:  # the peer vanished; nothing to answer
            logger.debug("reply dropped: %s", e)

    try:
        while not stop.is_set():
            timeout_ms = 100
            if waiting:
                first = min(w.deadline for _, w in waiting)
                timeout_ms = max(0, min(100, int((first - time.monotonic()) * 1000) + 1))
            ready = dict(poller.poll(timeout_ms))
            if wake_r in ready:
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
            if sock in ready:
                frames = receive(sock, max_frames)
                identity, request = frames[0], frames[1:]
                busy[me] = time.monotonic()
                out = handle(request, identity.bytes)
                if isinstance(out, Waiting):
                    waiting.append((identity, out))
                    out.future.add_done_callback(wake)
                else:
                    send(identity, out)
                busy.pop(me, None)
            for item in [x for x in waiting if x[1].ready()]:
                waiting.remove(item)
                busy[me] = time.monotonic()
                send(item[0], item[1].answer())
                busy.pop(me, None)
    finally:
        sock.close(linger=0)
        os.close(wake_r)
        os.close(wake_w)


# A worker busy this long with one request is reported: the proxy keeps dealing it requests,
# which wait behind it unanswered (clients see timeouts, and the server logs nothing slow).
STUCK_S = 10.0


class Watchdog:
    """Reports workers busy with one request for over :data:`STUCK_S`: once per request, a
    warning with the thread's stack and ``count()`` (a metric); the housekeeping loop calls
    :meth:`check`."""

    def __init__(self, count: Callable[[], None]) -> None:
        self.busy: dict[int, float] = {}
        self._count = count
        self._reported: set[tuple[int, float]] = set()

    def check(self) -> None:
        import sys
        import traceback

        now = time.monotonic()
        current = set(self.busy.items())
        self._reported &= current
        frames = None
        for ident, since in current:
            if now - since < STUCK_S or (ident, since) in self._reported:
                continue
            self._reported.add((ident, since))
            frames = sys._current_frames() if frames is None else frames
            stack = "".join(traceback.format_stack(frames[ident])) if ident in frames else "(gone)"
            self._count()
            logger.warning("worker thread %d has been busy with one request for %.0f s; requests dealt to it wait "
                           "behind it. Its stack:\n%s", ident, now - since, stack)
