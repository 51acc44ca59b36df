"""Joining mid-run: a newcomer fetches a module's global params, outer momentum and round number
from a peer that holds it, over P2P. The coordinator never carries weights (see DESIGN.md).

Holder side: :class:`StateServer` answers ``{prefix}_state`` streams with a
:class:`protos.hivepath.peer.v1.net_pb2.StateReply` header and a safetensors blob (``p.{i}``: global params,
``m.{i}``: outer momentum), refusing a requester whose config hash differs from ours.
Newcomer side: :func:`fetch_module_state` tries the module's holders and archive peers (from their
DHT records, same config hash, most advanced round first) until one answers, and checks what it
received.

Through a relay: a relay between private addresses resets each relayed connection after
128 KiB (``peer.network.relays``), less than a module's state. A transfer cut short resumes: the
newcomer keeps the bytes it has and asks again from that offset, for the same state (its digest); the
next dial opens a new relayed connection. The holder keeps the last state it packed of each module
(:data:`KEPT_SECONDS`) so that every piece comes from one state, and the whole is checked against the
digest of the first reply.

Admission: with a ``verifier`` the holder refuses a requester whose credential is not
bound to its libp2p peer id, and the newcomer only asks sources whose DHT records carry a valid
credential. Requests larger than :data:`MAX_REQUEST_BYTES` are refused unread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional, Sequence

from torch import Tensor

from peer.network import CredentialProvider, CredentialVerifier
from peer.outer import ModuleState
from peer.network.frames import (MESSAGE_LIMIT, STREAM_CUT, MalformedFrame, handler_name, linger, log_limited,
                                 read_message, read_payload_into, serve)
from protos.hivepath.peer.v1.net_pb2 import DESCRIPTOR as NET, StateReply, StateRequest
from peer.network import ArchiveRecord, HolderRecord, archive_key, holders_key, records_from_value

__all__ = ["StateServer", "StateProvider", "fetch_module_state", "StateTransferError", "MAX_REQUEST_BYTES"]

log = logging.getLogger(__name__)

REPLY_TIMEOUT = 5.0
"""Seconds a holder gets to answer a state request (the reply that announces the state), plus one per
GB of the state it packs first; the state's bytes then get what is left of the fetch's timeout."""

MAX_REQUEST_BYTES = 4096
"""A state request is a module id, a hash and a credential: anything larger is refused unread."""

MAX_STATE_BYTES = 1 << 40
"""The most bytes of state accepted from a holder when the module's shapes are not known in advance."""

STATE = NET.services_by_name["Averaging"].methods_by_name["State"]
"""The ``State`` rpc of ``net.proto``: a module's state from a holder."""

RESUMES = 64
"""Times one transfer may be cut and resumed before the source is given up (a 1 MB state through a
relay that resets every 128 KiB takes 8); three pieces in a row without new bytes give it up too."""

KEPT_SECONDS = 120.0
"""Seconds a holder keeps a packed state for transfers that resume (a relay's resets, a slow link)."""

_JOINER_MEMORY = 600.0
"""Seconds a holder remembers who fetched a module's state to average it (longer than any wait on them)."""

StateProvider = Callable[[str], Optional[ModuleState]]
"""``module_id -> ModuleState`` of a module this peer holds (e.g. ``DiLoCoOptimizer.module_state``),
or None when it does not hold it."""


class StateTransferError(RuntimeError):
    """No holder could send a valid state for the module."""


def _pack(state: ModuleState) -> bytes:
    """The wire format of a state (not a disk layout): ``p.{i}`` global params, ``m.{i}`` momentum."""
    from models.checkpoint import pack_tensors

    tensors = {f"p.{i}": t for i, t in enumerate(state.global_params)}
    tensors.update({f"m.{i}": t for i, t in enumerate(state.momentum)})
    return pack_tensors(tensors)


def _unpack(blob: bytes, round_no: int, like: Optional[Sequence[Tensor]]) -> ModuleState:
    from models.checkpoint import unpack_tensors

    tensors = unpack_tensors(blob)
    n = sum(1 for k in tensors if k.startswith("p."))
    expected_keys = {f"p.{i}" for i in range(n)} | {f"m.{i}" for i in range(n)}
    if set(tensors) != expected_keys:
        raise ValueError(f"state holds tensors {sorted(tensors)[:6]}..., expected p.0..p.{n - 1} and m.0..m.{n - 1}")
    params = [tensors[f"p.{i}"] for i in range(n)]
    momentum = [tensors[f"m.{i}"] for i in range(n)]
    for p, m in zip(params, momentum):
        if p.shape != m.shape:
            raise ValueError(f"momentum shape {tuple(m.shape)} differs from parameter shape {tuple(p.shape)}")
    if like is not None:
        shapes = [tuple(t.shape) for t in like]
        if [tuple(p.shape) for p in params] != shapes:
            raise ValueError("parameter shapes differ from this peer's module")
    return ModuleState(params, momentum, round_no)


