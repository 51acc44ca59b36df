"""Start or join a hivemind DHT for one peer process.

One DHT (and one p2p daemon) per process, shared by every module the peer holds and by the
averager, state transfer and stage serving (start-up of a p2p daemon costs about a second).

- ``initial_peers``: multiaddrs of any live peers (the coordinator hands them out); none starts a
  new swarm.
- ``host_maddrs``: where to listen (default every interface, an ephemeral port);
  ``announce_maddrs``: the addresses other peers should dial (behind port forwarding).
- ``client_mode``: for peers that cannot accept connections (behind NAT): they store and read
  records and dial out, but are never dialled; they reduce no part of an all-reduce.
- ``relays``: for a peer behind NAT that should still be dialled: reachable peers' multiaddrs; the
  daemon reserves a slot on each and the peer announces the circuits (:mod:`peer.network.relays`).
- ``identity_path``: a persistent private key (:mod:`peer.network.identity`) so the peer id is stable across
  restarts; the file is locked while the peer runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from models.errors import HivepathError
from peer.network.identity import Identity, load_or_create_identity

__all__ = ["DHTOptions", "DHTStartError", "PeerDHT", "start_dht", "unwrap_dht"]

log = logging.getLogger(__name__)


class DHTStartError(HivepathError):
    """The DHT could not start or could not reach any initial peer."""

    exit_code = 3


SOCKET_PATH_MAX = 107
"""Bytes of a unix socket's path at most (``sun_path`` less its terminating NUL)."""


def shm_manager_failure(error: str) -> str:
    """The message for torch's shared-memory manager failing to start (hivemind shares tensors between
    its processes through it): it binds ``TMPDIR/torch-shm-dir-XXXXXX/manager.sock`` and fails with
    EINVAL when that path is too long for a unix socket."""
    tmp = tempfile.gettempdir()
    length = len(os.path.join(tmp, "torch-shm-dir-XXXXXX", "manager.sock").encode())
    if length > SOCKET_PATH_MAX:
        return (f"cannot start the DHT: TMPDIR {tmp} is too long for the socket torch's shared-memory manager "
                f"makes in it ({length} bytes, a unix socket's path holds {SOCKET_PATH_MAX}); "
                "set TMPDIR to a shorter directory, e.g. TMPDIR=/tmp")
    first = error.strip().splitlines()[0] if error.strip() else "no message"
    return (f"cannot start the DHT: torch's shared-memory manager failed ({first}); "
            f"check that TMPDIR {tmp} is a writable directory")


class ListenAddressInUse(DHTStartError):
    """A listen address of ``--host-maddrs`` names a port that is in use: the user's to change."""

    exit_code = 2


@dataclass(frozen=True)
class DHTOptions:
    """How this peer joins the DHT."""

    initial_peers: Sequence[str] = ()
    """Multiaddrs of live peers to bootstrap from; empty starts a new swarm."""
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",)
    """Multiaddrs to listen on."""
    announce_maddrs: Sequence[str] = ()
    """Multiaddrs other peers should dial (explicit ports); empty announces what we listen on."""
    client_mode: bool = False
    """Do not accept incoming connections (a peer behind NAT)."""
    relays: Sequence[str] = ()
    """Multiaddrs (with ``/p2p/<id>``) of peers to reserve relay slots on; we announce only the circuits."""
    identity_path: Optional[str] = None
    """Private-key file giving a stable peer id; None picks a fresh random identity."""
    startup_timeout: float = 30.0
    """Seconds to wait for the p2p daemon and the first contact with initial peers."""
    check_identity_on_network: bool = False
    """Also ask the swarm whether our identity is already in use elsewhere (costs a second p2p daemon)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments for ``hivemind.dht.DHT`` (e.g. ``num_workers``)."""
    coalesce: bool = True
    """Send stores and latest reads issued together as one request per node
    (:class:`peer.network.coalescing.CoalescingDHT`); False runs hivemind's ``DHT`` as it is, one
    search per key (``bench.wire --plain-dht``, the control run)."""


