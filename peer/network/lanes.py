"""Direct lanes: the all-reduce's bytes between two reachable peers over a TLS connection of their own.

Every byte hivemind's P2P carries crosses two p2p daemons (our stream to the local daemon over a unix
socket, the daemon's noise encryption and yamux framing, the same at the other end): a large share
of an outer step's exchange CPU, taken from training on a volunteer's machine (``bench.comm``'s
``cpu_s_per_mb`` measures it). A TLS 1.3 connection between the two processes carries the same
bytes, encrypted and authenticated, for less CPU per MB at each end (the wire and its streams:
:mod:`peer.network.lane_wire`).

A lane is opened over the p2p connection, which authenticates both peers:

1. the member asks the reducer for its lane (rpc ``Lane``, :class:`protos.hivepath.peer.v1.net_pb2.LaneOffer`):
   the addresses its lane listens on, the SHA-256 fingerprint of its lane's self-signed certificate
   (made at start, in memory only) and a token of 32 random bytes issued to this asker;
2. the member connects over TLS, checks that the certificate is the one offered (a wrong host, or
   someone in the middle, is refused before anything is sent), and sends the token: the reducer
   knows who it talks to, as it would from the p2p stream.

A peer's first lane is set up in the background: its streams go through P2P meanwhile, so an address
that does not answer (a firewall dropping the port) holds up no round. The member keeps idle
connections for the next streams to that peer (``lane_wire.IDLE_TIMEOUT``): a warm TCP window, no
handshake. A peer dialled only through a relay (behind NAT) offers no lane. Where a lane cannot be
had (no offer, no address that connects, a broken connection) the caller uses the p2p stream, and
asks that peer again after :data:`PAUSE`: a lane only ever saves CPU, never decides whether a round
works.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ipaddress
import logging
import os
import secrets
import ssl
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence

from peer.network.frames import handler_name, serve_messages
from peer.network.lane_wire import (_HELLO, HELLO_TIMEOUT, IDLE_TIMEOUT, TOKEN_BYTES, LaneConnection, LaneError,
                                    LaneReader, LaneWriter)
from protos.hivepath.peer.v1 import net_pb2
from protos.hivepath.peer.v1.net_pb2 import LaneOffer, LaneRequest

__all__ = ["DirectLanes", "LanePortError", "lane_hosts", "maddr_hosts", "PAUSE", "TOKEN_TTL"]

log = logging.getLogger(__name__)

LANE = net_pb2.DESCRIPTOR.services_by_name["Averaging"].methods_by_name["Lane"]

TOKEN_TTL = 600.0
"""Seconds a token is valid; a member asks again for a fresh offer when its token is this old."""
PAUSE = 60.0
"""Seconds a peer whose lane failed (no offer, no address connects, a connection broke) is reached
over P2P before its lane is tried again."""
CONNECT_TIMEOUT = 2.0
"""Seconds to connect and finish the TLS handshake to one offered address."""
OFFER_TIMEOUT = 5.0
"""Seconds to get a peer's offer over P2P."""


def maddr_hosts(maddrs: Sequence[Any]) -> list[str]:
    """The IP hosts of ``maddrs`` (``/ip4/H/tcp/P``, ``/ip6/H/tcp/P``; relayed addresses skipped),
    each once, in order: where a lane listens beside the DHT node (``0.0.0.0`` included)."""
    hosts: list[str] = []
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if "p2p-circuit" in parts or len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
            continue
        try:
            ipaddress.ip_address(parts[2])
        except ValueError:
            continue
        if parts[2] not in hosts:
            hosts.append(parts[2])
    return hosts


def lane_hosts(maddrs: Sequence[Any]) -> list[str]:
    """:func:`maddr_hosts` but the wildcard, loopback last: where other peers reach our lane."""
    hosts = [h for h in maddr_hosts(maddrs) if not ipaddress.ip_address(h).is_unspecified]
    return sorted(hosts, key=lambda h: ipaddress.ip_address(h).is_loopback)


class LanePortError(OSError):
    """The lane's port, asked for by the operator, could not be bound on any host."""


