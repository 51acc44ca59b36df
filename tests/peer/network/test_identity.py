"""Persistent peer identity: a stable peer id across restarts, and one live peer per identity file."""

from __future__ import annotations

import sys

import pytest

from peer.localnet import wait_for
from peer.network import IdentityError, IdentityInUseError, load_or_create_identity, peer_id_of

HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from peer.network.identity import load_or_create_identity
ident = load_or_create_identity({path!r})
print("HOLDING", ident.peer_id, flush=True)
time.sleep(600)
"""


def test_new_identity_file_gives_a_stable_peer_id(tmp_path):
    path = tmp_path / "peer.key"
    with load_or_create_identity(path) as first:
        assert path.exists() and first.peer_id.startswith(("Qm", "12D3"))
    with load_or_create_identity(path) as again:
        assert again.peer_id == first.peer_id == peer_id_of(path)
    other = load_or_create_identity(tmp_path / "other.key")
    assert other.peer_id != first.peer_id
    other.release()


def test_identity_held_in_this_process_is_refused(tmp_path):
    path = tmp_path / "peer.key"
    held = load_or_create_identity(path)
    with pytest.raises(IdentityInUseError) as err:
        load_or_create_identity(path)
    assert err.value.exit_code == 6
    assert str(path) in str(err.value) and "its own work dir" in str(err.value)
    held.release()
    load_or_create_identity(path).release()  # free again once released


@pytest.mark.integration
def test_identity_held_by_a_live_process_is_refused_until_it_dies(procs, tmp_path):
    from helpers.procs import ROOT

    path = tmp_path / "peer.key"
    procs.start("holder", [sys.executable, "-c", HOLD.format(root=str(ROOT), path=str(path))])
    wait_for(lambda: "HOLDING" in procs.log("holder"), 60, "the holder to lock the identity")
    holder_id = procs.log("holder").split("HOLDING ")[1].split()[0]
    with pytest.raises(IdentityInUseError, match=f"pid {procs.procs['holder'].pid}"):
        load_or_create_identity(path)
    procs.kill("holder")  # the kernel drops the lock with the process: no stale lock after a crash
    with load_or_create_identity(path) as mine:
        assert mine.peer_id == holder_id


def test_malformed_or_unplaceable_identity_files_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key")
    with pytest.raises(IdentityError, match="not a libp2p private key"):
        load_or_create_identity(bad)
    load_or_create_identity(bad.parent / "fine.key").release()  # the failed attempt left no lock behind
    with pytest.raises(IdentityError, match="does not exist"):
        load_or_create_identity(tmp_path / "missing-dir" / "peer.key")


@pytest.mark.integration
def test_dht_restarted_with_the_same_identity_keeps_its_peer_id(tmp_path):
    from peer.network import DHTOptions, start_dht

    opts = DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(tmp_path / "peer.key"))
    with start_dht(opts) as first:
        first_id = first.peer_id
        assert first.maddrs() and all(m.endswith(first_id) for m in first.maddrs())
        with pytest.raises(IdentityInUseError):
            start_dht(opts)
    with start_dht(opts) as second:
        assert second.peer_id == first_id