class PeerDHT:
    """A running DHT node of this process, with its (locked) identity. Call :meth:`shutdown` at exit."""

    def __init__(self, dht: Any, identity: Optional[Identity], client_mode: bool):
        self.dht = dht
        self.identity = identity
        self.client_mode = client_mode
        self.peer_id: str = dht.peer_id.to_base58()
        self._stopping = threading.Event()
        self._keeper: Optional[threading.Thread] = None
        self._poked = threading.Event()
        self._unanswered: frozenset[str] = frozenset()
        """Multiaddrs whose TCP port did not answer at the last :meth:`connect`."""

    def maddrs(self) -> list[str]:
        """Multiaddrs (with ``/p2p/<peer id>``) under which other peers can reach us; empty in client mode."""
        if self.client_mode:
            return []
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def connect(self, maddrs: Sequence[str], timeout: float = 15.0, only_missing: bool = False) -> int:
        """Join the swarm of the peers at ``maddrs`` after start-up; returns how many answered
        (``only_missing``: peers already in our routing table are not pinged and do not count).

        Peers that started at the same moment each began a swarm of their own; the coordinator's
        join reply names the peers that joined before us, and connecting to them merges the swarms.

        An address whose TCP port does not answer is not dialled (see :meth:`keep_connected`). When
        one that did not answer at the last call answers again, our connection to its peer, if
        libp2p still lists one, died in the cut: it is closed (at both ends, the network being back)
        before the dial, or libp2p would reuse it and our pings and state requests would hang on it
        until they time out (3-5 s each after a heal, ``bench.chaos``).
        """
        maddrs = self._others(maddrs)
        if not maddrs:
            return 0
        try:
            outcomes = self.dht.run_coroutine(_partial_connect(maddrs, timeout, only_missing, self._unanswered,
                                                               self.cut_off(maddrs)),
                                              return_future=True).result(timeout + 5)
        except Exception as e:  # a failed merge is retried at the next refresh of the peer list
            log.log(logging.INFO if only_missing else logging.WARNING, "could not reach peers %s: %r",
                    ", ".join(maddrs), e)
            return 0
        self._unanswered = (self._unanswered - set(maddrs)) | {m for m, o in zip(maddrs, outcomes) if o == _UNANSWERED}
        failed = {m: o for m, o in zip(maddrs, outcomes) if o not in (_CONNECTED, _IN_TABLE)}
        if failed:
            log.debug("re-connection: %s", "; ".join(f"{m}: {o}" for m, o in failed.items()))
        return sum(1 for o in outcomes if o == _CONNECTED)

    def cut_off(self, maddrs: Sequence[str]) -> bool:
        """Whether we seem cut off from the peers at ``maddrs``: at least half of them did not answer the
        last check's probes. The next checks then probe the peers in our routing table too: a peer that
        stays in it through a cut (we sent it no RPC meanwhile) keeps a connection that died in the cut,
        and the first DHT lookup after the heal would wait on it for hivemind's whole RPC timeout
        (``bench.chaos`` measures the recovery).
        One that does not answer is dropped from the table, as hivemind drops a peer that missed an RPC,
        and closed and dialled afresh once it answers again."""
        listed = self._others(maddrs)
        return bool(listed) and 2 * len(self._unanswered & set(listed)) >= len(listed)

    def _others(self, maddrs: Sequence[str]) -> list[str]:
        """The multiaddrs of other peers among ``maddrs`` (with a peer id, not ours)."""
        return [m for m in maddrs if "/p2p/" in m and not m.endswith(self.peer_id)]

    def admit_only(self, run_id: str, coordinator_public_key: bytes, module_ids: Sequence[str]) -> None:
        """From now on this DHT node refuses the run's records of peers without a valid credential
        (:class:`peer.network.admission.AdmissionValidator`)."""
        from peer.network.admission import AdmissionValidator

        self.dht.add_validators([AdmissionValidator(run_id, coordinator_public_key, module_ids)])

    def keep_connected(self, source: Callable[[], Sequence[str]], interval: float = 20.0) -> None:
        """Every ``interval`` seconds, ping the peers ``source()`` names (the coordinator's current peer
        list) that are missing from our routing table. A DHT node forgets peers it could not reach,
        so after a network partition heals, or when every peer it knew has restarted, the two sides
        of the swarm would never find each other again; this re-merges them within ``interval``
        (within :data:`_MIN_RECONNECT_GAP` of a :meth:`poke`).

        ``source()`` is asked in the background: a cut-off peer's coordinator client can be retrying
        for a minute, and waiting out its backoff after the heal kept a cut-off peer apart for 18 s.
        Meanwhile the last list it answered is used (the first list is waited for
        :data:`_PEER_LIST_WAIT` seconds).

        A missing peer is dialled only when a plain TCP connection to its address opens. libp2p backs
        off every later dial of a peer after a failed one (5 s, then 5 s + n² s after the n-th, up to
        5 minutes); dialling through a cut, every check, kept a healed peer apart for 5-20 s, and a
        long outage would have kept it apart for minutes. While we seem cut off (:meth:`cut_off`) the
        checks follow each other every :data:`_CUT_OFF_GAP` seconds and each probe tries again every
        :data:`_PROBE_AGAIN` seconds, so the heal is seen within a fraction of a second. While any
        listed peer did not answer, the checks run every :data:`_MIN_RECONNECT_GAP` seconds rather
        than every ``interval``: the peers on our side of a cut dial the cut-off peer back within
        about a second of the heal. Its own dials of a peer can be refused for seconds by libp2p's
        backoff after a failed one during the cut (a DHT request on a connection libp2p had closed
        meanwhile), and a connection opened from our side serves its requests too."""
        if self._keeper is not None:
            return

        def loop() -> None:
            known: list[str] = []
            asked: Optional[_Asked] = None
            while not self._stopping.is_set():
                cut_off = self.cut_off(known)
                self._poked.wait(0.0 if cut_off else _MIN_RECONNECT_GAP if self._unanswered & set(known) else interval)
                self._poked.clear()
                if self._stopping.wait(_CUT_OFF_GAP if cut_off else _MIN_RECONNECT_GAP):
                    return  # (the gap also rate-limits pokes)
                asked = asked or _Asked(source)
                # the first list is waited for; later ones are not (the last list serves meanwhile)
                if asked.done.wait(0.0 if known else _PEER_LIST_WAIT):
                    if asked.error is None:
                        known = asked.value
                    else:  # the coordinator may be down: the last list it gave, if any
                        log.debug("no peer list to re-connect to: %r", asked.error)
                    asked = None
                if not known:
                    continue
                if self._stopping.is_set() or not self.dht.is_alive():
                    return
                found = self.connect(known, timeout=min(_RECONNECT_TIMEOUT, interval), only_missing=True)
                if found:
                    log.info("re-connected to %d peer(s) missing from the DHT routing table", found)

        self._keeper = threading.Thread(target=loop, name="dht-keep-connected", daemon=True)
        self._keeper.start()

    def poke(self) -> None:
        """Check the routing table against the coordinator's peer list now rather than at the next
        interval (e.g. a round found no other holder: we may be cut off from the swarm)."""
        self._poked.set()

    def shutdown(self) -> None:
        """Stop the DHT process and its p2p daemon, and release the identity lock."""
        self._stopping.set()
        self._poked.set()
        try:
            if self.dht.is_alive():
                self.dht.shutdown()
        finally:
            if self.identity is not None:
                self.identity.release()

    def __enter__(self) -> "PeerDHT":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def start_dht(options: DHTOptions = DHTOptions()) -> PeerDHT:
    """Start this process's DHT node (and p2p daemon) and join the swarm of ``options.initial_peers``."""
    identity = load_or_create_identity(options.identity_path) if options.identity_path else None
    kwargs: dict[str, Any] = dict(
        initial_peers=list(options.initial_peers),
        host_maddrs=list(options.host_maddrs),
        client_mode=options.client_mode,
        startup_timeout=options.startup_timeout,
        await_ready=True,
        start=True,
        **options.extra,
    )
    if options.client_mode:
        kwargs["no_listen"] = True  # hivemind's client mode alone still listens; we open no port at all
    if options.announce_maddrs:
        kwargs["announce_maddrs"] = list(options.announce_maddrs)
    if options.relays and not options.client_mode:
        from peer.network.relays import circuit_addrs, use_static_relays

        use_static_relays()
        kwargs.update(use_auto_relay=True, trusted_relays=list(options.relays), force_reachability="private",
                      announce_maddrs=circuit_addrs(options.relays))
    if identity is not None:
        kwargs["identity_path"] = str(identity.path)
        kwargs["check_if_identity_free"] = options.check_identity_on_network
    try:
        dht = _start_process(kwargs, options.startup_timeout + READY_GRACE, coalesce=options.coalesce)
    except Exception as e:
        if identity is not None:
            identity.release()
        busy = re.search(r"listen tcp\d? ([\d.]+|\[[0-9a-fA-F:]+\]):(\d+): bind: address already in use", str(e))
        if busy:
            raise ListenAddressInUse(
                f"cannot listen on {busy.group(1)} port {busy.group(2)}: the port is in use (another peer on this "
                f"machine?); pass another port in --host-maddrs, or tcp/0 to take a free one"
            ) from None
        if "torch_shm_manager" in str(e):
            raise DHTStartError(shm_manager_failure(str(e))) from None
        peers = ", ".join(options.initial_peers) or "none"
        raise DHTStartError(
            f"cannot start the DHT ({type(e).__name__}: {e}); initial peers: {peers}; "
            "check that they are live and reachable, or start without initial peers for a new swarm"
        ) from None
    node = PeerDHT(dht, identity, options.client_mode)
    log.info("DHT up: peer id %s, reachable at %s", node.peer_id, node.maddrs() or "(client mode)")
    return node


