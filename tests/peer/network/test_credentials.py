"""Admission credentials: the shared byte format, signing and every refusal reason, the coordinator's
persisted key, the peer-side verifier (peer-id binding, expiry, cache), and DHT records dropped for a
missing or foreign credential."""

from __future__ import annotations

import logging
import math
import os
import stat
import struct

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings as hsettings, strategies as st

from coordinator.credentials import CredentialIssuer, default_key_path, load_or_create_key
from models.errors import HivepathError
from peer.network import CredentialVerifier
from peer.network import GroupDeclaration, HolderRecord, records_from_value, to_value
from protos.credential import (
    MAX_CREDENTIAL_BYTES,
    CredentialError,
    decode_credential,
    sign_credential,
    verify_credential,
)

RUN_ID = "tiny"
ALICE = "12D3KooWAnnaAnnaAnnaAnnaAnna1"
MALLORY = "12D3KooWMarvinMarvinMarvin1"
NOW = 1_700_000_000.0


@pytest.fixture(scope="module")
def key():
    return Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def issuer(key):
    return CredentialIssuer(key, RUN_ID, credential_timeout=100.0)


def test_round_trip_and_byte_format(issuer):
    cred = issuer.issue(ALICE, NOW)
    blob = cred.encode()
    assert blob[:4] == b"HPC1" and blob[4] == len(RUN_ID) and blob[5:9] == b"tiny"
    assert struct.unpack(">d", blob[-72:-64])[0] == NOW + 100.0 and len(blob) <= MAX_CREDENTIAL_BYTES
    assert decode_credential(blob) == cred
    ok, problem = verify_credential(blob, issuer.public_key, RUN_ID, ALICE, NOW + 99.0)
    assert ok == cred and problem == ""


def test_each_refusal_names_its_reason(issuer, key):
    blob = issuer.issue(ALICE, NOW).encode()
    pub = issuer.public_key

    def why(b=blob, k=pub, run=RUN_ID, peer=ALICE, now=NOW):
        cred, problem = verify_credential(b, k, run, peer, now)
        assert cred is None
        return problem

    assert "not to the sender" in why(peer=MALLORY)
    assert "for run 'tiny', not 'other'" in why(run="other")
    assert "expired 1s ago" in why(now=NOW + 101.0)
    assert "not the coordinator's" in why(k=Ed25519PrivateKey.generate().public_key().public_bytes_raw())
    tampered = bytearray(blob)
    tampered[-70] ^= 1  # the expiry: a peer extending its own credential
    assert "not the coordinator's" in why(b=bytes(tampered))
    assert "bad magic" in why(b=b"XXXX" + blob[4:])
    assert "limit" in why(b=blob + b"x" * MAX_CREDENTIAL_BYTES)
    assert "signature is 63 bytes" in why(b=blob[:-1])
    assert "not a number" in why(b=sign_credential(key, RUN_ID, ALICE, math.nan).encode())
    assert "not bytes" in why(b="a string")


@hsettings(max_examples=300, deadline=None, derandomize=True)
@given(blob=st.one_of(st.binary(max_size=700), st.builds(lambda tail: b"HPC1" + tail, st.binary(max_size=700))))
def test_fuzzed_blobs_only_ever_fail_cleanly(blob):
    try:
        decode_credential(blob)
    except CredentialError:
        pass
    cred, problem = verify_credential(blob, b"\x00" * 32, RUN_ID, ALICE, NOW)
    assert cred is None and problem


def test_key_is_created_private_and_reused(tmp_path):
    path = default_key_path(str(tmp_path / "state.db"))
    assert path == str(tmp_path / "state.db.key") and default_key_path(":memory:") is None
    first = CredentialIssuer(load_or_create_key(path), RUN_ID, 10.0)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = CredentialIssuer(load_or_create_key(path), RUN_ID, 10.0)
    assert again.public_key == first.public_key
    blob = first.issue(ALICE, NOW).encode()
    assert verify_credential(blob, again.public_key, RUN_ID, ALICE, NOW)[1] == ""
    assert "key" not in repr(first).replace("CredentialIssuer", "").lower().replace("fingerprint", "")


def test_unreadable_key_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.key"
    bad.write_text("not a key")
    with pytest.raises(HivepathError, match="cannot read the coordinator key"):
        load_or_create_key(str(bad))
    with pytest.raises(HivepathError, match="does not exist"):
        load_or_create_key(str(tmp_path / "missing-dir" / "x.key"))


def test_verifier_binds_peer_and_expiry_even_when_cached(issuer):
    t = [NOW]
    v = CredentialVerifier(RUN_ID, issuer.public_key, clock=lambda: t[0])
    blob = issuer.issue(ALICE, NOW).encode()
    assert v.check(blob, ALICE) == ""
    assert "not to the sender" in v.check(blob, MALLORY)  # a replayed credential, from the cache
    t[0] = NOW + 100.5
    assert "expired" in v.check(blob, ALICE)
    assert "no credential" in v.check(b"", ALICE)
    with pytest.raises(ValueError, match="32 raw bytes"):
        CredentialVerifier(RUN_ID, b"short")


def test_records_without_a_valid_credential_are_dropped(issuer, caplog):
    v = CredentialVerifier(RUN_ID, issuer.public_key, clock=lambda: NOW)
    good = issuer.issue(ALICE, NOW).encode()
    forged = sign_credential(Ed25519PrivateKey.generate(), RUN_ID, MALLORY, NOW + 100).encode()

    class Item:
        def __init__(self, value):
            self.value = value

    class Found:
        value = {
            ALICE: Item(to_value(HolderRecord("ab", "", 1, 1.0, 1.0, good))),
            MALLORY: Item(to_value(HolderRecord("ab", "", 1, 1.0, 1.0, forged))),
            "12D3KooWNoCredNoCredNoCred1": Item(to_value(HolderRecord("ab", "", 1, 1.0, 1.0))),
            "12D3KooWCopyCopyCopyCopy1": Item(to_value(HolderRecord("ab", "", 1, 1.0, 1.0, good))),
        }

    with caplog.at_level(logging.WARNING, logger="peer.network.credentials"):
        assert set(records_from_value(Found, HolderRecord, v)) == {ALICE}
    assert len(records_from_value(Found, HolderRecord)) == 4  # no verifier: an open run
    assert "not the coordinator's" in caplog.text and "no credential" in caplog.text
    assert "not to the sender 12D3KooWCopyCopyCopyCopy1" in caplog.text
    decl = to_value(GroupDeclaration("ab", "", 1.0, b"x" * (MAX_CREDENTIAL_BYTES + 1)))

    class Oversized:
        value = {ALICE: Item(decl)}

    assert records_from_value(Oversized, GroupDeclaration) == {}
