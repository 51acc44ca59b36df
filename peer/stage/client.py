"""The trainer's side of stage mode: send activations through a module's stage servers, gradients back.

SWARM parallelism (Ryabinin et al. 2023) wires a pipeline stochastically: for every micro-batch and
level the trainer picks one of the module's servers at random, with probability proportional to
its throughput over its expected wait (``throughput / ((1 + queued requests) / throughput)``), so
fast and idle servers get more work and a slow one still gets some. A request that fails or times out is
retried on another server; a server that fails ``max_failures`` times in a row is not used again
until the DHT record we saw at that moment expires (a live server refreshes its record, a dead one
vanishes). Throughputs start from the servers' own claims and are replaced by what the trainer
measures, since a peer's report is never trusted beyond the first guess.

Activations and gradients travel encoded by :mod:`peer.stage.wire` (int8 by default); each call may
name its own codec, which the server answers in (a :class:`peer.stage.wire.CodecScheme` picks them).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from peer.network import own_p2p, unwrap_dht
from protos import versions
from protos.hivepath.peer.v1.stage_pb2 import EncodedTensor, StageReply, StageRequest
from peer.compression import ActivationCodec
from peer.stage.records import MAX_THROUGHPUT, StageServerEntry, stage_records_from_value, stage_servers_key
from peer.stage.wire import (DEFAULT_ACTIVATION_CODEC, WireError, activation_codec, codec_scheme, decode_tensor,
                             encode_tensor, stage_handler_name)

__all__ = ["StageClient", "Hop", "StageUnavailable", "StageRequestError", "choose_server"]

log = logging.getLogger(__name__)

_RETRY_POLL = 0.2  # seconds between DHT reads while no server of a module is usable (a protocol poll)


class StageUnavailable(RuntimeError):
    """No server of a module answered before the deadline (the message names the module)."""


class StageRequestError(ValueError):
    """A server refused our request as malformed (it would fail on every server)."""


@dataclass
class Hop:
    """One forward through one level: enough to send its backward (to the same server, or another)."""

    module_id: str
    peer_id: str
    request_id: str
    input: EncodedTensor
    """The activations as sent (resent with the backward after a failover)."""


@dataclass
class _ServerStats:
    failures: int = 0
    banned_until: float = 0.0
    measured: float = 0.0
    """Tokens/s we measured: request tokens times the requests ahead of it (plus one) over its
    round-trip seconds; 0 until the first success."""
    claimed: float = 0.0
    """Throughput in the server's last reply (fresher than its record)."""
    queue: Optional[int] = None
    """Queue length from the server's last reply (fresher than its record)."""
    in_flight: int = 0


def choose_server(entries: list[StageServerEntry], stats: dict[str, _ServerStats], rng: random.Random) -> StageServerEntry:
    """Pick a server with probability proportional to its throughput over its expected wait, where the
    wait is ``(1 + queued) / throughput``: so ``throughput**2 / (1 + queued)``. Throughput: what
    the server claims (its last reply, else its record; at least 1 token/s), but never more than
    twice what we measured once we have a measurement. Queued: the server's last reported queue
    plus our own requests in flight to it."""
    weights = []
    for e in entries:
        s = stats.get(e.peer_id, _ServerStats())
        tps = max(1.0, s.claimed or e.record.throughput)
        if s.measured > 0:
            tps = min(tps, 2.0 * s.measured)
        queue = e.record.queue_length if s.queue is None else s.queue
        weights.append(tps * tps / (1.0 + queue + s.in_flight))
    return rng.choices(entries, weights=weights, k=1)[0]


@dataclass
class ClientStats:
    """What a :class:`StageClient` sent and how often it had to retry."""

    requests: int = 0
    failures: int = 0
    failovers: int = 0
    """Backwards that went to another server than their forward."""
    bytes_sent: int = 0
    bytes_received: int = 0
    fp32_bytes: int = 0
    """What the same tensors would have taken as fp32 (both directions)."""
    served_by: dict[str, int] = field(default_factory=dict)