READY_GRACE = 60.0
"""Seconds past ``startup_timeout`` that :func:`start_dht` waits for the DHT process to be ready (its
p2p daemon and bootstrap included) before it gives that process up and starts another, once.
hivemind's own wait has no bound: a DHT process that never gets ready (a busy machine can leave one
unanswering) would hold its caller forever."""


BOOTSTRAP_ATTEMPTS = 3
"""Starts of the DHT process when its p2p daemon reached none of the initial peers: a peer that is
restarting, a NAT mapping not up yet or a dial that timed out on a busy host answers seconds later."""
BOOTSTRAP_RETRY_S = 2.0
"""Seconds between those starts."""
_NO_BOOTSTRAP = "failed to connect to bootstrap peers"


def _start_process(kwargs: dict[str, Any], timeout: float, attempts: int = 2, coalesce: bool = True) -> Any:
    """A :class:`peer.network.coalescing.CoalescingDHT` (hivemind's ``DHT``, stores and reads issued
    together sent together; hivemind's own without ``coalesce``) started in its process and ready within ``timeout`` seconds; a process that
    is not is killed and another started, up to ``attempts`` in all (then ``TimeoutError``). A daemon
    that reached none of the initial peers is started again :data:`BOOTSTRAP_RETRY_S` later, up to
    :data:`BOOTSTRAP_ATTEMPTS` in all; any other error the process reports (a port in use) is raised
    at once."""
    from hivemind.dht import DHT

    from peer.network.coalescing import CoalescingDHT

    timeouts = unreached = 0
    while True:
        dht = (CoalescingDHT if coalesce else DHT)(**{**kwargs, "start": False})
        try:
            dht.run_in_background(await_ready=True, timeout=timeout)
            return dht
        except TimeoutError:
            timeouts += 1
            log.warning("the DHT process (pid %s) was not ready after %.0fs (attempt %d of %d); killing it",
                        dht.pid, timeout, timeouts, attempts)
            dht.kill()
            dht.join(10)
            if timeouts >= attempts:
                raise TimeoutError(f"the DHT process was not ready after {timeout:.0f}s, {attempts} times") from None
        except Exception as e:
            unreached += 1
            if _NO_BOOTSTRAP not in str(e) or unreached >= BOOTSTRAP_ATTEMPTS:
                _let_exit(dht)
                raise
            log.warning("the p2p daemon reached none of the initial peers (attempt %d of %d); trying again in "
                        "%.0fs", unreached, BOOTSTRAP_ATTEMPTS, BOOTSTRAP_RETRY_S)
            _let_exit(dht)
            time.sleep(BOOTSTRAP_RETRY_S)


