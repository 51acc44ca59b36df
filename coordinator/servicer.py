"""The gRPC face of the coordinator: checks the token and every field, translates protos into
:class:`coordinator.core.Coordinator` calls, and maps refusals to status codes.

=========================================  ===================
wrong or missing run token                  UNAUTHENTICATED
unknown or expired lease                    NOT_FOUND (re-join)
malformed or out-of-range field             INVALID_ARGUMENT
no work fits / data or version differs     FAILED_PRECONDITION
too many live leases or bandwidth probes    RESOURCE_EXHAUSTED
banned peer                                 PERMISSION_DENIED
=========================================  ===================

``HeartbeatStream`` carries Heartbeat's semantics on one long-lived stream per peer (a refusal ends
the stream with the same code); ``ProbeUpload``/``ProbeDownload`` are :mod:`coordinator.probe`.

Frames that are not messages never reach a method: :mod:`coordinator.wire` refuses them (on a stream,
``context.read()`` raises :class:`coordinator.wire.MalformedRequest`, a :class:`RequestError`, mapped
like any other). Anything else is a bug: it is logged with its traceback and answered INTERNAL.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import math
from concurrent.futures import Executor
from typing import Any, Awaitable, Callable, Optional

import grpc

from coordinator.core import Coordinator, ProgressReport
from coordinator.errors import InvalidArgument, RequestError, Unauthenticated, VersionRefused
from coordinator.probe import ProbeService
from coordinator.reachability import dial_back, observed_host
from coordinator.results import PathEvaluation
from coordinator.records import MODE_ARCHIVE, MODE_PATH, MODE_STAGE, MODE_TRAINER, Assignment
from coordinator.status import snapshot
from coordinator.versions import MAX_PROTOCOLS, follows_plans, join_refusal, upgrade_reason
from coordinator.validation import (
    MAX_OVERHEAD_S,
    MAX_PROGRESS,
    MAX_PUBLIC_KEY,
    MAX_RATE,
    check_capabilities,
    check_lease_id,
    check_number,
    check_peer_id,
    check_text,
    check_unique,
)
from protos.hivepath.coordinator.v1 import coordinator_pb2 as pb
from protos.hivepath.coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from protos import versions

__all__ = ["CoordinatorServicer", "assignment_to_proto", "assignment_from_proto"]

log = logging.getLogger(__name__)

MAX_COUNT = 1 << 62
"""Largest round, token or byte count accepted."""


_MODES = {MODE_PATH: pb.MODE_PATH, MODE_STAGE: pb.MODE_STAGE, MODE_ARCHIVE: pb.MODE_ARCHIVE,
          MODE_TRAINER: pb.MODE_TRAINER}
_MODE_NAMES = {v: k for k, v in _MODES.items()}


def assignment_to_proto(a: Assignment) -> pb.Assignment:
    return pb.Assignment(
        mode=_MODES[a.mode], path=list(a.path), module_id=a.module_id,
        module_ids=list(a.module_ids), inner_steps=a.inner_steps, codec=a.codec, reason=a.reason, version=a.version,
    )


def assignment_from_proto(m: pb.Assignment) -> Assignment:
    return Assignment(
        mode=_MODE_NAMES.get(m.mode, MODE_STAGE), path=tuple(m.path), module_id=m.module_id,
        module_ids=tuple(m.module_ids), inner_steps=m.inner_steps, codec=m.codec, reason=m.reason, version=m.version,
    )


def _rpc(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Map :class:`RequestError` to its status code; anything else is logged and answered INTERNAL."""

    @functools.wraps(method)
    async def wrapper(self: "CoordinatorServicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except RequestError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            log.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"coordinator bug: {type(e).__name__}")

    return wrapper


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Implements ``hivepath.coordinator.v1.Coordinator`` on top of one :class:`Coordinator`."""

    def __init__(self, coord: Coordinator, token: str, executor: Optional[Executor] = None):
        if not token:
            raise ValueError("the coordinator needs a run token")
        self.coord = coord
        self._token = token.encode("utf-8")
        self._executor = executor
        self._probes = ProbeService(self._authorize, on_done=lambda: coord.count("bandwidth_probes"))

    def _authorize(self, token: str) -> None:
        if not token:
            raise Unauthenticated("token: missing; pass the run token (--token, --token-file or HIVEPATH_TOKEN)")
        if not hmac.compare_digest(token.encode("utf-8", "surrogatepass"), self._token):
            raise Unauthenticated("token: wrong run token; ask the run's operator for the token")

    async def _blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a call that waits for a durable commit off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    @_rpc
    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinResponse:
        self._authorize(request.token)
        peer_id = check_peer_id(request.peer_id)
        if len(request.public_key) > MAX_PUBLIC_KEY:
            raise InvalidArgument("public_key", f"is {len(request.public_key)} bytes, the limit is {MAX_PUBLIC_KEY}")
        c = request.capabilities
        if not request.HasField("capabilities"):
            raise InvalidArgument("capabilities", "is required (device, memory_bytes, tokens_per_s)")
        caps = check_capabilities(c.device, c.memory_bytes, c.tokens_per_s, c.upload_bps, c.download_bps,
                                  list(c.multiaddrs), trains=not request.archive)
        manifest = check_text("manifest_hash", request.manifest_hash, 64)
        peer_version = self._check_version(request)
        reach = await dial_back(caps.multiaddrs, observed_host(context.peer() or ""))
        role = {pb.MODE_UNSPECIFIED: "", pb.MODE_PATH: MODE_PATH, pb.MODE_STAGE: MODE_STAGE,
                pb.MODE_TRAINER: MODE_TRAINER}.get(request.role)
        if role is None or (role and request.archive):
            raise InvalidArgument("role", f"{request.role} is not a role a training peer may ask for (path, stage, "
                                          "trainer)")
        result = await self._blocking(self.coord.join, peer_id, bytes(request.public_key), caps, manifest,
                                      request.archive, reach, role, follows_plans(request.protocols))
        self.coord.peer_versions.note(peer_id, peer_version)
        s = self.coord.settings
        return pb.JoinResponse(
            run_spec=self._run_spec(),
            initial_peers=result.initial_peers,
            lease=pb.Lease(lease_id=result.lease.lease_id, duration_s=s.lease_timeout,
                           heartbeat_interval_s=s.heartbeat_interval),
            assignment=assignment_to_proto(result.assignment),
            rejoined=result.rejoined,
            credential=result.credential,
            reachability=reach.state,
            reachable_addr=reach.addr,
            observed_addr=reach.observed,
            relays=result.relays,
            coordinator_version=versions.RELEASE,
            protocols=versions.stated_all(),
        )

    def _check_version(self, request: pb.JoinRequest) -> str:
        """The release a joining peer states; :class:`VersionRefused` for one of another major of a
        contract or below ``min_peer_version`` (:func:`coordinator.versions.join_refusal`)."""
        versions.unknown_proto_fields(request)
        peer_version = check_text("peer_version", request.peer_version, 64)
        if len(request.protocols) > MAX_PROTOCOLS:
            raise InvalidArgument("protocols", f"{len(request.protocols)} entries, the limit is {MAX_PROTOCOLS}")
        for name, version in request.protocols.items():
            check_text("protocols", name, 32)
            check_text(f"protocols[{name}]", version, 16)
        why = join_refusal(peer_version, request.protocols, self.coord.settings.min_peer_version)
        if why:
            self.coord.count("rejected_version")
            log.info("refused %s at join: %s", request.peer_id, why)
            raise VersionRefused(why)
        return peer_version

    def _run_spec(self) -> pb.RunSpec:
        c = self.coord
        return pb.RunSpec(run_config_json=c.run_json, run_config_hash=c.run_hash, lattice_hash=c.lattice_hash,
                          manifest_hash=c.run.data.manifest_hash, coordinator_public_key=c.issuer.public_key)

    @_rpc
    async def GetRunSpec(self, request: pb.GetRunSpecRequest,
                         context: grpc.aio.ServicerContext) -> pb.GetRunSpecResponse:
        self._authorize(request.token)
        return pb.GetRunSpecResponse(run_spec=self._run_spec(), initial_peers=self.coord.initial_peers())

    @_rpc
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        reply = pb.HeartbeatResponse()
        await self._heartbeat(request, reply)
        return reply

    @_rpc
    async def HeartbeatStream(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        """Heartbeat's semantics over one long-lived stream: each request gets one reply, in order; a
        refusal ends the stream with Heartbeat's status code."""
        self.coord.count("heartbeat_streams")
        read, write, EOF = context.read, context.write, grpc.aio.EOF
        while True:
            message = await read()
            if message is EOF:
                return
            out = pb.HeartbeatStreamResponse()
            await self._heartbeat(message.heartbeat, out.heartbeat)
            await write(out)

    async def _heartbeat(self, request: pb.HeartbeatRequest, reply: pb.HeartbeatResponse) -> None:
        """Validate one heartbeat, apply it and fill ``reply``; raises :class:`RequestError`."""
        lease_id = check_lease_id(request.lease_id)
        peer_id = check_peer_id(request.peer_id)
        progress = []
        if request.progress:
            if len(request.progress) > MAX_PROGRESS:
                raise InvalidArgument("progress", f"{len(request.progress)} entries, the limit is {MAX_PROGRESS}")
            check_unique("progress.module_id", (p.module_id for p in request.progress))
            for p in request.progress:
                check_text("progress.module_id", p.module_id, 64, allow_empty=False)
                if p.round > MAX_COUNT or p.tokens > MAX_COUNT:
                    raise InvalidArgument("progress", f"round or tokens of {p.module_id} beyond {MAX_COUNT}")
                if not math.isfinite(p.loss) or p.loss < 0:
                    raise InvalidArgument("progress.loss", f"{p.loss} for {p.module_id} is not a finite loss >= 0")
                progress.append(ProgressReport(p.module_id, p.round, p.tokens, p.loss))
        tokens_per_s = request.tokens_per_s
        if tokens_per_s or request.tokens_per_s_measured:
            check_number("tokens_per_s", tokens_per_s, 0.0, MAX_RATE)
        capacity = request.capacity_tokens_per_s
        if capacity:
            check_number("capacity_tokens_per_s", capacity, 0.0, MAX_RATE)
        link_bps = (request.measured_upload_bps, request.measured_download_bps)
        check_number("measured_upload_bps", link_bps[0], 0.0, MAX_RATE)
        check_number("measured_download_bps", link_bps[1], 0.0, MAX_RATE)
        overhead = request.measured_exchange_overhead_s
        check_number("measured_exchange_overhead_s", overhead, 0.0, MAX_OVERHEAD_S)
        if request.bytes_sent > MAX_COUNT or request.bytes_received > MAX_COUNT:
            raise InvalidArgument("bytes_sent", f"byte counts beyond {MAX_COUNT}")
        coord = self.coord
        seeded = None
        if request.seeds_data:
            seeded = coord.check_seeded_paths(list(request.seeded_paths))
        evaluations = [PathEvaluation(tuple(e.path), e.bpb, e.round) for e in request.evaluations]
        coord.check_evaluations(evaluations)
        if request.peer_version:
            coord.peer_versions.note(peer_id, check_text("peer_version", request.peer_version, 64))
        if request.preempting:
            result = await self._blocking(
                coord.heartbeat, lease_id, peer_id, progress, request.assignment_version, tokens_per_s,
                request.bytes_sent + request.bytes_received, True, seeded, evaluations,
                request.tokens_per_s_measured, capacity, link_bps, overhead,
            )
        else:
            result = coord.heartbeat(lease_id, peer_id, progress, request.assignment_version, tokens_per_s,
                                     request.bytes_sent + request.bytes_received, False, seeded, evaluations,
                                     request.tokens_per_s_measured, capacity, link_bps, overhead)
        reply.lease_remaining_s = result.lease_remaining
        least = coord.settings.min_peer_version
        upgrade = upgrade_reason(coord.peer_versions.get(peer_id), least)
        if upgrade:  # the run now requires a newer release than this peer's: it drains and exits 7
            if not result.drain:
                await self._blocking(coord.drain, peer_id, upgrade)
                coord.count("drained_version")
            reply.drain, reply.drain_reason, reply.required_version = True, upgrade, least
        elif result.drain or result.drain_reason:
            reply.drain = result.drain
            reply.drain_reason = result.drain_reason
        if result.credential:
            reply.credential = result.credential
        if result.assignment is not None:
            reply.assignment.CopyFrom(assignment_to_proto(result.assignment))
        for plan in result.plans:
            reply.plans.add(module_id=plan.module_id, inner_steps=plan.inner_steps, codec=plan.codec,
                            from_round=plan.from_round, reason=plan.reason, overlap=plan.overlap)

    @_rpc
    async def ProbeUpload(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> pb.ProbeUploadResponse:
        return await self._probes.upload(context)

    @_rpc
    async def ProbeDownload(self, request: pb.ProbeDownloadRequest, context: grpc.aio.ServicerContext) -> None:
        await self._probes.download(request, context)

    @_rpc
    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        lease_id = check_lease_id(request.lease_id)
        peer_id = check_peer_id(request.peer_id)
        reason = check_text("reason", request.reason)
        await self._blocking(self.coord.leave, lease_id, peer_id, reason)
        return pb.LeaveResponse()

    @_rpc
    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        self._authorize(request.token)
        peer_id = check_peer_id(request.peer_id)
        reason = check_text("reason", request.reason)
        state = await self._blocking(self.coord.drain, peer_id, reason)
        return pb.DrainResponse(state=state)

    @_rpc
    async def ReportPeer(self, request: pb.ReportPeerRequest,
                         context: grpc.aio.ServicerContext) -> pb.ReportPeerResponse:
        lease_id = check_lease_id(request.lease_id)
        peer_id = check_peer_id(request.peer_id)
        suspect = check_peer_id(request.suspect_peer_id, "suspect_peer_id")
        if request.manifest_hash:  # a seeder that sent bad bytes of the run's dataset
            manifest = check_text("manifest_hash", request.manifest_hash, 64, allow_empty=False)
            file = check_text("file", request.file, 256, allow_empty=False)
            reason = check_text("reason", request.reason)
            result = await self._blocking(self.coord.report_seeder, lease_id, peer_id, suspect, manifest, file,
                                          request.round, reason)
            return pb.ReportPeerResponse(banned=result.banned, reason=result.reason)
        module_id = check_text("module_id", request.module_id, 64, allow_empty=False)
        if request.round > MAX_COUNT:
            raise InvalidArgument("round", f"{request.round} is beyond {MAX_COUNT}")
        reason = check_text("reason", request.reason)
        result = await self._blocking(self.coord.report, lease_id, peer_id, suspect, module_id, request.round, reason)
        return pb.ReportPeerResponse(banned=result.banned, reason=result.reason)

    @_rpc
    async def Ban(self, request: pb.BanRequest, context: grpc.aio.ServicerContext) -> pb.BanResponse:
        self._authorize(request.token)
        peer_id = check_peer_id(request.peer_id)
        reason = check_text("reason", request.reason)
        return pb.BanResponse(state=await self._blocking(self.coord.ban, peer_id, reason))

    @_rpc
    async def Unban(self, request: pb.UnbanRequest, context: grpc.aio.ServicerContext) -> pb.UnbanResponse:
        self._authorize(request.token)
        peer_id = check_peer_id(request.peer_id)
        return pb.UnbanResponse(state=await self._blocking(self.coord.unban, peer_id))

    @_rpc
    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        self._authorize(request.token)
        snap = await self._blocking(snapshot, self.coord)
        reply = pb.StatusResponse(
            run_id=snap["run_id"], run_config_hash=snap["run_config_hash"], total_tokens_per_s=snap["total_tokens_per_s"],
            bytes_exchanged=snap["bytes_exchanged"], live_leases=snap["live_leases"],
        )
        for p in snap["peers"]:
            row = reply.peers.add(
                peer_id=p["peer_id"], device=p["device"], state=p["state"], tokens_per_s=p["tokens_per_s"],
                memory_bytes=p["memory_bytes"], last_seen_age_s=p["last_seen_age_s"], tokens=p["tokens"],
                bytes_exchanged=p["bytes_exchanged"], version=p["version"],
            )
            if p["assignment"]:
                row.assignment.CopyFrom(assignment_to_proto(Assignment.from_dict(p["assignment"])))
        for m in snap["modules"]:
            reply.modules.add(module_id=m["module_id"], holders=m["holders"], round=m["round"],
                              tokens_per_s=m["tokens_per_s"])
        for p in snap["paths"]:
            reply.paths.add(path=p["path"], peers=p["peers"], tokens_per_s=p["tokens_per_s"],
                            loss=float("nan") if p["loss"] is None else p["loss"], seeders=p["seeders"])
        return reply