class StageClient:
    """Sends :class:`protos.hivepath.peer.v1.stage_pb2.StageRequest` s to the stage servers of a run (thread-safe).

    Args:
        dht: this process's DHT. run_id, config_hash: the run; servers of another hash are ignored.
        codec: codec scheme of activations and gradients (:func:`peer.stage.wire.codec_scheme`: a codec
            name such as ``int8``, ``int4tok+zstd``, or ``int4tok+zstd/first=int5tok+zstd``), resolved
            once here into :attr:`scheme`; a call that names no codec uses the scheme's base codec.
        request_timeout: seconds one server may take to answer before we try another.
        call_timeout: seconds a forward or backward may take over all retries.
        vacant_timeout: seconds a call waits while its module has no usable server at all (none
            announced, or every one failed) before it gives up (default: ``call_timeout``); a trainer
            that can drive another pipeline meanwhile sets it short.
        max_failures: consecutive failures after which a server is skipped until its record expires.
        refresh_interval: seconds between DHT reads of a module's servers.
        seed: seeds the stochastic wiring.
        on_failover: called as ``on_failover(module_id, from_server, to_server, reason)`` when a
            request leaves a server that failed (``reason``: its failure) for another that answered,
            or (``to_server`` None) when no server answered before ``call_timeout``; a retry that
            the same server answers is no failover.
    """

    def __init__(self, dht: Any, run_id: str, config_hash: str, codec: str = DEFAULT_ACTIVATION_CODEC,
                 request_timeout: float = 10.0, call_timeout: float = 60.0, max_failures: int = 2,
                 refresh_interval: float = 2.0, seed: int = 0, startup_timeout: float = 30.0,
                 vacant_timeout: Optional[float] = None,
                 on_failover: Optional[Callable[[str, str, Optional[str], str], None]] = None):
        self.dht = unwrap_dht(dht)
        self.run_id = run_id
        self.config_hash = config_hash
        self.scheme = codec_scheme(codec)
        self.codec = activation_codec(self.scheme.base)
        self.request_timeout = request_timeout
        self.call_timeout = call_timeout
        self.vacant_timeout = call_timeout if vacant_timeout is None else min(vacant_timeout, call_timeout)
        self.max_failures = max_failures
        self.refresh_interval = refresh_interval
        self.on_failover = on_failover
        self.stats = ClientStats()
        self._rng = random.Random(seed)
        self._servers: dict[str, tuple[float, dict[str, StageServerEntry]]] = {}
        self._per_server: dict[str, _ServerStats] = {}
        self._handler = stage_handler_name(run_id)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stage-client", daemon=True)
        self._thread.start()
        # a handle of our own: closing it must not stop the process's shared one (the averager's doors)
        self._p2p = asyncio.run_coroutine_threadsafe(own_p2p(self.dht), self._loop).result(startup_timeout)

    # -- the API --------------------------------------------------------------------------------

    def forward(self, module_id: str, x: Tensor, codec: Optional[str] = None) -> tuple[Tensor, Hop]:
        """``x`` (B, T, C) through a server of ``module_id``: its output (B, T, C, CPU fp32) and the hop.
        ``codec``: the request's codec, and so the reply's (default: the scheme's base codec)."""
        msg = encode_tensor(x, self._codec(codec))
        rid = secrets.token_hex(8)
        request = StageRequest(kind=StageRequest.FORWARD, module_id=module_id, config_hash=self.config_hash,
                               request_id=rid, input=msg, residual=self.scheme.residual,
                               protocol=versions.stamp("stage", "StageRequest.protocol"))
        reply, peer = self._call(self._request(module_id, lambda _peer, _attempt: request, prefer=None))
        out = self._decode(reply, list(x.shape), module_id)
        if reply.residual:  # the module's output minus its input: added to the exact input
            out = out.add_(x.detach().to(device="cpu", dtype=torch.float32))
        return out, Hop(module_id, peer, rid, msg)

    def backward(self, hop: Hop, grad: Tensor, codec: Optional[str] = None) -> Tensor:
        """The gradient w.r.t. ``hop``'s input given ``grad`` w.r.t. its output (B, T, C). Goes to the
        server of the forward; after a failure, to another server with the input resent. ``codec``:
        the gradients' codec both ways (default: the scheme's base codec)."""
        g = encode_tensor(grad, self._codec(codec))

        def make(peer: str, attempt: int) -> StageRequest:
            req = StageRequest(kind=StageRequest.BACKWARD, module_id=hop.module_id, config_hash=self.config_hash,
                               request_id=hop.request_id, grad=g, residual=self.scheme.residual,
                               protocol=versions.stamp("stage", "StageRequest.protocol"))
            if peer != hop.peer_id or attempt > 0:  # another server, or a retry: it may not keep the input
                req.input.CopyFrom(hop.input)
            return req

        reply, peer = self._call(self._request(hop.module_id, make, prefer=hop.peer_id))
        if peer != hop.peer_id:
            self.stats.failovers += 1
        out = self._decode(reply, list(grad.shape), hop.module_id)
        if reply.residual:  # the input's gradient minus the output's: added to the exact output gradient
            out = out.add_(grad.detach().to(device="cpu", dtype=torch.float32))
        return out

    def servers(self, module_id: str) -> dict[str, StageServerEntry]:
        """The module's valid server records of our config hash (read from the DHT now)."""
        return self._call(self._refresh(module_id))

    def usable(self, module_id: str) -> list[str]:
        """Peer ids of the module's servers a request may go to now: announced (records at most
        ``refresh_interval`` old), of our config hash, and not skipped after failures."""
        return [e.peer_id for e in self._call(self._candidates(module_id, set(), False))]

    def send(self, peer_id: str, request: StageRequest, timeout: float) -> StageReply:
        """One raw request to one server, no retries (diagnostics and tests)."""
        coro = asyncio.wait_for(self._ask(peer_id, request), timeout)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout + 5.0)

    async def _ask(self, peer_id: str, request: StageRequest) -> StageReply:
        from hivemind.p2p import PeerID

        stream = await self._p2p.iterate_protobuf_handler(PeerID.from_base58(peer_id), self._handler, request,
                                                          StageReply)
        async for reply in stream:
            return reply
        raise ConnectionError(f"server {peer_id[-8:]} closed the stream without a reply")

    def close(self) -> None:
        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._p2p.shutdown(), self._loop).result(5.0)
            except Exception as e:
                log.debug("stopping the stage client P2P handle: %r", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    # -- internals ------------------------------------------------------------------------------

    def _codec(self, name: Optional[str]) -> ActivationCodec:
        return self.codec if name is None else activation_codec(name)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self.call_timeout + 10.0)

    def _decode(self, reply: StageReply, shape: list[int], module_id: str) -> Tensor:
        try:
            out = decode_tensor(reply.output, f"reply of {module_id}", max_elements=max(1, shape[0] * shape[1] * shape[2]),
                                shape=shape)
        except WireError as e:
            raise StageRequestError(str(e)) from None
        self.stats.bytes_received += len(reply.output.data)
        self.stats.fp32_bytes += 4 * out.numel()
        return out

    async def _refresh(self, module_id: str) -> dict[str, StageServerEntry]:
        found = await self.dht.get(stage_servers_key(self.run_id, module_id), latest=True, return_future=True)
        entries = {p: e for p, e in stage_records_from_value(module_id, found).items()
                   if e.record.config_hash == self.config_hash}
        self._servers[module_id] = (time.monotonic(), entries)
        return entries

    async def _candidates(self, module_id: str, exclude: set[str], force: bool) -> list[StageServerEntry]:
        from hivemind.utils import get_dht_time

        cached = self._servers.get(module_id)
        if force or cached is None or time.monotonic() - cached[0] > self.refresh_interval:
            entries = await self._refresh(module_id)
        else:
            entries = cached[1]
        now = get_dht_time()
        return [e for p, e in sorted(entries.items()) if p not in exclude and e.expires > now
                and self._per_server.get(p, _ServerStats()).banned_until <= now]

    def _report_failover(self, module_id: str, failed: Optional[tuple[str, str]], to: Optional[str]) -> None:
        if failed is None or failed[0] == to or self.on_failover is None:
            return
        try:
            self.on_failover(module_id, failed[0], to, failed[1])
        except Exception as e:  # a broken reporter must not fail the request it reports on
            log.warning("reporting a failover of %s failed: %r", module_id, e)

    def _failed(self, peer: str, expires: float, why: str) -> None:
        s = self._per_server.setdefault(peer, _ServerStats())
        s.failures += 1
        self.stats.failures += 1
        if s.failures >= self.max_failures:
            s.banned_until = expires
            log.warning("server %s failed %d times (%s): not used until its record expires", peer[-8:], s.failures, why)
        else:
            log.info("server %s failed (%s); retrying elsewhere", peer[-8:], why)

    async def _request(self, module_id: str, make: Any, prefer: Optional[str]) -> tuple[StageReply, str]:
        deadline = time.monotonic() + self.call_timeout
        tried: set[str] = set()
        force = False
        attempt = 0
        failed: Optional[tuple[str, str]] = None  # the first server that failed this request, and why
        vacant: Optional[float] = None  # since when the module has had no usable server at all
        while True:
            candidates = await self._candidates(module_id, tried, force)
            if not candidates:
                now = time.monotonic()
                if not tried:
                    vacant = now if vacant is None else vacant
                if now >= deadline or (vacant is not None and now >= vacant + self.vacant_timeout):
                    self._report_failover(module_id, failed, None)
                    why = (f"answered within {self.call_timeout:.0f}s ({len(tried)} tried)" if now >= deadline
                           else f"usable for {self.vacant_timeout:.0f}s")
                    raise StageUnavailable(f"no server of {module_id} {why}")
                await asyncio.sleep(_RETRY_POLL)
                tried.clear()
                force = True
                continue
            force, vacant = False, None
            by_peer = {e.peer_id: e for e in candidates}
            entry = by_peer.get(prefer) if prefer is not None and attempt == 0 else None
            entry = entry or choose_server(candidates, self._per_server, self._rng)
            peer = entry.peer_id
            request = make(peer, attempt)
            attempt += 1
            stats = self._per_server.setdefault(peer, _ServerStats())
            ahead = stats.in_flight + (stats.queue or 0)
            stats.in_flight += 1
            self.stats.requests += 1
            t0 = time.monotonic()
            try:
                left = max(0.01, min(self.request_timeout, deadline - t0))
                reply = await asyncio.wait_for(self._ask(peer, request), left)
            except Exception as e:
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                self._failed(peer, entry.expires, why)
                failed = failed or (peer, why)
                tried.add(peer)
                continue
            finally:
                stats.in_flight -= 1
            if reply.code == StageReply.BAD_REQUEST:
                raise StageRequestError(f"server {peer[-8:]} of {module_id} refused the request: {reply.error}")
            if reply.code != StageReply.OK:
                why = StageReply.Code.Name(reply.code) + ": " + reply.error
                self._failed(peer, entry.expires, why)
                failed = failed or (peer, why)
                tried.add(peer)
                continue
            seconds = max(1e-6, time.monotonic() - t0)
            shape = request.input.shape if request.kind == StageRequest.FORWARD else request.grad.shape
            tokens = shape[0] * shape[1]
            rate = tokens * (1 + ahead) / seconds
            stats.measured = rate if stats.measured == 0 else 0.7 * stats.measured + 0.3 * rate
            stats.queue = int(reply.queue_length)
            if math.isfinite(reply.throughput) and 0 <= reply.throughput <= MAX_THROUGHPUT:
                stats.claimed = float(reply.throughput)
            stats.failures = 0
            sent = (request.input.data if request.HasField("input") else b"") + (request.grad.data if request.HasField("grad") else b"")
            self.stats.bytes_sent += len(sent)
            self.stats.fp32_bytes += 4 * sum(s[0] * s[1] * s[2] for s in (request.input.shape, request.grad.shape)
                                             if len(s) == 3)
            self.stats.served_by[peer] = self.stats.served_by.get(peer, 0) + 1
            self._report_failover(module_id, failed, peer)
            return reply, peer
