"""Stage mode without the network: record schemas, wire tensors, stochastic wiring, the proto stubs."""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from peer.stage.client import _ServerStats, choose_server
from protos.hivepath.peer.v1.stage_pb2 import EncodedTensor
from peer.stage.records import (
    StageServerEntry,
    StageServerRecord,
    parse_stage_record,
    stage_record_value,
    stage_records_from_value,
    stage_servers_key,
)
from peer.stage import WireError, activation_codec, decode_tensor, encode_tensor

ROOT = Path(__file__).resolve().parents[3]
PEER = "12D3KooWQgGPyXufy9nuCHQ1h864dgAULs9sg4sTTuxWVeGR2LH9"
OTHER = "12D3KooWPHiTMJc6RGXWMVX88j44z6kA9vhFozjTEFMnJRHTWzSh"
GOOD = {"module_id": "L0M1", "config_hash": "33cebb9f1604bfb7", "throughput": 1500.0, "queue_length": 2}


def test_key_builder_names_run_and_module_and_refuses_bad_parts():
    assert stage_servers_key("tiny", "L0M1") == "tiny_L0M1_stages"
    for run, mid in (("Tiny", "L0M1"), ("a.b", "L0M1"), ("tiny", "L0.M1"), ("", "L0M1"), ("tiny", "blocks")):
        with pytest.raises(ValueError):
            stage_servers_key(run, mid)


def test_valid_record_round_trips():
    rec = parse_stage_record("L0M1", PEER, stage_record_value(StageServerRecord(**GOOD)))
    assert rec == StageServerRecord(**GOOD)
    assert isinstance(parse_stage_record("L0M1", PEER, {**GOOD, "throughput": 3}).throughput, float)


@pytest.mark.parametrize("change, why", [
    ({"module_id": "L0M0"}, "key's module"),
    ({"config_hash": "not-hex"}, "hex hash"),
    ({"config_hash": ""}, "hex hash"),
    ({"throughput": float("nan")}, "throughput"),
    ({"throughput": -1.0}, "throughput"),
    ({"throughput": True}, "throughput"),
    ({"throughput": "fast"}, "throughput"),
    ({"queue_length": -3}, "queue_length"),
    ({"queue_length": 1.5}, "queue_length"),
    ({"queue_length": 10**9}, "queue_length"),
])
def test_invalid_records_are_ignored_and_logged(change, why, caplog):
    assert parse_stage_record("L0M1", PEER, {**GOOD, **change}) is None
    assert why in caplog.text


def test_missing_field_bad_subkey_and_non_table_are_ignored(caplog):
    partial = dict(GOOD)
    del partial["queue_length"]
    assert parse_stage_record("L0M1", PEER, partial) is None
    assert parse_stage_record("L0M1", "not a peer id", GOOD) is None
    assert parse_stage_record("L0M1", PEER, [1, 2]) is None
    assert "missing ['queue_length']" in caplog.text and "subkey" in caplog.text


def test_entries_from_a_dht_value_keep_only_valid_records_with_their_expiry():
    item = lambda v, t: SimpleNamespace(value=v, expiration_time=t)  # noqa: E731 - a DHT ValueWithExpiration
    found = SimpleNamespace(value={PEER: item(GOOD, 123.5), OTHER: item({**GOOD, "queue_length": -1}, 99.0)})
    entries = stage_records_from_value("L0M1", found)
    assert list(entries) == [PEER] and entries[PEER].expires == 123.5
    assert stage_records_from_value("L0M1", None) == {}
    assert stage_records_from_value("L0M1", SimpleNamespace(value=b"junk")) == {}


@pytest.mark.parametrize("codec, tol", [("none", 0.0), ("fp16", 1e-3), ("int8", 0.02)])
def test_wire_round_trip_within_codec_error(codec, tol):
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))  # (B, T, C)
    msg = encode_tensor(x, activation_codec(codec))
    y = decode_tensor(EncodedTensor.FromString(msg.SerializeToString()), "x", 1000, last_dim=8)
    assert y.shape == x.shape and float((y - x).abs().max()) <= tol * float(x.abs().max())
    if codec == "int8":
        assert len(msg.data) < x.numel() * 4 / 3.5


def test_wire_rejects_every_malformed_tensor():
    good = encode_tensor(torch.ones(2, 4, 8), activation_codec("int8"))
    cases = {
        "shape (batch, tokens, width)": EncodedTensor(shape=[8], codec="int8", data=good.data),
        "empty dimension": EncodedTensor(shape=[2, 0, 8], codec="int8", data=b""),
        "width 16 differs": EncodedTensor(shape=[1, 4, 16], codec="int8", data=good.data),
        "more than this server accepts": EncodedTensor(shape=[200, 4, 8], codec="int8", data=good.data),
        "not one of": EncodedTensor(shape=[2, 4, 8], codec="zip", data=good.data),
        "malformed": EncodedTensor(shape=[2, 4, 8], codec="int8", data=good.data[:-3]),
        "NaN": EncodedTensor(shape=[1, 1, 16], codec="none",
                             data=torch.full((16,), float("nan")).numpy().tobytes()),
    }
    for needle, msg in cases.items():
        with pytest.raises(WireError, match=re.escape(needle)):
            decode_tensor(msg, "x", 1000, last_dim=8 if needle != "NaN" else None)
    with pytest.raises(WireError, match="differs from the expected"):
        decode_tensor(good, "grad", 1000, shape=[2, 4, 9])
    with pytest.raises(WireError, match="NaN"):
        encode_tensor(torch.tensor([[[float("inf")]]]), activation_codec("none"))


def test_stochastic_wiring_follows_throughput_over_expected_wait():
    """P(server) is proportional to throughput / expected wait, the wait being (1 + queued) / throughput."""
    def entry(peer: str, tps: float, queue: int) -> StageServerEntry:
        return StageServerEntry(peer, StageServerRecord("L0M0", "ab", tps, queue), 1e12)

    def share(entries, stats) -> float:
        rng = random.Random(0)
        return Counter(choose_server(entries, stats, rng).peer_id for _ in range(4000))[PEER] / 4000

    fast, slow = entry(PEER, 3000.0, 0), entry(OTHER, 1000.0, 0)
    assert 0.88 < share([fast, slow], {}) < 0.92  # 9:1
    # a queue of 5 on the fast server: 3000 / (6 / 3000) = 1.5e6 against 1e6
    assert 0.56 < share([entry(PEER, 3000.0, 5), slow], {}) < 0.64
    # our own requests in flight count as queued too
    assert 0.56 < share([fast, slow], {PEER: _ServerStats(in_flight=5)}) < 0.64
    # a claim is never trusted beyond twice what we measured: the "fast" server delivered 100 tokens/s
    assert share([fast, slow], {PEER: _ServerStats(measured=100.0, queue=0)}) < 0.07  # 200^2 : 1000^2
    # the claim in the last reply is fresher than the record's
    assert 0.08 < share([fast, slow], {OTHER: _ServerStats(claimed=9000.0, queue=0)}) < 0.12  # 3000^2 : 9000^2

