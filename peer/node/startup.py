"""The one start-up and teardown of every long-running peer process: ``hivepath peer join``
(:class:`peer.node.join.PeerNode`, and the stage server it runs for a stage assignment) and
``hivepath archive`` (:class:`peer.node.archive.ArchivePeer`).

:class:`PeerStartup` brings a process onto the run in this order, each step a call the process
makes when it is ready for it (a peer prepares its dataset and measures itself between 3 and 4):

1. the work dir, locked for the process's life (:mod:`peer.node.workdir`), and the identity file,
   taken and released at once: a second process on the same directory or file stops here (exit 6)
   before any slow work (``__enter__``);
2. the local status page (``/status``, ``/healthz``) when a port is given (``__enter__``);
3. the coordinator client and the run spec: config, DHT bootstrap peers, the coordinator's key
   (:meth:`PeerStartup.run_spec`);
4. the DHT node with that identity, bootstrapped from the flags and the coordinator's peers,
   admitting only credentialed records when the run has a coordinator key
   (:meth:`PeerStartup.start_dht`); then the averager over it (:meth:`PeerStartup.start_averager`);
5. joining the run: DHT connections to the peers that joined before, the watch that re-merges the
   swarm after a partition, heartbeats (:meth:`PeerStartup.join`).

Leaving the ``with`` block tears down in reverse: the coordinator session ends first (leave, then
stop heartbeats and close the channel: a heartbeat after the leave would join again), then the
averager, the DHT node and the status page. A failing step of the teardown does not skip the rest.

:func:`drain_signals` turns SIGINT, SIGTERM and SIGHUP into a drain; :func:`run_until_stopped` runs
a process under it and a spot-notice watcher, and is what the commands call. Importing this module
pulls in neither torch nor hivemind (the steps import what they start).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Protocol, Sequence

from models.errors import HivepathError
from peer.node.lifetime import STOP_SIGNALS
from peer.node.local_status import DEFAULT_STATUS_PORT, start_optional
from peer.node.progress import PeerStatus
from peer.settings import default

if TYPE_CHECKING:
    from peer.coordinator_client import CoordinatorClient, HeartbeatReply, JoinInfo, PeerInfo, RunSpec
    from peer.network import CredentialVerifier, PeerDHT
    from peer.node.spot import SpotOptions

__all__ = ["NetworkOptions", "PeerStartup", "StoppableProcess", "drain_signals", "run_until_stopped",
           "DRAIN_SIGNALS"]

log = logging.getLogger(__name__)

STATUS_PORT_SEARCH = 16
"""Ports after the default status port a peer tries when it is taken (several peers on one host)."""

DRAIN_SIGNALS = STOP_SIGNALS
"""Signals that drain a peer process: ``docker stop`` and Kubernetes send SIGTERM, a terminal
SIGINT (Ctrl-C), and SIGHUP when the terminal or SSH session it runs in goes away."""


@dataclass
class NetworkOptions:
    """How a long-running peer process reaches its run: the coordinator, the DHT, its status page
    (``hivepath peer join`` and ``hivepath archive`` share these flags and ``HIVEPATH_*`` variables)."""

    coordinator: str
    """``host:port`` of the coordinator's gRPC service."""
    token: str
    """The run token (a shared secret)."""
    initial_peers: tuple[str, ...] = ()
    """Extra DHT bootstrap multiaddrs besides those the coordinator hands out."""
    identity: Optional[Path] = None
    """Identity key file (default: ``identity.key`` in the process's home directory)."""
    host_maddrs: tuple[str, ...] = tuple(default("HIVEPATH_HOST_MADDRS"))
    """Multiaddrs the DHT node listens on."""
    announce_maddrs: tuple[str, ...] = ()
    """Multiaddrs other peers should dial (default: what the DHT node finds)."""
    client_mode: bool = False
    """Accept no incoming connections (behind NAT)."""
    lane_port: int = default("HIVEPATH_LANE_PORT")
    """TCP port of the direct lane that carries the all-reduce's parts outside the p2p daemon
    (:mod:`peer.network.lanes`), on the hosts of ``host_maddrs``, offered at the announced (or found)
    addresses; 0: an ephemeral one, which a firewall may drop (the parts then go through the daemon)."""
    tls_ca: Optional[str] = None
    """CA certificate to verify a TLS coordinator."""
    coordinator_timeout: float = default("HIVEPATH_COORDINATOR_TIMEOUT")
    """Seconds to keep retrying the coordinator at start-up before giving up (exit 3)."""
    coordinator_wait: bool = False
    """Retry for ``coordinator_timeout`` even where nothing answers yet (``--coordinator-timeout``
    given: a coordinator started beside this peer); otherwise such an address is given up after
    :data:`peer.coordinator_client.calls.FIRST_CONTACT_TIMEOUT`."""
    rebootstrap_interval: float = 20.0
    """Seconds between checks that the peers the coordinator lists are in our DHT routing table
    (re-merges the swarm after a partition; see ``PeerDHT.keep_connected``)."""
    status_port: int = 0
    """Serve the local status (``/status``, ``/healthz``) on 127.0.0.1 at this port (0: do not)."""
    stall_timeout: float = default("HIVEPATH_STALL_TIMEOUT")
    """Seconds without progress after which the local status reports the process unhealthy."""

    def __post_init__(self) -> None:
        from peer.coordinator_client import check_address

        if not self.coordinator:
            raise HivepathError("no coordinator address: pass --coordinator HOST:PORT or set HIVEPATH_COORDINATOR")
        check_address(self.coordinator)  # malformed: exit 2 now, not after minutes of retries
        if self.client_mode and self.announce_maddrs:
            raise HivepathError("--client-mode accepts no incoming connections, so there is nothing to announce at "
                                "--announce-maddrs: drop one of the two (HIVEPATH_CLIENT_MODE, HIVEPATH_ANNOUNCE_MADDRS)")
        for flag, addrs in (("--initial-peers", self.initial_peers), ("--host-maddrs", self.host_maddrs),
                            ("--announce-maddrs", self.announce_maddrs)):
            for addr in addrs:
                _check_multiaddr(flag, addr)
        if not 0 <= self.lane_port <= 65535:
            raise HivepathError(f"--lane-port must be a TCP port (1-65535) or 0 for an ephemeral one, got {self.lane_port}")
        if self.client_mode and self.lane_port:
            raise HivepathError("--client-mode accepts no incoming connections, so it serves no lane at --lane-port: "
                                "drop one of the two (HIVEPATH_CLIENT_MODE, HIVEPATH_LANE_PORT)")
        if not 0 <= self.status_port <= 65535:
            raise HivepathError(f"--status-port must be a TCP port (1-65535) or 0 to turn it off, "
                                f"got {self.status_port}")
        if not self.stall_timeout > 0:
            raise HivepathError(f"--stall-timeout must be > 0 seconds, got {self.stall_timeout}")


