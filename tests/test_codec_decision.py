"""The codec is decided in one place and passed, never re-derived.

Its specification (names, block size, exact sizes) lives in the torch-free ``models.codec_spec``, which
the implementation in ``peer.averaging`` must match byte for byte; the coordinator's assignment carries
the run's codec to the peer, whose ``DiLoCoOptimizer`` resolves it once and hands the same ``Codec`` to
every exchange."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import codec_spec
from models.codec_spec import BLOCK, CODECS, ENTROPY_STAGES, encoded_size, split_wire_name, wire_name
from models.config import InnerConfig, OuterConfig
from models.errors import ConfigError
from peer import averaging
from peer.averaging import LocalAverager, get_codec
from peer.coordinator_client import WorkAssignment
from peer.diloco import DiLoCoOptimizer, optimizer as optimizer_module

WIRE_NAMES = [wire_name(c, e) for c in CODECS for e in ENTROPY_STAGES]
SIZES = [0, 1, 2, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5]


@pytest.mark.parametrize("name", CODECS)
def test_the_implementation_encodes_to_the_specified_size(name):
    spec = codec_spec.codec_spec(name)
    for n in SIZES:
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))  # (n,)
        assert len(get_codec(name).encode(x)) == spec.encoded_size(n) == get_codec(name).encoded_size(n), (name, n)


def test_the_block_size_is_the_specs_and_not_256():
    assert averaging.BLOCK is codec_spec.BLOCK == 1024
    # one scale per 1024 values: 2048 int8 values take two 4-byte scales, 4097 take five
    assert encoded_size("int8", 2 * BLOCK) == 2 * BLOCK + 2 * 4
    assert encoded_size("int4", 4 * BLOCK + 1) == 2 * BLOCK + 1 + 5 * 4


@pytest.mark.parametrize("name", WIRE_NAMES)
def test_every_wire_name_is_implemented_with_its_specified_bound(name):
    codec = get_codec(name)
    assert codec.name == name and split_wire_name(name) == (name.split("+")[0], name.partition("+")[2] or "none")
    for n in SIZES:
        assert codec.encoded_size(n) == encoded_size(name, n)


@pytest.mark.parametrize("bad", ["int3", "int8+none", "int8+lz4", "+zstd", "", None])
def test_unknown_names_are_refused_alike_by_the_spec_and_the_registry(bad):
    with pytest.raises(ValueError, match="unknown codec"):
        split_wire_name(bad)
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec(bad)


def test_config_validates_codec_names_from_the_spec():
    assert OuterConfig(codec="int4", entropy="none").wire_codec() == "int4"
    assert OuterConfig(codec="fp16").wire_codec() == "fp16+zstd"
    with pytest.raises(ConfigError, match="codec"):
        OuterConfig(codec="int2")


def test_the_assignment_carries_the_codec_into_the_outer_config():
    run = OuterConfig(codec="int8", inner_steps=10)
    given = WorkAssignment("path", (0, 1), "", ("embed",), 40, "fp16", "slow link", 3)
    outer = given.outer_config(run)
    assert (outer.codec, outer.inner_steps, outer.entropy) == ("fp16", 40, run.entropy)
    unset = WorkAssignment("path", (0, 1), "", ("embed",), 0, "", "", 1)
    assert unset.outer_config(run) == run
    with pytest.raises(ConfigError, match="codec"):
        WorkAssignment("path", (0,), "", (), 0, "gzip", "", 1).outer_config(run)


class _Spy:
    """A ModuleAverager that records the codec object of every exchange and averages alone."""

    def __init__(self) -> None:
        self.member = LocalAverager().member("solo")
        self.codecs: list[object] = []

    def average(self, module_id, round_no, tensors, weight, codec, timeout, digest=""):
        self.codecs.append(codec)
        return self.member.average(module_id, round_no, tensors, weight, codec, timeout, digest)


def test_the_optimizer_resolves_the_codec_once_and_passes_it_to_every_exchange(monkeypatch):
    calls: list[str] = []

    def counting(name: str):
        calls.append(name)
        return get_codec(name)

    monkeypatch.setattr(optimizer_module, "get_codec", counting)
    mods = {"embed": nn.Linear(4, 4), "head": nn.Linear(4, 2)}
    spy = _Spy()
    outer = OuterConfig(codec="int4", entropy="zstd", inner_steps=1)
    opt = DiLoCoOptimizer(mods, InnerConfig(warmup_steps=0), outer, averager=spy)
    for _ in range(3):
        sum(m(torch.ones(1, 4)).sum() for m in mods.values()).backward()
        report = opt.step()
        assert report is not None and all(r.applied for r in report.modules.values())
        opt.zero_grad()
    assert calls == ["int4+zstd"]
    assert len(spy.codecs) == 6 and all(c is opt.codec is get_codec("int4+zstd") for c in spy.codecs)


def test_an_averager_refuses_a_codec_name_before_anything_is_sent():
    member = LocalAverager().member("a")
    with pytest.raises(TypeError, match="get_codec"):
        member.average("embed", 0, [torch.ones(3)], 1.0, "int8", 1.0)
