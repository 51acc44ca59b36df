"""The peer's side of the coordinator API: a small synchronous client.

Heartbeats travel over one long-lived ``HeartbeatStream`` per peer (a quarter of the coordinator's CPU
per heartbeat of a unary call); where the coordinator lacks it (UNIMPLEMENTED) the client switches to
unary ``Heartbeat`` for good, and when the stream breaks or stalls that heartbeat is sent as a unary
call (with retries) and the next one opens a fresh stream. :meth:`CoordinatorClient.measure_bandwidth`
times a probe in each direction against the coordinator.

The coordinator is never on the data path. While it is unreachable every call retries with
exponential backoff and full jitter (up to ``retry_timeout``, :mod:`peer.coordinator_client.calls`;
:meth:`CoordinatorClient.start_heartbeats` retries forever in the background), so training and averaging
go on. A heartbeat answered NOT_FOUND (the lease expired, or the coordinator lost it) re-joins
transparently with the same peer id, which gets the peer its history back. Imports no torch.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence

import grpc

from models.config import RunConfig
from models.errors import HivepathError
from peer.coordinator_client.calls import RETRIABLE, Closed, NotFound, RetryingChannel
from peer.coordinator_client.messages import (CoordinatorUnavailable, Evaluation, ExchangePlan, HeartbeatReply,
                                               IncompatibleRun, JoinInfo, PeerInfo, Progress, RunSpec, WorkAssignment,
                                               VersionMismatch, check_address, check_coordinator, refusal)
from peer.coordinator_client.transport import (PROBE_BYTES, HeartbeatStream, ProbeFailed, StreamStalled, probe_download,
                                               probe_upload)
from protos.hivepath.coordinator.v1 import coordinator_pb2 as pb
from protos import versions

__all__ = ["CoordinatorClient"]

log = logging.getLogger(__name__)

ROLE_MODES = {"": pb.MODE_UNSPECIFIED, "path": pb.MODE_PATH, "stage": pb.MODE_STAGE, "trainer": pb.MODE_TRAINER}
"""``peer join --role`` values and the mode each asks the coordinator for."""


class CoordinatorClient:
    """Join, heartbeat, leave and status against ``address`` (``host:port``), with retries."""

    def __init__(
        self,
        address: str,
        token: str,
        peer: Optional[PeerInfo] = None,
        tls_ca: Optional[str] = None,
        rpc_timeout: float = 10.0,
        retry_timeout: Optional[float] = 60.0,
        backoff_base: float = 0.2,
        backoff_max: float = 10.0,
        seed: Optional[int] = None,
        heartbeat_stream: bool = True,
        expect_starting: bool = False,
    ):
        self.address = check_address(address)
        self.peer = peer
        self._token = token
        self._calls = RetryingChannel(self.address, tls_ca, rpc_timeout, retry_timeout, backoff_base, backoff_max,
                                      seed, expect_starting)
        self._stub = self._calls.stub
        self._closed = self._calls.closed
        self._lock = threading.RLock()
        self._left = threading.Event()
        """Set by :meth:`leave`: from then on a heartbeat never joins again (a background heartbeat racing
        the leave would otherwise take a fresh lease on the way out: a ghost holding work until it expired)."""
        self._session_lock = threading.Lock()
        """Held by :meth:`leave` and by a heartbeat's re-join, so one finishes before the other starts."""
        self.joined: Optional[JoinInfo] = None
        self.assignment_version = 0
        self.answered_at: Optional[float] = None
        """When (monotonic) the coordinator last answered a join or heartbeat; None before the first."""
        self.in_contact_since: Optional[float] = None
        """Since when (monotonic) every heartbeat was answered; None after a failed one, until the next."""
        self._credential = b""
        self._reporter: Optional[Any] = None
        self._thread: Optional[threading.Thread] = None
        self._use_stream = heartbeat_stream
        self._stream: Optional[HeartbeatStream] = None
        self._stream_lock = threading.Lock()
        self.heartbeats_sent = {"stream": 0, "unary": 0}
        """Heartbeats answered over the stream and as unary calls (for status lines and tests)."""

    @property
    def rpc_timeout(self) -> float:
        """Seconds one attempt of a call may take."""
        return self._calls.rpc_timeout

    @rpc_timeout.setter
    def rpc_timeout(self, value: float) -> None:
        self._calls.rpc_timeout = value

    @property
    def retry_timeout(self) -> Optional[float]:
        """Seconds a call is retried while the coordinator is away (None: forever)."""
        return self._calls.retry_timeout

    @retry_timeout.setter
    def retry_timeout(self, value: Optional[float]) -> None:
        self._calls.retry_timeout = value

    # -- calls --------------------------------------------------------------------------------

    def run_spec(self) -> RunSpec:
        """The run spec and DHT bootstrap peers, without joining (prepare data, measure, then join)."""
        reply = self._calls.call(self._stub.GetRunSpec, pb.GetRunSpecRequest(token=self._token))
        run = _checked_config(reply.run_spec)
        spec = reply.run_spec
        return RunSpec(run, spec.run_config_hash, spec.lattice_hash, spec.manifest_hash, tuple(reply.initial_peers),
                       bytes(spec.coordinator_public_key))

    def join(self) -> JoinInfo:
        """Join (or re-join) the run; raises :class:`NoAssignmentFits`, :class:`CoordinatorRefused`, ..."""
        if self.peer is None:
            raise HivepathError("this client was made without PeerInfo; it cannot join")
        p = self.peer
        request = pb.JoinRequest(
            token=self._token, peer_id=p.peer_id, public_key=p.public_key, manifest_hash=p.manifest_hash,
            archive=p.archive, role=ROLE_MODES[p.role],
            capabilities=pb.Capabilities(device=p.device, memory_bytes=p.memory_bytes, tokens_per_s=p.tokens_per_s,
                                         upload_bps=p.upload_bps, download_bps=p.download_bps,
                                         multiaddrs=list(p.multiaddrs)),
        )
        if versions.writes("coordinator", "JoinRequest.peer_version"):
            request.peer_version = versions.RELEASE
            request.protocols.update(versions.stated_all())
        reply = self._calls.call(self._stub.Join, request)
        versions.unknown_proto_fields(reply)
        check_coordinator(reply)
        spec = reply.run_spec
        run = _checked_config(spec)
        info = JoinInfo(run, spec.run_config_hash, spec.lattice_hash, spec.manifest_hash, tuple(reply.initial_peers),
                        reply.lease.lease_id, reply.lease.duration_s, reply.lease.heartbeat_interval_s,
                        WorkAssignment.from_proto(reply.assignment), reply.rejoined, bytes(reply.credential),
                        bytes(spec.coordinator_public_key), reply.reachability, reply.reachable_addr,
                        reply.observed_addr, tuple(reply.relays))
        with self._lock:
            self.joined = info
            self.assignment_version = info.assignment.version
            self._credential = info.credential
        self._answered_now()
        log.info("joined run %s: %s (%s)", run.run_id, info.assignment.label(), info.assignment.reason)
        return info

    def heartbeat(
        self,
        progress: Sequence[Progress] = (),
        tokens_per_s: float = 0.0,
        bytes_sent: int = 0,
        bytes_received: int = 0,
        preempting: bool = False,
        seeded_paths: Optional[Sequence[str]] = None,
        evaluations: Sequence[Evaluation] = (),
        measured: bool = False,
        capacity: float = 0.0,
        link_bps: tuple[float, float] = (0.0, 0.0),
        exchange_overhead_s: float = 0.0,
    ) -> HeartbeatReply:
        """Renew the lease; re-joins transparently when the coordinator answers NOT_FOUND.
        ``seeded_paths``: the paths whose shards this peer seeds (None: it does not say).
        ``evaluations``: validation bits per byte per path (an archive peer's; others are refused).
        ``measured``: ``tokens_per_s`` is a measurement, 0 included (a stage server's or trainer's
        served tokens/s); ``capacity``: a stage server's tokens/s at full load (0: unknown).
        ``link_bps``: upload and download bytes/s measured from our averaging rounds (0: not yet);
        ``exchange_overhead_s``: what a round's exchanges block us beyond their bytes at those rates
        (0: not yet)."""
        if self.joined is None:
            return self._rejoin()
        request = pb.HeartbeatRequest(
            lease_id=self.joined.lease_id, peer_id=self.peer.peer_id if self.peer else "",
            progress=[pb.ModuleProgress(module_id=p.module_id, round=p.round, tokens=p.tokens, loss=p.loss)
                      for p in progress],
            assignment_version=self.assignment_version, tokens_per_s=tokens_per_s, bytes_sent=bytes_sent,
            bytes_received=bytes_received, preempting=preempting, tokens_per_s_measured=measured,
            capacity_tokens_per_s=capacity,
            evaluations=[pb.PathEvaluation(path=list(e.path), bpb=e.bpb, round=e.round) for e in evaluations],
        )
        if versions.writes("coordinator", "HeartbeatRequest.peer_version"):
            request.peer_version = versions.RELEASE
        if versions.writes("coordinator", "HeartbeatRequest.measured_upload_bps"):
            request.measured_upload_bps, request.measured_download_bps = link_bps
        if versions.writes("coordinator", "HeartbeatRequest.measured_exchange_overhead_s"):
            request.measured_exchange_overhead_s = exchange_overhead_s
        if seeded_paths is not None:
            request.seeds_data = True
            request.seeded_paths.extend(seeded_paths)
        try:
            reply = self._send_heartbeat(request)
        except NotFound:
            log.info("the coordinator does not know our lease any more; joining again")
            self.in_contact_since = None  # our lease lapsed: we were out of touch
            return self._rejoin()
        except Exception:
            self.in_contact_since = None  # a heartbeat failed: our contact with the coordinator broke
            raise
        self._answered_now()
        assignment = WorkAssignment.from_proto(reply.assignment) if reply.HasField("assignment") else None
        with self._lock:
            if assignment is not None:
                self.assignment_version = assignment.version
            if reply.credential:
                self._credential = bytes(reply.credential)
        return HeartbeatReply(reply.lease_remaining_s, assignment, reply.drain, reply.drain_reason,
                              credential=bytes(reply.credential), required_version=reply.required_version,
                              plans=tuple(ExchangePlan.from_proto(p) for p in reply.plans))

    def _rejoin(self) -> HeartbeatReply:
        """A heartbeat's re-join, unless :meth:`leave` has been called (then
        :class:`~peer.coordinator_client.calls.Closed`)."""
        with self._session_lock:
            if self._left.is_set():
                raise Closed("this peer has left the run; it does not join again")
            info = self.join()
        return HeartbeatReply(info.lease_duration, info.assignment, False, rejoined=True, join=info)

    def _answered_now(self) -> None:
        now = time.monotonic()
        if self.in_contact_since is None or self.answered_at is None or now - self.answered_at > self._contact_gap():
            self.in_contact_since = now  # (again) in touch from now: a heartbeat retried through a cut ends here
        self.answered_at = now

    def _contact_gap(self) -> float:
        """Seconds without an answer that break our contact: three heartbeat intervals, and one more second."""
        return 3 * self._heartbeat_every() + 1.0

    def _heartbeat_every(self) -> float:
        """Seconds between heartbeats: the coordinator's interval once joined, 5 before."""
        return self.joined.heartbeat_interval if self.joined is not None else 5.0

    def contact_since(self) -> Optional[float]:
        """Since when (monotonic) the coordinator has answered us without a break (no gap longer than
        three heartbeat intervals), or None while it does not."""
        if self.answered_at is None or time.monotonic() - self.answered_at > self._contact_gap():
            return None
        return self.in_contact_since

    @property
    def credential(self) -> bytes:
        """This peer's current admission credential (empty before the first join); heartbeats renew it.
        Pass ``lambda: client.credential`` wherever a credential provider is asked for."""
        with self._lock:
            return self._credential

    def report_peer(self, suspect_peer_id: str, module_id: str, round_no: int, reason: str) -> tuple[bool, str]:
        """Report ``suspect_peer_id`` for misbehaving in ``module_id``'s round ``round_no``; returns
        ``(banned, why)``. Blocks (with retries); the averager's ``on_suspect`` hook wants
        :meth:`report_peer_later`."""
        if self.joined is None or self.peer is None:
            raise HivepathError("report_peer needs a joined client")
        reply = self._calls.call(self._stub.ReportPeer, pb.ReportPeerRequest(
            lease_id=self.joined.lease_id, peer_id=self.peer.peer_id, suspect_peer_id=suspect_peer_id,
            module_id=module_id, round=round_no, reason=reason[:256]))
        return reply.banned, reply.reason

    def report_peer_later(self, suspect_peer_id: str, module_id: str, round_no: int, reason: str) -> None:
        """:meth:`report_peer` in the background (never blocks the training loop); the outcome is
        logged. Signature-compatible with ``NetAverager(on_suspect=...)``."""
        self._in_background(lambda: self.report_peer(suspect_peer_id, module_id, round_no, reason),
                            f"{suspect_peer_id} ({module_id} round {round_no})")

    def report_seeder(self, suspect_peer_id: str, manifest_hash: str, file: str, reason: str) -> tuple[bool, str]:
        """Report a seeder of the run's dataset that sent bytes of ``file`` not matching the manifest;
        returns ``(banned, why)``. Blocks (with retries): fetchers want :meth:`report_seeder_later`."""
        if self.joined is None or self.peer is None:
            raise HivepathError("report_seeder needs a joined client")
        reply = self._calls.call(self._stub.ReportPeer, pb.ReportPeerRequest(
            lease_id=self.joined.lease_id, peer_id=self.peer.peer_id, suspect_peer_id=suspect_peer_id,
            manifest_hash=manifest_hash, file=file[:256], reason=reason[:256]))
        return reply.banned, reply.reason

    def report_seeder_later(self, suspect_peer_id: str, manifest_hash: str, file: str, reason: str) -> None:
        """:meth:`report_seeder` in the background (never blocks a fetch); the outcome is logged."""
        self._in_background(lambda: self.report_seeder(suspect_peer_id, manifest_hash, file, reason),
                            f"seeder {suspect_peer_id}")

    def _in_background(self, call: Callable[[], tuple[bool, str]], what: str) -> None:
        with self._lock:
            if self._reporter is None:
                from concurrent.futures import ThreadPoolExecutor

                self._reporter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coordinator-report")
            reporter = self._reporter

        def send() -> None:
            try:
                banned, why = call()
                log.log(logging.WARNING if banned else logging.INFO, "reported %s: %s", what, why)
            except Exception as e:  # the coordinator being down must not disturb training
                log.warning("could not report %s: %s", what, e)

        try:
            reporter.submit(send)
        except RuntimeError:  # closed
            log.debug("client closed; report of %s dropped", what)

    def ban(self, peer_id: str, reason: str = "") -> str:
        """Operator: ban ``peer_id``; returns its state."""
        request = pb.BanRequest(token=self._token, peer_id=peer_id, reason=reason[:256])
        return self._calls.call(self._stub.Ban, request).state

    def unban(self, peer_id: str) -> str:
        """Operator: lift the ban on ``peer_id``; returns its state."""
        return self._calls.call(self._stub.Unban, pb.UnbanRequest(token=self._token, peer_id=peer_id)).state

    def leave(self, reason: str = "") -> None:
        """Give the lease back (best effort: a missing lease is already gone). Heartbeats stop joining
        from here on; a re-join already under way finishes first and its lease is the one given back."""
        self._left.set()
        with self._session_lock:
            self._leave(reason)

    def _leave(self, reason: str) -> None:
        if self.joined is None:
            return
        try:
            self._calls.call(self._stub.Leave, pb.LeaveRequest(lease_id=self.joined.lease_id, peer_id=self.peer.peer_id,
                                                         reason=reason[:256]), retry_not_found=False)
        except NotFound:
            pass
        self.joined = None
        self._drop_stream()

    def drain(self, peer_id: str, reason: str = "") -> str:
        """Operator: tell ``peer_id`` to drain; returns its state."""
        request = pb.DrainRequest(token=self._token, peer_id=peer_id, reason=reason)
        return self._calls.call(self._stub.Drain, request).state

    def status(self) -> dict[str, Any]:
        """The coordinator's Status as plain data (peers, modules, paths, totals)."""
        r = self._calls.call(self._stub.Status, pb.StatusRequest(token=self._token))
        peers = []
        for p in r.peers:
            a = WorkAssignment.from_proto(p.assignment) if p.HasField("assignment") else None
            peers.append({"peer_id": p.peer_id, "device": p.device, "state": p.state, "tokens_per_s": p.tokens_per_s,
                          "memory_bytes": p.memory_bytes, "work": a.label() if a else "",
                          "mode": a.mode if a else "", "path": list(a.path) if a else [],
                          "tokens": p.tokens,
                          "bytes_exchanged": p.bytes_exchanged, "last_seen_age_s": p.last_seen_age_s,
                          "version": p.version})
        return {
            "run_id": r.run_id, "run_config_hash": r.run_config_hash, "live_leases": r.live_leases,
            "total_tokens_per_s": r.total_tokens_per_s, "bytes_exchanged": r.bytes_exchanged, "peers": peers,
            "modules": [{"module_id": m.module_id, "holders": list(m.holders), "round": m.round,
                         "tokens_per_s": m.tokens_per_s} for m in r.modules],
            "paths": [{"path": list(p.path), "peers": list(p.peers), "tokens_per_s": p.tokens_per_s,
                       "loss": p.loss if p.loss == p.loss else None, "seeders": p.seeders} for p in r.paths],
        }

    # -- background heartbeats ----------------------------------------------------------------

    def start_heartbeats(
        self,
        report: Callable[[], dict[str, Any]],
        on_reply: Callable[[HeartbeatReply], None],
        interval: Optional[float] = None,
    ) -> threading.Thread:
        """Heartbeat in a daemon thread until :meth:`close`: ``report()`` returns heartbeat keyword
        arguments, ``on_reply`` receives each reply. While the coordinator is down the thread keeps
        retrying (with backoff) and the caller keeps training; nothing here blocks the caller."""

        def loop() -> None:
            while not self._closed.is_set() and not self._left.is_set():
                every = interval or self._heartbeat_every()
                try:
                    on_reply(self.heartbeat(**report()))
                except (CoordinatorUnavailable, Closed):
                    if self._left.is_set():
                        break
                    log.warning("coordinator %s unreachable; still training, retrying", self.address)
                except VersionMismatch as e:  # a re-join refused: the run no longer takes this release
                    log.error("heartbeat refused: %s", e)
                    on_reply(HeartbeatReply(0.0, None, True, str(e), refused=True))
                except HivepathError as e:
                    log.error("heartbeat refused: %s", e)
                except Exception:
                    log.exception("heartbeat callback failed")
                self._closed.wait(every)

        self._thread = threading.Thread(target=loop, name="coordinator-heartbeat", daemon=True)
        self._thread.start()
        return self._thread

    def close(self) -> None:
        """Stop background heartbeats and close the channel (does not leave: call :meth:`leave` first)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.rpc_timeout + 1)
        if self._reporter is not None:
            self._reporter.shutdown(wait=True, cancel_futures=True)
        self._drop_stream()
        self._calls.close()

    # -- heartbeat transport --------------------------------------------------------------------

    def _send_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        """One heartbeat over the stream, or as a unary call (with retries) where the stream is
        unsupported, broken or stalled; raises :class:`~peer.coordinator_client.calls.NotFound` for an unknown lease."""
        with self._stream_lock:
            if self._use_stream and not self._closed.is_set():
                try:
                    if self._stream is None:
                        self._stream = HeartbeatStream(self._stub)
                    reply = self._stream.exchange(request, self.rpc_timeout)
                    self.heartbeats_sent["stream"] += 1
                    return reply
                except grpc.RpcError as e:
                    self._drop_stream()
                    code, detail = e.code(), e.details() or ""
                    if code == grpc.StatusCode.NOT_FOUND:
                        raise NotFound(detail) from None
                    if code == grpc.StatusCode.UNIMPLEMENTED:
                        log.warning("coordinator %s has no HeartbeatStream (an older version); heartbeating with "
                                    "unary calls", self.address)
                        self._use_stream = False
                    elif code not in RETRIABLE and code != grpc.StatusCode.CANCELLED:
                        raise refusal(code, detail, self.address) from None
                    else:
                        log.info("heartbeat stream to %s ended (%s); sending this heartbeat as a unary call",
                                 self.address, code.name)
                except StreamStalled as e:
                    self._drop_stream()
                    log.info("heartbeat stream to %s: %s; sending this heartbeat as a unary call", self.address, e)
        reply = self._calls.call(self._stub.Heartbeat, request, retry_not_found=False)
        self.heartbeats_sent["unary"] += 1
        return reply

    def _drop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    # -- bandwidth ----------------------------------------------------------------------------

    def measure_bandwidth(self, probe_bytes: int = PROBE_BYTES,
                          probe_timeout: float = 30.0) -> Optional[tuple[float, float]]:
        """Measure this peer's ``(upload_bps, download_bps)`` in bytes per second (the unit of
        :class:`PeerInfo` and the Join capabilities) by timing ``probe_bytes`` each way against the
        coordinator (``ProbeUpload``/``ProbeDownload``, authenticated by the run token).

        Busy coordinators (RESOURCE_EXHAUSTED) and transient failures are retried with backoff within
        ``probe_timeout``. Returns None, after one warning, when the coordinator does not support
        probes or they fail: the caller then reports bandwidth as not measured (0) or uses its flags."""
        deadline = time.monotonic() + probe_timeout
        attempt = 0
        while True:
            try:
                up = probe_upload(self._stub, self._token, probe_bytes, max(0.1, deadline - time.monotonic()))
                down = probe_download(self._stub, self._token, probe_bytes, max(0.1, deadline - time.monotonic()))
                log.info("measured bandwidth to %s: upload %.1f Mbit/s, download %.1f Mbit/s", self.address,
                         up * 8e-6, down * 8e-6)
                return up, down
            except grpc.RpcError as e:
                code, detail = e.code(), e.details() or ""
                delay = self._calls.rng.uniform(0, min(self._calls.backoff_max, self._calls.backoff_base * 2**attempt))
                attempt += 1
                if code in RETRIABLE and code != grpc.StatusCode.DEADLINE_EXCEEDED and \
                        time.monotonic() + delay < deadline and not self._closed.wait(delay):
                    continue
                why = ("it does not support bandwidth probes (an older version)"
                       if code == grpc.StatusCode.UNIMPLEMENTED else f"{code.name}: {detail}")
            except ProbeFailed as e:
                why = str(e)
            log.warning("could not measure bandwidth against coordinator %s (%s); reporting it as not measured",
                        self.address, why)
            return None


def _checked_config(spec: pb.RunSpec) -> RunConfig:
    run = RunConfig.from_json(spec.run_config_json)
    if run.content_hash() != spec.run_config_hash:
        raise IncompatibleRun(
            f"the run spec hashes to {run.content_hash()} here but {spec.run_config_hash} at the coordinator; "
            "update hivepath to the coordinator's version"
        )
    return run
