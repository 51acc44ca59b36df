"""The one start-up of the long-running peer processes (``peer.node.startup``): options are checked
once, a held identity stops the process before anything starts, teardown runs in reverse order and
completes past a failing step, and SIGINT, SIGTERM and SIGHUP drain (a second signal exits 130)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from helpers.procs import ROOT
from models.errors import HivepathError
from peer.node.progress import PeerStatus
from peer.node.startup import NetworkOptions, PeerStartup, run_until_stopped


def _options(**changes) -> NetworkOptions:
    return NetworkOptions(**{"coordinator": "127.0.0.1:1", "token": "t", **changes})


@pytest.mark.parametrize("changes, flag", [
    ({"coordinator": ""}, "--coordinator"),
    ({"status_port": 70000}, "--status-port"),
    ({"status_port": -1}, "--status-port"),
    ({"stall_timeout": 0.0}, "--stall-timeout"),
])
def test_bad_network_options_name_the_flag(changes, flag):
    with pytest.raises(HivepathError, match=flag):
        _options(**changes)


def test_identity_in_use_stops_before_anything_starts(tmp_path):
    from peer.network import IdentityInUseError, load_or_create_identity

    held = load_or_create_identity(tmp_path / "identity.key")
    startup = PeerStartup(_options(status_port=0), tmp_path, PeerStatus(), "peer")
    try:
        with pytest.raises(IdentityInUseError) as e:
            startup.__enter__()
    finally:
        held.release()
    assert e.value.exit_code == 6 and startup.client is None
    assert PeerStartup(_options(identity=tmp_path / "other.key"), tmp_path, PeerStatus(), "peer").identity == \
        tmp_path / "other.key"


class _Recorder:
    """Stands in for the client, the DHT, the averager and the status page: records teardown calls."""

    def __init__(self, calls: list[str], name: str, fail: str = ""):
        self.calls, self.name, self.fail = calls, name, fail
        self.joined = object() if name == "client" else None
        self.retry_timeout = 60.0

    def _record(self, what: str) -> None:
        self.calls.append(f"{self.name}.{what}")
        if what == self.fail:
            raise RuntimeError(f"{self.name}.{what} failed")

    def leave(self, reason: str) -> None:
        self._record(f"leave({reason})")

    def close(self) -> None:
        self._record("close")

    def shutdown(self) -> None:
        self._record("shutdown")

    def stop(self) -> None:
        self._record("stop")


def _started(tmp_path, calls: list[str], fail: tuple[str, str] = ("", "")) -> PeerStartup:
    status = PeerStatus()
    startup = PeerStartup(_options(), tmp_path, status, "peer", leave_reason=lambda: "drained")
    parts = {name: _Recorder(calls, name, fail[1] if fail[0] == name else "")
             for name in ("client", "dht", "averager", "status")}
    startup.client, startup.dht, startup.averager, startup._status_server = (
        parts["client"], parts["dht"], parts["averager"], parts["status"])
    return startup


def test_teardown_runs_in_reverse_and_leaves_first(tmp_path):
    calls: list[str] = []
    startup = _started(tmp_path, calls)
    startup.close()
    assert calls == ["client.leave(drained)", "client.close", "averager.shutdown", "dht.shutdown", "status.stop"]
    assert startup.status.state == "stopped"
    startup.close()
    assert len(calls) == 5, "a second close does nothing"


def test_a_failing_teardown_step_does_not_skip_the_rest(tmp_path):
    calls: list[str] = []
    startup = _started(tmp_path, calls, fail=("averager", "shutdown"))
    with pytest.raises(RuntimeError, match="averager.shutdown failed"):
        startup.close()
    assert calls[-2:] == ["dht.shutdown", "status.stop"]
    calls.clear()
    startup = _started(tmp_path, calls, fail=("client", "leave(drained)"))
    with pytest.raises(RuntimeError):
        startup.close()
    assert calls == ["client.leave(drained)", "client.close", "averager.shutdown", "dht.shutdown", "status.stop"]


def test_run_until_stopped_returns_the_exit_code():
    class Process:
        def run(self) -> int:
            return 7

        def request_stop(self, reason: str, preempting: bool = False) -> None:
            raise AssertionError("nothing asked it to stop")

    assert run_until_stopped(Process()) == 7


_DRAINING = textwrap.dedent("""
    import os, signal, sys, threading, time
    from peer.node.startup import drain_signals

    asked = threading.Event()
    reasons = []

    def on_first(reason):
        reasons.append(reason)
        asked.set()

    def wait(event, seconds):
        # short waits: a signal the kernel hands to another thread runs its Python handler only when
        # the main thread next wakes, as a training loop's main thread does all the time
        deadline = time.monotonic() + seconds
        while not event.wait(0.05) and time.monotonic() < deadline:
            pass
        return event.is_set()

    with drain_signals(on_first):
        print("ready", flush=True)
        if not wait(asked, 60):
            sys.exit(3)
        if sys.argv[1] == "again":
            print("draining", flush=True)
            wait(threading.Event(), 60)  # the second signal ends the process here
    print(reasons[0], flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # late signals after the drain are ignored: exit stays 0
    os.kill(os.getpid(), signal.SIGHUP)
""")


def _draining_process(mode: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _DRAINING, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_each_drain_signal_drains_once_and_exits_cleanly(sig):
    proc = _draining_process("once")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == f"{signal.Signals(sig).name} received"


def test_a_second_signal_exits_at_once():
    proc = _draining_process("again")
    proc.send_signal(signal.SIGHUP)
    assert proc.stdout.readline().strip() == "draining"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "second SIGTERM" in err, err


def test_the_reachability_line_says_which_relay_carries_a_natted_peer():
    from peer.coordinator_client import JoinInfo
    from peer.node.startup import reachability_line

    relay = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWRelay"
    base = dict(run_config=None, run_config_hash="", lattice_hash="", manifest_hash="", initial_peers=(),
                lease_id="l", lease_duration=30.0, heartbeat_interval=5.0, assignment=None, rejoined=False)
    level, line = reachability_line(JoinInfo(**base, reachability="relayed",
                                             reachable_addr=f"{relay}/p2p-circuit/p2p/12D3KooWMe"), False)
    assert line.startswith("behind NAT: relayed via 12D3KooWRelay (dialled at ") and level == 20
    level, line = reachability_line(JoinInfo(**base, reachability="unreachable", observed_addr="198.51.100.7"), False)
    assert line.startswith("cannot be reached and no relay answers") and "198.51.100.7" in line and level == 30


def test_a_natted_peer_announces_one_circuit_per_relay():
    from peer.network import circuit_addrs

    relays = ["/ip4/203.0.113.5/tcp/1/p2p/12D3KooWA", "/ip4/203.0.113.6/tcp/1/p2p/12D3KooWB/",
              "/ip4/203.0.113.7/tcp/1", "/ip4/203.0.113.5/tcp/1/p2p/12D3KooWA/p2p-circuit"]
    assert circuit_addrs(relays) == ["/ip4/203.0.113.5/tcp/1/p2p/12D3KooWA/p2p-circuit",
                                     "/ip4/203.0.113.6/tcp/1/p2p/12D3KooWB/p2p-circuit"]