EXIT_GRACE_S = 30.0
"""Seconds a DHT process that reported its failure is given to exit on its own before it is killed."""


def _let_exit(dht: Any) -> None:
    """Wait for a DHT process that reported a failed start to exit, as it does right after reporting.
    Killing it at once can catch it between sending the report and releasing hivemind's
    ``MPFuture._update_lock``, a lock shared by every process forked from ours: held by a dead process,
    it stops every DHT started later from this process reporting that it is ready."""
    dht.join(EXIT_GRACE_S)
    if dht.is_alive():
        dht.kill()
        dht.join(10)


_CONNECTED, _IN_TABLE, _UNANSWERED = "connected", "in the routing table", "its TCP port does not answer"


class _partial_connect:
    """A picklable coroutine factory run inside the DHT process (hivemind's ``run_coroutine``): one
    outcome per multiaddr, :data:`_CONNECTED` where the peer answered a DHT ping."""

    def __init__(self, maddrs: Sequence[str], timeout: float, only_missing: bool = False,
                 unanswered: frozenset[str] = frozenset(), cut_off: bool = False):
        self.maddrs = list(maddrs)
        self.timeout = timeout
        self.only_missing = only_missing
        self.unanswered = unanswered
        self.cut_off = cut_off

    async def __call__(self, dht: Any, node: Any) -> list[str]:
        import asyncio

        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        from models.tcp import relay_of, tcp_accepts, tcp_target

        client = node.p2p._client

        async def one(addr: str) -> str:
            m = Multiaddr(addr)
            peer = PeerID.from_base58(m["p2p"])
            table = node.protocol.routing_table
            in_table = peer in table and addr not in self.unanswered
            if self.only_missing and in_table and not self.cut_off:
                return _IN_TABLE  # (one back from a cut may be in the table again, through its own RPCs to us)
            relay = relay_of(addr)  # a circuit: its relay's port
            endpoint = tcp_target(relay[0] if relay is not None else addr)
            if endpoint is not None and not await tcp_accepts(*endpoint, min(_PROBE_TIMEOUT, self.timeout),
                                                              _PROBE_AGAIN):
                # as for an RPC it missed: out of the table, so no lookup waits on its dead connection
                await node.protocol.update_routing_table(None, peer, responded=False)
                return _UNANSWERED  # no libp2p dial: a failed one backs every later dial off (keep_connected)
            if self.only_missing and in_table:
                return _IN_TABLE
            target = [m.decapsulate(Multiaddr(f"/p2p/{m['p2p']}"))]
            if addr in self.unanswered:  # back after a cut: its connection, if libp2p lists one, is dead
                await client.disconnect(peer)
            await client.connect(peer, target)
            return _CONNECTED if await node.protocol.call_ping(peer) is not None else "no answer to a DHT ping"

        async def guarded(addr: str) -> str:
            try:
                return await one(addr)
            except Exception as e:
                return repr(e)

        return list(await asyncio.wait_for(asyncio.gather(*(guarded(a) for a in self.maddrs)), self.timeout))