class StateServer:
    """Serves the states of the modules this peer holds (register on this process's P2P)."""

    def __init__(self, p2p: Any, config_hash: str, prefix: str, provider: Optional[StateProvider] = None,
                 verifier: Optional[CredentialVerifier] = None):
        self.p2p = p2p
        self.verifier = verifier
        self.served = 0
        """States sent so far (a refused request never counts)."""
        self.config_hash = config_hash
        self.prefix = prefix
        self.handler_name = handler_name(prefix, STATE)
        self.provider = provider
        self._joiners: dict[str, dict[str, tuple[int, float]]] = {}
        """module -> peer that fetched it to average it -> (the round we sent, when)."""
        self._packed: dict[str, tuple[str, int, bytes]] = {}
        """module -> (digest, round, the packed state): the last state sent of each module,
        kept :data:`KEPT_SECONDS` for transfers that resume (one per module: a newer one replaces it)."""

    def joiners(self, module_id: str, within: float) -> dict[str, int]:
        """Peers that fetched ``module_id`` from us in the last ``within`` seconds to average it (newcomers,
        re-syncing members; not archives): peer -> the round of the state we sent. They are about to
        declare that round, possibly before their holder record is visible: matchmaking waits for them."""
        now = time.monotonic()
        return {p: r for p, (r, t) in self._joiners.get(module_id, {}).items() if now - t < within}

    def _served_to(self, module_id: str, peer: str, round_no: int) -> None:
        now = time.monotonic()
        peers = self._joiners.setdefault(module_id, {})
        for p in [p for p, (_, t) in peers.items() if now - t > _JOINER_MEMORY]:
            del peers[p]
        peers[peer] = (round_no, now)

    async def start(self) -> None:
        await serve(self.p2p, self.prefix, STATE, self._handle)

    async def _handle(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from hivemind.p2p import P2P

        request = await read_message(reader, StateRequest, MAX_REQUEST_BYTES)
        if request is None:
            return
        blob, reply = b"", StateReply(ok=False)
        sender = stream_info.peer_id.to_base58()
        problem = self.verifier.check(request.credential, sender) if self.verifier is not None else ""
        if problem:
            reply.error = f"not admitted: {problem}"
            self.verifier.log_refusal(sender, f"a state request for {request.module_id[:64]!r}", problem)
        elif request.config_hash != self.config_hash:
            reply.error = f"config hash {request.config_hash} differs from the holder's {self.config_hash}"
            log_limited(log, "state:config", "refusing state of %s to %s: %s", request.module_id[:64], sender, reply.error)
        else:
            blob, reply = await self._state(request)
            if reply.ok and request.joining and not request.offset:
                self._served_to(request.module_id, sender, int(reply.round_no))
        await P2P.send_protobuf(reply, writer)
        await P2P.send_raw_data(blob, writer)
        await linger(reader, 60.0)

    def _forget(self, module_id: str, digest: str) -> None:
        if self._packed.get(module_id, ("",))[0] == digest:
            del self._packed[module_id]

    async def _state(self, request: StateRequest) -> tuple[Any, StateReply]:
        """The bytes to send (the state's, from ``request.offset``) and the reply announcing them."""
        import hashlib

        if request.offset:  # a transfer cut short resumes: the same state, or none
            kept = self._packed.get(request.module_id)
            if kept is None or kept[0] != request.digest or request.offset > len(kept[2]):
                return b"", StateReply(ok=False, error=f"the state {request.digest[:16]} of {request.module_id} is no "
                                                        "longer kept here (a newer round replaced it): start again")
            digest, round_no, blob = kept
            return (memoryview(blob)[request.offset:],
                    StateReply(ok=True, round_no=round_no, payload_len=len(blob) - request.offset,
                               total_len=len(blob), digest=digest))
        state = self.provider(request.module_id) if self.provider is not None else None
        if state is None:
            return b"", StateReply(ok=False, error=f"this peer does not hold {request.module_id}")
        blob = await asyncio.get_running_loop().run_in_executor(None, _pack, state)
        digest = hashlib.sha256(blob).hexdigest()
        self._packed[request.module_id] = (digest, int(state.round_no), blob)
        asyncio.get_running_loop().call_later(KEPT_SECONDS, self._forget, request.module_id, digest)
        self.served += 1
        return blob, StateReply(ok=True, round_no=int(state.round_no), payload_len=len(blob), total_len=len(blob),
                                digest=digest)


async def fetch_module_state(dht: Any, p2p: Any, run_id: str, module_id: str, config_hash: str, prefix: str,
                             own_peer_id: str, timeout: float, like: Optional[Sequence[Tensor]] = None,
                             credential: Optional[CredentialProvider] = None,
                             verifier: Optional[CredentialVerifier] = None,
                             accept: Optional[Callable[[ModuleState], str]] = None,
                             min_round: int = -1, joining: bool = True) -> ModuleState:
    """Fetch ``module_id``'s state from a live holder with our config hash (most advanced round first);
    ``credential`` is presented to holders, ``verifier`` keeps only admitted sources, and ``accept``
    (a state -> '' or why it is not wanted) makes us try the next holder, e.g. to adopt one side of a fork.
    Holders whose record announces a round below ``min_round`` are not asked at all. ``joining``: we will
    average the module from this state (the holder then expects us at its round); False for an archive.

    A holder must answer within :data:`REPLY_TIMEOUT` (the state's bytes may take the rest of
    ``timeout``): one that is cut off must not use up the whole budget of a re-sync."""
    deadline = time.monotonic() + timeout
    found, archived = await asyncio.gather(
        dht.get(holders_key(run_id, module_id), latest=True, return_future=True),
        dht.get(archive_key(run_id, module_id), latest=True, return_future=True),
    )
    sources = {**records_from_value(archived, ArchiveRecord, verifier),
               **records_from_value(found, HolderRecord, verifier)}
    own = credential() if credential is not None else b""
    candidates = sorted(((h.round_no, p) for p, h in sources.items()
                         if p != own_peer_id and h.config_hash == config_hash and h.round_no >= min_round),
                        reverse=True)
    if not candidates:
        at = f" at round {min_round} or later" if min_round >= 0 else ""
        raise StateTransferError(f"no live holder of {module_id}{at} with config hash {config_hash}")
    state_bytes = 2 * sum(t.numel() * 4 for t in like) if like is not None else 0  # params and momentum, fp32
    reply_timeout = REPLY_TIMEOUT + state_bytes / 1e9
    blob_limit = state_bytes + MESSAGE_LIMIT if like is not None else MAX_STATE_BYTES  # safetensors' header is small
    errors = []
    for round_no, peer in candidates:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            round_no, blob = await asyncio.wait_for(
                _transfer(p2p, peer, prefix, StateRequest(module_id=module_id, config_hash=config_hash, credential=own,
                                                          joining=joining), reply_timeout, blob_limit), left)
            state = await asyncio.get_running_loop().run_in_executor(None, _unpack, blob, round_no, like)
            unwanted = accept(state) if accept is not None else ""
            if unwanted:
                raise RuntimeError(unwanted)
            log.info("fetched %s at round %d from %s%s", module_id, round_no, peer,
                     f" (after {'; '.join(errors)})" if errors else "")
            state.source = peer
            return state
        except Exception as e:
            errors.append(f"{peer[-8:]}: {type(e).__name__}: {e}")
    raise StateTransferError(f"no holder sent a valid state of {module_id} ({'; '.join(errors) or 'timed out'})")


async def _transfer(p2p: Any, peer: str, prefix: str, request: StateRequest, reply_timeout: float,
                    limit: int) -> tuple[int, bytes]:
    """The round and the bytes of the state ``peer`` sends for ``request``, resumed from where it was cut
    (at most :data:`RESUMES` times, each piece bringing new bytes) and checked against its digest."""
    import hashlib

    from hivemind.p2p import P2P, PeerID

    received, total, digest, round_no, stalls = bytearray(), 0, "", 0, 0
    for piece in range(RESUMES + 1):
        if stalls > 2:
            break
        offset = len(received)
        request.offset, request.digest = offset, digest

        async def ask() -> tuple[Any, Any, Any, Any]:
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer),
                                                                     handler_name(prefix, STATE))
            try:
                await P2P.send_protobuf(request, writer)
                return (*await P2P.receive_protobuf(StateReply, reader), reader, writer)
            except BaseException:
                writer.close()
                raise

        try:
            reply, err, reader, writer = await asyncio.wait_for(ask(), reply_timeout)
        except Exception as e:  # a reset connection, a refused dial, a timeout
            if not offset and not isinstance(e, STREAM_CUT):
                raise  # nothing came yet, and asking this holder again would not help: the next holder
            log.debug("resuming %s from %s at byte %d failed: %s", request.module_id, peer[-8:], offset, e)
            stalls += 1
            continue  # the piece's new connection broke before its reply: a new dial
        try:
            if reply is None:
                raise RuntimeError(err.message)
            if not reply.ok:
                raise RuntimeError(reply.error)
            if not offset:
                total, digest, round_no = reply.total_len or reply.payload_len, reply.digest, int(reply.round_no)
                if total > limit:
                    raise MalformedFrame(f"state: {total} bytes announced, more than the {limit} expected")
            elif (reply.digest, reply.total_len) != (digest, total):
                raise RuntimeError("the holder resumed another state")
            complete = await read_payload_into(reader, received, total - offset)
        finally:
            writer.close()
        if complete:
            if digest and hashlib.sha256(received).hexdigest() != digest:
                raise RuntimeError(f"the state's {total} bytes do not match the digest {digest[:16]}")
            if piece:
                log.info("%s from %s came in %d pieces (%d bytes; its connections were cut, e.g. by a relay's "
                         "limit)", request.module_id, peer[-8:], piece + 1, total)
            return round_no, bytes(received)
        if not digest:
            raise RuntimeError(f"cut after {len(received)} of {total} bytes, and the holder cannot resume")
        stalls = 0 if len(received) > offset else stalls + 1
        log.debug("%s from %s cut after %d of %d bytes: resuming", request.module_id, peer[-8:], len(received), total)
    raise RuntimeError(f"cut {piece + 1} times, {len(received)} of {total} bytes received")
