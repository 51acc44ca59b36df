"""The codec is decided in one place and passed, never re-derived.

Its specification (names, block size, exact sizes) lives in the torch-free ``models.codec_spec``, which
the implementation in ``peer.compression`` must match byte for byte; the coordinator's assignment carries
the run's codec to the peer, whose ``DiLoCoOptimizer`` resolves it once and hands the same ``Codec`` to
every exchange. Peers and the simulator resolve it by one rule (``peer.compression.resolve_codec``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import codec_spec
from models.codec_spec import BLOCK, CODECS, ENTROPY_STAGES, encoded_size, split_wire_name, wire_name
from models.config import InnerConfig, OuterConfig
from models.presets import tiny_cpu
from models.errors import ConfigError
from peer import averaging, compression
from peer.averaging import LocalAverager
from peer.compression import get_codec, resolve_codec
from peer.coordinator_client import WorkAssignment
from peer.diloco import DiLoCoOptimizer, optimizer as optimizer_module
from peer.simulator import DiLoCoSimulator

WIRE_NAMES = [wire_name(c, e) for c in CODECS for e in ENTROPY_STAGES]
SIZES = [0, 1, 2, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5]


@pytest.mark.parametrize("name", CODECS)
def test_the_implementation_encodes_to_the_specified_size(name):
    spec = codec_spec.codec_spec(name)
    for n in SIZES:
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))  # (n,)
        assert len(get_codec(name).encode(x)) == spec.encoded_size(n) == get_codec(name).encoded_size(n), (name, n)


def test_the_block_size_is_the_specs_and_not_256():
    assert averaging.BLOCK is compression.BLOCK is codec_spec.BLOCK == 1024
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

    def counting(outer: OuterConfig, codec=None):
        calls.append(outer.wire_codec(codec))
        return resolve_codec(outer, codec)

    monkeypatch.setattr(optimizer_module, "resolve_codec", counting)
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


@pytest.mark.parametrize("entropy", ENTROPY_STAGES)
@pytest.mark.parametrize("name", [*CODECS, "topk16b2"])
def test_peers_and_the_simulator_resolve_the_same_codec(name, entropy):
    """The simulator is the peers' numerical reference: it exchanges with the codec a peer's optimizer
    resolves from the same run config, entropy stage included, and so encodes the same bytes."""
    cfg = tiny_cpu().replace(outer={"codec": name, "entropy": entropy})
    peer_opt = DiLoCoOptimizer({"embed": nn.Linear(4, 4)}, cfg.inner, cfg.outer, averager=_Spy())
    sim = DiLoCoSimulator(cfg, [(0,) * cfg.lattice.levels], 1, lambda k, path: iter(()))
    assert peer_opt.codec is sim.codec is resolve_codec(cfg.outer)
    assert sim.codec.name == wire_name(name, entropy) == cfg.outer.wire_codec()
    x = torch.randn(3 * BLOCK + 5, generator=torch.Generator().manual_seed(11)) * 0.01
    assert sim.codec.encode(x) == peer_opt.codec.encode(x) == get_codec(wire_name(name, entropy)).encode(x)


def test_a_planned_codec_is_resolved_under_the_runs_entropy_stage():
    outer = OuterConfig(codec="int8", entropy="zstd")
    assert resolve_codec(outer, "int4") is get_codec("int4+zstd")
    assert resolve_codec(outer, "topk16b2") is get_codec("topk16b2")
    with pytest.raises(ConfigError, match="codec"):
        resolve_codec(outer, "int2")