_PROBE_TIMEOUT = 2.0
"""Seconds a re-connection check's TCP probe of one address waits for the connection to open."""

_PROBE_AGAIN = 0.25
"""Seconds between the attempts of one TCP probe (:func:`models.tcp.tcp_accepts`): a probe through a
cut that heals answers within this of the heal."""

_MIN_RECONNECT_GAP = 1.0
"""Seconds between two re-connection checks, however often :meth:`PeerDHT.poke` is called."""

_CUT_OFF_GAP = 0.25
"""Seconds between two re-connection checks while we seem cut off (at least half of the listed
peers did not answer the last check's probes)."""

_PEER_LIST_WAIT = 2.0
"""Seconds a re-connection check waits for the coordinator's peer list before it uses the last one."""

_RECONNECT_TIMEOUT = 8.0
"""Seconds a re-connection check gives the missing peers to answer (a dial and a ping)."""


class _Asked:
    """One call of a peer-list source in a daemon thread (it may block for its whole retry budget;
    a daemon thread never holds up the process's exit)."""

    def __init__(self, source: Callable[[], Sequence[str]]):
        self.done = threading.Event()
        self.value: list[str] = []
        self.error: Optional[BaseException] = None
        threading.Thread(target=self._run, args=(source,), name="dht-peer-list", daemon=True).start()

    def _run(self, source: Callable[[], Sequence[str]]) -> None:
        try:
            self.value = list(source())
        except Exception as e:
            self.error = e
        finally:
            self.done.set()


def unwrap_dht(dht: Any) -> Any:
    """The hivemind DHT behind a :class:`PeerDHT` (or ``dht`` itself)."""
    return dht.dht if isinstance(dht, PeerDHT) else dht


async def own_p2p(dht: Any) -> Any:
    """A P2P handle on this process's daemon for the running event loop alone, to shut down when done.

    hivemind's ``DHT.replicate_p2p`` hands every caller of a process the same cached handle, bound to
    the loop of its first caller (the averager's, in a peer). A component on its own loop (a seeder, a
    fetcher, a stage client or endpoint) would mix its futures with the averager's, and shutting that
    handle down stops the listener every door of the process's shared handle answers through: the
    averager's, and any handler registered on it afterwards (the stage endpoint of a trainer moved to
    a stage) would be routed to a closed socket."""
    from hivemind.dht import DHT
    from hivemind.p2p import P2P

    inner = unwrap_dht(dht)
    maddr = await asyncio.get_running_loop().run_in_executor(None, inner.run_coroutine,
                                                             DHT._get_p2p_daemon_listen_maddr)
    return await P2P.replicate(maddr)
