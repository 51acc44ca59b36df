"""The DHT refuses records of unadmitted peers: the validator alone on hand-made records,
then on real hivemind DHT nodes: an outsider's store under a module's holders key is refused by an
admitted node, whose reads never return it, while an admitted peer's record is stored and read."""

from __future__ import annotations

import pickle
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from coordinator.credentials import CredentialIssuer
from peer.network import AdmissionValidator
from peer.network import GroupDeclaration, HolderRecord, group_key, holders_key, to_value

RUN_ID = "dhtadm"
CONFIG = "ef" * 8
A = "12D3KooWAdmittedPeerAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
B = "12D3KooWOtherPeerBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"


@pytest.fixture(scope="module")
def keys():
    issuer = CredentialIssuer(Ed25519PrivateKey.generate(), RUN_ID, 3600.0)
    forger = CredentialIssuer(Ed25519PrivateKey.generate(), RUN_ID, 3600.0)
    return issuer, forger


def record(key: str, subkey, value) -> DHTRecord:
    return DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                     MSGPackSerializer.dumps(value), time.time() + 30)


def test_validator_checks_credentials_of_the_runs_records(keys):
    issuer, forger = keys
    v = AdmissionValidator(RUN_ID, issuer.public_key, ["embed", "L0M0"])
    v = pickle.loads(pickle.dumps(v))  # it runs inside the DHT process
    now = time.time()
    good = issuer.issue(A, now).encode()
    holders = holders_key(RUN_ID, "L0M0")
    assert v.validate(record(holders, A, to_value(HolderRecord(CONFIG, "", 3, 1.0, 1.0, good))))
    assert not v.validate(record(holders, B, to_value(HolderRecord(CONFIG, "", 3, 1.0, 1.0, good)))), "another's"
    assert not v.validate(record(holders, A, to_value(HolderRecord(CONFIG, "", 3, 1.0, 1.0)))), "none"
    assert not v.validate(record(holders, A, to_value(HolderRecord(CONFIG, "", 3, 1.0, 1.0,
                                                                    forger.issue(A, now).encode())))), "forged"
    assert not v.validate(record(holders, A, {"anything": 1})), "junk under a listed key"
    group = group_key(RUN_ID, "L0M0", 12345)  # not listed: recognised by the declaration's shape
    assert v.validate(record(group, A, to_value(GroupDeclaration(CONFIG, "", 1.0, good, "ab" * 8))))
    assert not v.validate(record(group, A, to_value(GroupDeclaration(CONFIG, "", 1.0, digest="ab" * 8))))
    assert not v.validate(record(group, A, to_value(GroupDeclaration(CONFIG, "", 1.0, expecting=(B,))))), "a list"
    assert v.validate(record(group, A, to_value(GroupDeclaration(CONFIG, "", 1.0, good, expecting=(B,)))))
    assert v.validate(record("someone_elses_key", B, {"x": 1})), "other records are not ours to judge"


@pytest.mark.integration
def test_an_admitted_node_refuses_an_outsiders_store(keys):
    from hivemind.utils import get_dht_time

    from peer.network import DHTOptions, start_dht
    from peer.network import records_from_value

    issuer, forger = keys
    admitted = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    outsider = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=admitted.maddrs()))
    try:
        admitted.dht.add_validators([AdmissionValidator(RUN_ID, issuer.public_key, ["L0M0"])])
        key = holders_key(RUN_ID, "L0M0")
        now = time.time()
        forged = to_value(HolderRecord(CONFIG, "", 9, 1.0, 1.0, forger.issue(outsider.peer_id, now).encode()))
        outsider.dht.store(key, forged, get_dht_time() + 60, subkey=outsider.peer_id)
        mine = to_value(HolderRecord(CONFIG, "", 9, 1.0, 1.0, issuer.issue(admitted.peer_id, now).encode()))
        assert admitted.dht.store(key, mine, get_dht_time() + 60, subkey=admitted.peer_id)
        found = admitted.dht.get(key, latest=True)
        assert found is not None and set(found.value) == {admitted.peer_id}, found
        assert set(records_from_value(found, HolderRecord)) == {admitted.peer_id}
    finally:
        outsider.shutdown()
        admitted.shutdown()