def _offered(hosts: list[str], bound: dict[str, int]) -> list[str]:
    """``host:port`` of each of ``hosts`` where we listen for it: on the host itself, on the wildcard
    of its family, or (an announced address in front of a forwarded port) on any host of its family;
    then bound hosts not among ``hosts``. Wildcards are never offered."""
    def family(h: str) -> int:
        return ipaddress.ip_address(h).version

    wildcard = {family(h): p for h, p in bound.items() if ipaddress.ip_address(h).is_unspecified}
    out: list[str] = []
    for host in [*hosts, *bound]:
        if ipaddress.ip_address(host).is_unspecified:
            continue
        port = bound.get(host) or wildcard.get(family(host)) or next(
            (p for h, p in bound.items() if family(h) == family(host)), None)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if port is not None and address not in out:
            out.append(address)
    return out


def _split_address(text: str) -> tuple[str, int]:
    """``("host", port)`` of an offered ``host:port`` / ``[v6]:port``; ValueError if it is not one."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    ipaddress.ip_address(host)
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not host:port: {text!r}")
    return host, int(port)


def _certificate() -> tuple[ssl.SSLContext, bytes]:
    """A TLS 1.3 server context with a fresh self-signed certificate, and the certificate's SHA-256."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hivepath lane")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650)).sign(key, hashes.SHA256()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    with tempfile.TemporaryDirectory() as tmp:  # ssl loads keys from files only; gone right after
        cert_path, key_path = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        with open(cert_path, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        with open(key_path, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        context.load_cert_chain(cert_path, key_path)
    return context, hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).digest()


def _client_context() -> ssl.SSLContext:
    """TLS 1.3, no CA: the server's certificate is checked against the offered fingerprint instead."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


@dataclass
class _Offer:
    addresses: list[tuple[str, int]]
    fingerprint: bytes
    token: bytes
    expires: float
    reached: Optional[tuple[str, int]] = None
    """The address a connection was made to (None until one was)."""
    problems: list[str] = field(default_factory=list)
    """Why addresses did not connect."""


class DirectLanes:
    """This peer's lanes: the server its reducers are reached at, and the connections it opens to
    other peers' lanes. Lives on the loop of the ``hivemind.p2p.P2P`` handle ``p2p``.

    ``offer``: whether to serve a lane (not behind NAT, ``hosts`` non-empty); a peer that does not
    offer one still opens lanes to peers that do."""

    def __init__(self, p2p: Any, prefix: str, offer: bool = True) -> None:
        from hivemind.p2p import PeerID

        self.p2p = p2p
        self.prefix = prefix
        self.offer = offer
        self._peer_id_type = PeerID
        self._handlers: dict[str, Callable[[Any, Any, Any], Awaitable[None]]] = {}
        self._servers: list[asyncio.AbstractServer] = []
        self._addresses: list[str] = []
        self._fingerprint = b""
        self._server_context: Optional[ssl.SSLContext] = None
        self._client_context = _client_context()
        self._tokens: dict[bytes, tuple[str, float]] = {}
        self._issued: dict[str, bytes] = {}
        self._offers: dict[str, _Offer] = {}
        self._asking: dict[str, asyncio.Future] = {}
        self._connecting: set[str] = set()
        self._paused: dict[str, float] = {}
        self._idle: dict[str, list[LaneConnection]] = {}
        self._connections: set[LaneConnection] = set()
        self._tasks: set[asyncio.Future] = set()
        self.opened = 0
        """Lane streams opened by us so far (for tests and benchmarks)."""

    @property
    def addresses(self) -> list[str]:
        """Where our lane listens (``host:port``), empty when we offer none."""
        return list(self._addresses)

    async def start(self, hosts: list[str], listen: Optional[list[str]] = None, port: int = 0) -> None:
        """Listen on ``listen`` (default: ``hosts``; a host we cannot bind is skipped) at ``port`` (0: an
        ephemeral one per host), offer ``hosts`` (where other peers reach us: our announced or found
        addresses) at the port bound for them, and serve offers over P2P.

        Raises :class:`LanePortError` when ``port`` was asked for and no host could be bound to it."""
        if self.offer and hosts:
            self._server_context, self._fingerprint = _certificate()
            bound: dict[str, int] = {}
            problems = []
            for host in listen or hosts:
                try:
                    server = await asyncio.get_running_loop().create_server(
                        lambda: LaneConnection(self, serving=True), host, port, ssl=self._server_context,
                        ssl_handshake_timeout=HELLO_TIMEOUT)
                except OSError as e:
                    problems.append(f"{host}: {e.strerror or e}")
                    continue
                self._servers.append(server)
                bound[host] = server.sockets[0].getsockname()[1]
            if port and not bound:
                raise LanePortError(f"cannot listen on port {port} ({'; '.join(problems)})")
            if problems:
                log.info("no direct lane on %s", "; ".join(problems))
            self._addresses = _offered(hosts, bound)
            if self._addresses:
                log.info("direct lane for the exchange's bytes at %s", ", ".join(self._addresses))
        await serve_messages(self.p2p, self.prefix, LANE, self._handle_offer)
        self._track(asyncio.ensure_future(self._sweep()))

    def serve(self, name: str, handler: Callable[[Any, Any, Any], Awaitable[None]]) -> None:
        """Serve the stream handler ``name`` over our lane too (``handler(stream_info, reader, writer)``,
        as registered with P2P)."""
        self._handlers[name] = handler

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for connection in list(self._connections):
            connection.close()
        for task in list(self._tasks):
            task.cancel()
        self._servers.clear()

    # -- serving side -----------------------------------------------------------------------------

    async def _handle_offer(self, request: LaneRequest, context: Any) -> Any:
        peer = context.remote_id.to_base58()
        if not self._addresses:
            yield LaneOffer()
            return
        now = time.monotonic()
        for token, (_, expires) in list(self._tokens.items()):
            if expires <= now:
                del self._tokens[token]
        token = self._issued.get(peer)
        if token is None or token not in self._tokens or self._tokens[token][1] - now < TOKEN_TTL / 2:
            token = secrets.token_bytes(TOKEN_BYTES)
            self._tokens[token] = (peer, now + TOKEN_TTL)
            self._issued[peer] = token
        yield LaneOffer(addresses=self._addresses, fingerprint=self._fingerprint, token=token,
                        ttl=self._tokens[token][1] - now)

    # -- calling side -----------------------------------------------------------------------------

    async def open(self, peer: str, name: str) -> Optional[tuple[LaneReader, LaneWriter]]:
        """A stream to ``peer``'s handler ``name`` over its lane, or None where there is none to use
        now (the caller then uses P2P).

        A peer's first lane is set up in the background (:meth:`connect`): until it is, its streams
        go through P2P, so an address that does not answer (a firewall dropping the port) never
        holds up a round. Once an address of its offer connected, further connections go straight
        to it."""
        if self._paused.get(peer, 0.0) > time.monotonic():
            return None
        connection = self._take_idle(peer)
        if connection is None:
            offer = self._offers.get(peer)
            if offer is None or offer.reached is None or offer.expires <= time.monotonic():
                if peer not in self._connecting:
                    self._connecting.add(peer)
                    self._track(asyncio.ensure_future(self.connect(peer)))
                return None
            connection = await self._dial(peer, offer, [offer.reached])
            if connection is None:
                self._pause(peer, f"{offer.reached[0]}:{offer.reached[1]}, which connected before, did not")
                return None
        self.opened += 1
        stream = connection.begin(name)
        return stream.reader, stream.writer

    async def connect(self, peer: str) -> bool:
        """Set up a lane to ``peer`` (its offer, then its addresses in order), kept idle for the next
        stream; False (and P2P for :data:`PAUSE`) where none connects."""
        self._connecting.add(peer)
        try:
            offer = await self._offer(peer)
            if offer is None:
                return False
            connection = await self._dial(peer, offer, offer.addresses)
            if connection is None:
                self._pause(peer, "; ".join(offer.problems) or "no address offered")
                return False
            self._idle_connection(connection)
            return True
        except Exception as e:
            self._pause(peer, f"{type(e).__name__}: {e}")
            return False
        finally:
            self._connecting.discard(peer)

    def _take_idle(self, peer: str) -> Optional["LaneConnection"]:
        idle = self._idle.get(peer)
        while idle:
            connection = idle.pop()
            if not connection.closed and time.monotonic() - connection.idle_since < IDLE_TIMEOUT:
                return connection
            connection.close()
        return None

    async def _dial(self, peer: str, offer: "_Offer", addresses: list[tuple[str, int]]) -> Optional["LaneConnection"]:
        """A connection to the first of ``addresses`` that answers with the offered certificate, its
        token sent; problems are noted in ``offer.problems``."""
        loop = asyncio.get_running_loop()
        for host, port in addresses:
            try:
                transport, connection = await asyncio.wait_for(loop.create_connection(
                    lambda: LaneConnection(self, serving=False, peer=peer), host, port, ssl=self._client_context,
                    server_hostname="", ssl_handshake_timeout=CONNECT_TIMEOUT), CONNECT_TIMEOUT)
            except (asyncio.TimeoutError, OSError, ssl.SSLError) as e:
                offer.problems.append(f"{host}:{port}: {type(e).__name__}")
                continue
            ssl_object = transport.get_extra_info("ssl_object")
            cert = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
            if cert is None or hashlib.sha256(cert).digest() != offer.fingerprint:
                connection.close()
                offer.problems.append(f"{host}:{port}: not the offered certificate")
                continue
            connection.send(_HELLO, offer.token)
            offer.reached = (host, port)
            return connection
        return None

    async def _offer(self, peer: str) -> Optional[_Offer]:
        offer = self._offers.get(peer)
        if offer is not None and offer.expires > time.monotonic():
            return offer
        if peer not in self._asking:  # callers at once share one request
            self._asking[peer] = asyncio.ensure_future(self._ask_offer(peer))
            self._asking[peer].add_done_callback(lambda _: self._asking.pop(peer, None))
        return await asyncio.shield(self._asking[peer])

    async def _ask_offer(self, peer: str) -> Optional[_Offer]:
        async def ask() -> LaneOffer:
            stream = await self.p2p.iterate_protobuf_handler(self._peer_id_type.from_base58(peer),
                                                             handler_name(self.prefix, LANE), LaneRequest(),
                                                             LaneOffer)
            try:
                async for reply in stream:
                    return reply
            finally:
                await stream.aclose()
            raise LaneError("no offer")

        try:
            reply = await asyncio.wait_for(ask(), OFFER_TIMEOUT)
            addresses = [_split_address(a) for a in reply.addresses]
            if addresses and (len(reply.fingerprint) != 32 or len(reply.token) != TOKEN_BYTES):
                raise ValueError("malformed offer")
        except Exception as e:
            self._pause(peer, f"no offer: {type(e).__name__}: {e}")
            return None
        if not addresses:
            self._pause(peer, "it offers no lane", TOKEN_TTL)
            return None
        offer = _Offer(addresses, reply.fingerprint, reply.token,
                       time.monotonic() + min(TOKEN_TTL, max(0.0, reply.ttl)) / 2)
        self._offers[peer] = offer
        return offer

    # -- bookkeeping ------------------------------------------------------------------------------

    async def _sweep(self) -> None:
        """Close connections idle past :data:`IDLE_TIMEOUT` (ours) or twice that (our callers': they
        close theirs first, so a caller never picks a connection we are closing)."""
        while True:
            await asyncio.sleep(IDLE_TIMEOUT / 4)
            now = time.monotonic()
            for connection in list(self._connections):
                limit = 2 * IDLE_TIMEOUT if connection.serving else IDLE_TIMEOUT
                if connection.stream is None and now - connection.idle_since > limit:
                    connection.close()

    def _pause(self, peer: str, why: str, seconds: float = PAUSE) -> None:
        log.info("no direct lane to %s for %.0f s (%s): its streams go through the p2p daemon",
                 peer[-8:], seconds, why)
        self._paused[peer] = time.monotonic() + seconds
        self._offers.pop(peer, None)

    def _idle_connection(self, connection: LaneConnection) -> None:
        self._idle.setdefault(connection.peer, []).append(connection)

    def _forget(self, connection: LaneConnection) -> None:
        self._connections.discard(connection)
        idle = self._idle.get(connection.peer)
        if idle and connection in idle:
            idle.remove(connection)

    def _track(self, task: asyncio.Future) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