def _check_multiaddr(flag: str, text: str) -> None:
    """A :class:`HivepathError` (exit 2) naming ``flag`` when ``text`` does not parse as a multiaddr."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        Multiaddr(text)
    except Exception as e:  # the multiaddr package raises several types, all meaning "malformed"
        raise HivepathError(f"{flag} {text!r} is not a multiaddr ({e}); write one like "
                            "/ip4/203.0.113.5/tcp/7710/p2p/12D3KooW... (host maddrs: /ip4/0.0.0.0/tcp/7710)") from None


class PeerStartup:
    """A peer process's place in the run, from identity to heartbeats; a context manager.

    ``home``: the process's directory (created and locked for this process: one process per directory;
    the identity file defaults to ``home/identity.key``); ``home_flag``: the flag that names it (for
    the message when another process holds it); ``role``: ``peer`` or ``archive`` (the status page says it); ``leave_reason()``: what the leave
    tells the coordinator, asked at teardown.
    """

    def __init__(self, opts: NetworkOptions, home: Path, status: PeerStatus, role: str,
                 leave_reason: Callable[[], str] = lambda: "finished", home_flag: str = "--work-dir"):
        self.opts = opts
        self.home = Path(home)
        self.home_flag = home_flag
        self._home_lock: Any = None
        self.status = status
        self.role = role
        self.identity = Path(opts.identity) if opts.identity else self.home / "identity.key"
        self._leave_reason = leave_reason
        self.client: Optional[CoordinatorClient] = None
        self.dht: Optional[PeerDHT] = None
        self._spec: Optional[RunSpec] = None
        self.verifier: Optional[CredentialVerifier] = None
        self.averager: Any = None
        self.relayed = False
        """The coordinator found us behind NAT and we announce circuits through relays (:meth:`join`)."""
        self._status_server: Any = None
        self._on_close: list[Callable[[], None]] = []

    def __enter__(self) -> "PeerStartup":
        from peer.coordinator_client import CoordinatorClient
        from peer.settings import read
        from protos import versions

        try:
            versions.set_override(read("HIVEPATH_TEST_PROTOCOL"))
        except ValueError as e:
            raise HivepathError(f"HIVEPATH_TEST_PROTOCOL: {e}") from None
        from peer.network import load_or_create_identity
        from peer.node.lifetime import watch_descendants
        from peer.node.workdir import lock_work_dir

        # the DHT will run in a child process with a p2p daemon under it: both go if we are killed outright
        # (started first, so the watchdog is up before they are)
        watch_descendants()
        self.home.mkdir(parents=True, exist_ok=True)
        self._home_lock = lock_work_dir(self.home, self.home_flag)  # exit 6 if a live process uses it
        try:
            load_or_create_identity(self.identity).release()  # fail fast (exit 6) if a live process holds it
            search = STATUS_PORT_SEARCH if self.opts.status_port == DEFAULT_STATUS_PORT else 0  # the default: shared
            self._status_server = start_optional(self.status, self.role, self.opts.status_port, self.opts.stall_timeout,
                                                 search=search)
            self.client = CoordinatorClient(self.opts.coordinator, self.opts.token, tls_ca=self.opts.tls_ca,
                                            retry_timeout=self.opts.coordinator_timeout,
                                            expect_starting=self.opts.coordinator_wait)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def run_spec(self) -> "RunSpec":
        """The run spec from the coordinator (retried up to ``coordinator_timeout``)."""
        return self.client.run_spec()

    def start_dht(self, spec: "RunSpec", relays: Sequence[str] = ()) -> "PeerDHT":
        """Start the DHT node for ``spec``'s run; it admits only credentialed records when the run has
        a coordinator key (then :attr:`verifier` checks members' credentials). ``relays``: reserve
        relay slots on these peers and announce only the circuits (a peer behind NAT)."""
        from peer.network import CredentialVerifier, DHTOptions, start_dht
        o = self.opts
        self._spec = spec
        self.dht = start_dht(DHTOptions(
            initial_peers=tuple(o.initial_peers) + tuple(spec.initial_peers) + tuple(relays),
            host_maddrs=o.host_maddrs, announce_maddrs=o.announce_maddrs, client_mode=o.client_mode,
            identity_path=str(self.identity), relays=tuple(relays),
        ))
        if spec.coordinator_public_key:
            cfg = spec.run_config
            self.verifier = CredentialVerifier(cfg.run_id, spec.coordinator_public_key)
            self.dht.admit_only(cfg.run_id, spec.coordinator_public_key, cfg.lattice.module_ids())
        self.status.peer_id = self.dht.peer_id
        return self.dht

    def start_averager(self, spec: "RunSpec", manifest_hash: str, **role_options: Any):
        """The process's :class:`peer.averaging.NetAverager` over the DHT node, carrying our credential
        and checking members'; ``role_options``: what the role adds (bandwidth, a state provider...)."""
        from peer.averaging import NetAverager
        from peer.network.lanes import LanePortError, maddr_hosts

        cfg = spec.run_config
        client = self.client
        role_options.setdefault("relayed", self.relayed)
        role_options.setdefault("lane_port", self.opts.lane_port)
        role_options.setdefault("lane_listen", maddr_hosts(self.opts.host_maddrs))
        try:
            self.averager = NetAverager(self.dht, cfg.run_id, cfg.content_hash(), manifest_hash,
                                        credential=lambda: client.credential, verifier=self.verifier, **role_options)
        except LanePortError as e:
            raise HivepathError(f"--lane-port {self.opts.lane_port}: {e}; pass a free port, or 0 for an ephemeral "
                                "one (HIVEPATH_LANE_PORT)") from None
        self.averager.on_isolated = self.dht.poke
        self.averager.coordinator_contact = client.contact_since
        return self.averager

    def join(self, peer: "PeerInfo", report: Callable[[], dict],
             on_heartbeat: Callable[["HeartbeatReply"], None]) -> "JoinInfo":
        """Join the run as ``peer``, connect to the peers that joined before us, keep the swarm merged
        and heartbeat in the background (``report()``: heartbeat fields, ``on_heartbeat(reply)``).

        A peer the coordinator cannot dial back is handed relays: the DHT is restarted with them
        (:attr:`dht` is then a new node under the same identity) and the peer joins again announcing
        the circuits. Start the averager after this, over :attr:`dht`."""
        client = self.client
        client.peer = peer
        self.status.state = "joining"
        joined = client.join()
        if joined.reachability == "unreachable" and joined.relays and not self.opts.client_mode:
            log.info("behind NAT: reserving relay slots on %s", ", ".join(_short(r) for r in joined.relays))
            self.dht.shutdown()
            self.dht = None
            self.start_dht(self._spec, relays=joined.relays)
            client.peer = replace(peer, multiaddrs=tuple(self.dht.maddrs()))
            joined = client.join()
        self.relayed = joined.reachability == "relayed"
        level, line = reachability_line(joined, self.opts.client_mode)
        self.status.reachability = line
        log.log(level, "%s", line)
        self.dht.connect(joined.initial_peers)
        self.dht.keep_connected(lambda: client.run_spec().initial_peers, interval=self.opts.rebootstrap_interval)
        client.start_heartbeats(report, on_heartbeat)
        return joined

    def on_close(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` at teardown, after the coordinator session ends and before the averager and
        the DHT stop (a seeder that serves over the DHT's daemon)."""
        self._on_close.append(callback)

    def close(self) -> None:
        """Tear down what was started, in reverse (see the module docstring); safe to call twice."""
        self.status.state = "stopped"
        with ExitStack() as stack:  # callbacks run last-in first-out, each even if one before failed
            if self._home_lock is not None:
                stack.callback(self._home_lock.release)  # last: nothing of ours writes the directory any more
            if self._status_server is not None:
                stack.callback(self._status_server.stop)
            if self.dht is not None:
                stack.callback(self.dht.shutdown)
            if self.averager is not None:
                stack.callback(self.averager.shutdown)
            for callback in self._on_close:
                stack.callback(callback)
            if self.client is not None:
                stack.callback(self._end_session, self.client)
            self._status_server = self.dht = self.averager = self.client = self._home_lock = None
            self._on_close = []

    def _end_session(self, client: "CoordinatorClient") -> None:
        try:
            if client.joined is not None:
                client.retry_timeout = min(client.retry_timeout or 10.0, 10.0)  # never hang a drain on it
                try:
                    client.leave(self._leave_reason())
                except HivepathError as e:
                    log.warning("could not tell the coordinator we left: %s", e)
        finally:
            client.close()


@contextmanager
def drain_signals(on_first: Callable[[str], None]) -> Iterator[None]:
    """While inside: the first of :data:`DRAIN_SIGNALS` calls ``on_first(reason)``; a second exits at
    once with status 130. On leaving (drained), SIGTERM and SIGHUP are ignored: a late one (a
    supervisor's, a second watcher's, a closing terminal's) must not kill the interpreter as it exits,
    when Python resets its handlers to the default, and turn exit 0 into 143 or 129."""
    count = {"n": 0}

    def handler(signum, _frame):
        count["n"] += 1
        name = signal.Signals(signum).name
        if count["n"] == 1:
            on_first(f"{name} received")
        else:
            sys.stderr.write(f"hivepath: second {name}: exiting now (the last checkpoint is intact)\n")
            sys.stderr.flush()
            os._exit(130)

    for sig in DRAIN_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)


class StoppableProcess(Protocol):
    """A long-running peer process: :meth:`run` blocks until stopped and returns the exit code."""

    def run(self) -> int: ...

    def request_stop(self, reason: str, preempting: bool = False) -> None: ...


def run_until_stopped(process: StoppableProcess, spot: Optional["SpotOptions"] = None) -> int:
    """Run ``process`` in this (the main) thread until it ends: a drain signal stops it
    (:func:`drain_signals`), and so does a spot notice when ``spot`` watches for one (as a
    preemption). Returns its exit code."""
    from peer.node.spot import SpotWatcher

    watcher = None
    if spot is not None:
        watcher = SpotWatcher.from_options(
            spot, lambda notice: process.request_stop(notice.describe(), preempting=True))
    with drain_signals(process.request_stop):
        if watcher is not None:
            watcher.start()
        try:
            return process.run()
        finally:
            if watcher is not None:
                watcher.stop()


def _short(maddr: str) -> str:
    """A relay's multiaddr as a reader needs it: its peer id (the last ``/p2p/`` part)."""
    return maddr.rsplit("/p2p/", 1)[-1] if "/p2p/" in maddr else maddr


def reachability_line(joined: "JoinInfo", client_mode: bool) -> tuple[int, str]:
    """The one line a peer says at join about whether others can dial it, and its log level."""
    if joined.reachability == "reachable":
        return logging.INFO, f"reachable at {joined.reachable_addr}"
    if joined.reachability == "relayed":
        relay = joined.reachable_addr.split("/p2p-circuit")[0]
        return logging.INFO, f"behind NAT: relayed via {_short(relay)} (dialled at {joined.reachable_addr})"
    if joined.reachability == "not_listening" or client_mode:
        return logging.INFO, ("client mode: other peers cannot dial this one; it averages through the peers "
                              "it dials (it reduces no part of a module itself)")
    if joined.reachability == "unreachable":
        seen = f" (its connections come from {joined.observed_addr})" if joined.observed_addr else ""
        return logging.WARNING, (
            f"cannot be reached and no relay answers: the coordinator could not connect to any announced "
            f"address{seen}, so peers cannot dial this one; open the TCP port of --host-maddrs on the router or "
            "firewall and pass --announce-maddrs with the public address, or pass --client-mode")
    return logging.INFO, "reachability unknown (the coordinator does not dial back)"
