"""Bandwidth probes: a joining peer measures its link to the coordinator instead of guessing it.

``ProbeUpload``: the peer streams filler chunks; the coordinator times them from the first message
(token and size, no payload) to the last chunk and answers the bytes and seconds it saw.
``ProbeDownload``: the coordinator streams the bytes asked for, led by one empty message that starts
the peer's clock. Both are authenticated by the run token, capped at :data:`MAX_PROBE_BYTES` per probe
(INVALID_ARGUMENT above) and limited to :data:`MAX_CONCURRENT_PROBES` at a time (RESOURCE_EXHAUSTED
when busy), so probes cannot turn the coordinator into a traffic source. They carry filler bytes only:
weights and gradients never pass through the coordinator.

The figures are what the peer's link to the coordinator sustains, an estimate of its link to other
peers (the scheduler uses them to give slow links work that needs less bandwidth).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Callable, Optional

import grpc

from coordinator.errors import InvalidArgument, Overloaded
from protos.hivepath.coordinator.v1 import coordinator_pb2 as pb

__all__ = ["MAX_PROBE_BYTES", "MAX_PROBE_CHUNK", "DEFAULT_PROBE_CHUNK", "MAX_CONCURRENT_PROBES", "PROBE_TIMEOUT",
           "ProbeService"]

log = logging.getLogger(__name__)

MAX_PROBE_BYTES = 8 << 20
"""Largest probe in either direction, bytes."""
MAX_PROBE_CHUNK = 1 << 20
"""Largest chunk a download probe sends (the server's message limit is 1 MiB)."""
DEFAULT_PROBE_CHUNK = 256 << 10
MAX_CONCURRENT_PROBES = 2
"""Probes running at once, both directions together; more are answered RESOURCE_EXHAUSTED."""
PROBE_TIMEOUT = 60.0
"""Seconds one probe may take before the coordinator gives up on it (DEADLINE_EXCEEDED)."""

_FILLER = random.Random(0).randbytes(MAX_PROBE_CHUNK)  # incompressible, so no link compresses it away


class ProbeService:
    """The probe RPCs' logic; ``authorize(token)`` raises :class:`coordinator.errors.Unauthenticated`."""

    def __init__(self, authorize: Callable[[str], None], max_concurrent: int = MAX_CONCURRENT_PROBES,
                 probe_timeout: float = PROBE_TIMEOUT, on_done: Optional[Callable[[], None]] = None):
        self._authorize = authorize
        self._on_done = on_done or (lambda: None)
        self.max_concurrent = max_concurrent
        self.probe_timeout = probe_timeout
        self.active = 0
        self.completed = 0

    def _admit(self, token: str, total_bytes: int) -> None:
        self._authorize(token)
        if total_bytes > MAX_PROBE_BYTES:
            raise InvalidArgument("total_bytes", f"{total_bytes} is above the probe limit of {MAX_PROBE_BYTES} bytes; "
                                                 "probe with less")
        if total_bytes == 0:
            raise InvalidArgument("total_bytes", "is 0; a probe needs bytes to time")
        if self.active >= self.max_concurrent:
            raise Overloaded(f"{self.active} bandwidth probes are running, the limit is {self.max_concurrent}; "
                             "try again in a few seconds")
        self.active += 1  # event-loop thread only: no lock needed

    async def upload(self, context: grpc.aio.ServicerContext) -> pb.ProbeUploadResponse:
        """Receive the peer's chunks; time them from the leading message to the last chunk."""
        first = await context.read()
        t0 = time.perf_counter()
        if first is grpc.aio.EOF:
            raise InvalidArgument("token", "missing: the stream ended before its first message")
        total = first.total_bytes
        self._admit(first.token, total)
        try:
            received, t_last = len(first.payload), t0
            deadline = t0 + self.probe_timeout
            while True:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"the probe took over {self.probe_timeout:.0f}s; probe with fewer bytes")
                try:
                    chunk = await asyncio.wait_for(context.read(), remaining)
                except asyncio.TimeoutError:
                    continue
                if chunk is grpc.aio.EOF:
                    break
                t_last = time.perf_counter()
                received += len(chunk.payload)
                if received > total:
                    raise InvalidArgument("payload", f"more than the announced total_bytes={total} arrived")
            self.completed += 1
            self._on_done()
            return pb.ProbeUploadResponse(received_bytes=received, seconds=t_last - t0)
        finally:
            self.active -= 1

    async def download(self, request: pb.ProbeDownloadRequest,
                       context: grpc.aio.ServicerContext) -> None:
        """Send ``total_bytes`` of filler, led by an empty message that starts the peer's clock."""
        chunk = request.chunk_bytes or DEFAULT_PROBE_CHUNK
        if chunk > MAX_PROBE_CHUNK:
            raise InvalidArgument("chunk_bytes", f"{chunk} is above {MAX_PROBE_CHUNK}; ask for smaller chunks")
        total = request.total_bytes
        self._admit(request.token, total)
        try:
            view = memoryview(_FILLER)
            await context.write(pb.ProbeDownloadResponse())
            sent = 0
            while sent < total:
                n = min(chunk, total - sent)
                await context.write(pb.ProbeDownloadResponse(payload=bytes(view[:n])))
                sent += n
            self.completed += 1
            self._on_done()
        finally:
            self.active -= 1