def test_a_withdrawal_replaces_only_its_writers_record(keys):
    """A drained peer withdraws its records at once; only its own credential may."""
    from peer.network import withdrawal
    from peer.network.records import records_from_value

    issuer, forger = keys
    v = AdmissionValidator(RUN_ID, issuer.public_key, ["L0M0"])
    good = issuer.issue(A, time.time()).encode()
    for key in (holders_key(RUN_ID, "L0M0"), group_key(RUN_ID, "L0M0", 7)):
        assert v.validate(record(key, A, withdrawal(good)))
        assert not v.validate(record(key, B, withdrawal(good))), "withdrawing another peer's record"
        assert not v.validate(record(key, A, withdrawal())), "an uncredentialed withdrawal"
        assert not v.validate(record(key, A, withdrawal(forger.issue(A, time.time()).encode()))), "forged"

    class Item:
        def __init__(self, value):
            self.value = value

    other = "12D3KooWAdmittedPeerCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC"

    class Found:
        value = {A: Item(withdrawal(good)), other: Item(to_value(HolderRecord(CONFIG, "", 3, 1.0, 1.0)))}

    assert set(records_from_value(Found(), HolderRecord)) == {other}, "a withdrawn holder is no holder"


def test_a_withdrawal_says_the_round_its_writer_left_at(keys):
    """A withdrawal carries the round its writer's record announced and that round's config; only a
    credentialed one of our config is read back (a forged one could hold the others back), and a
    malformed round makes it no withdrawal."""
    from peer.network import withdrawal, withdrawn_rounds
    from peer.network.credentials import CredentialVerifier
    from peer.network.records import is_withdrawal

    issuer, forger = keys
    v = AdmissionValidator(RUN_ID, issuer.public_key, ["L0M0"])
    good = issuer.issue(A, time.time()).encode()
    assert v.validate(record(holders_key(RUN_ID, "L0M0"), A, withdrawal(good, 12, CONFIG)))
    assert withdrawal(good, 12, CONFIG)["round"] == 12 and "round" not in withdrawal(good)
    for bad in (-1, True, 1.5, "3", 2 ** 62):
        assert not is_withdrawal({"withdrawn": True, "round": bad}), bad

    class Item:
        def __init__(self, value):
            self.value = value

    forged_by = "12D3KooWAdmittedPeerCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC"

    class Found:
        value = {A: Item(withdrawal(good, 12, CONFIG)), B: Item(withdrawal(good)),
                 forged_by: Item(withdrawal(forger.issue(forged_by, time.time()).encode(), 40, CONFIG))}

    assert withdrawn_rounds(Found(), CONFIG, "") == {A: 12, forged_by: 40}
    assert withdrawn_rounds(Found(), CONFIG, "", CredentialVerifier(RUN_ID, issuer.public_key)) == {A: 12}
    assert withdrawn_rounds(Found(), "12" * 8, "") == {}, "a holder of another config is no holder of ours"
    assert withdrawn_rounds(Found(), CONFIG, "ab" * 8) == {}, "nor one of another dataset"
    assert withdrawn_rounds(None, CONFIG, "") == {}


def test_every_value_a_reader_takes_for_a_declaration_needs_a_credential(keys):
    """Readers read a declaration with fields they do not know (the version field, a later minor's):
    the validator recognises a declaration by its required fields alone, so no extra field lets an
    uncredentialed one be stored, while other writers' records under unlisted keys stay unjudged."""
    from peer.network.records import parse_record

    issuer, _ = keys
    v = AdmissionValidator(RUN_ID, issuer.public_key, ["L0M0"])
    good = issuer.issue(A, time.time()).encode()
    group = group_key(RUN_ID, "L0M0", 7)
    written = to_value(GroupDeclaration(CONFIG, "", 1.0, digest="ab" * 8, wire="int8"))
    assert written["v"] and written["wire"] == "int8", "the writer states its version and wire key"
    unknown = {**written, "v": "1.9", "from_a_later_minor": [1, 2]}
    unversioned = {k: x for k, x in written.items() if k not in ("v", "wire")}
    for value in (written, unknown, unversioned):
        assert parse_record(GroupDeclaration, A, value) is not None, "a reader takes it for a declaration"
        assert not v.validate(record(group, A, value)), value
        assert v.validate(record(group, A, {**value, "credential": good})), value
    assert not v.validate(record(group, A, {**written, "v": "2.0"})), "another major without a credential"
    stage = {"module_id": "L0M0", "config_hash": CONFIG, "throughput": 1.0, "queue_length": 0, "v": "1.1"}
    assert v.validate(record(f"{RUN_ID}_L0M0_stages", B, stage)), "stage-server records carry no credential"
    assert v.validate(record("data_" + "ab" * 8 + "_seeders", B, {"files": 3, "have": b"\x07", "v": "1.1"}))
