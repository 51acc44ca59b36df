"""The typed run config: validation names the field, hashes are stable, the shape is right."""

from __future__ import annotations

import subprocess
import sys

import pytest

from models.config import LatticeConfig, OuterConfig, RunConfig, parse_path
from models.presets import load_run_config, tiny_cpu
from models.errors import ConfigError


def test_hash_is_stable_across_processes():
    code = "from models.config import RunConfig; print(RunConfig().content_hash(), RunConfig().lattice.content_hash())"
    out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout for _ in range(2)}
    assert len(out) == 1
    run_hash, lattice_hash = out.pop().split()
    assert run_hash == RunConfig().content_hash()
    assert lattice_hash == RunConfig().lattice.content_hash()


def test_hash_changes_with_any_field():
    base = LatticeConfig()
    assert LatticeConfig(d_model=64).content_hash() != base.content_hash()
    assert LatticeConfig(tie_embeddings=False).content_hash() != base.content_hash()
    assert RunConfig().replace(outer={"codec": "fp16"}).content_hash() != RunConfig().content_hash()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n_heads": 3}, "n_heads"),
        ({"d_model": 0}, "d_model"),
        ({"dropout": 1.5}, "dropout"),
        ({"levels": "2"}, "levels"),
        ({"vocab_size": True}, "vocab_size"),
    ],
)
def test_lattice_validation_names_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        LatticeConfig(**kwargs)
    assert e.value.field == field
    assert field in str(e.value)


def test_nested_errors_carry_the_section():
    with pytest.raises(ConfigError, match="outer.codec"):
        RunConfig.from_dict({"outer": {"codec": "zip"}})
    with pytest.raises(ConfigError, match="outer.entropy.*none, zstd"):
        RunConfig.from_dict({"outer": {"entropy": "lz4"}})
    with pytest.raises(ConfigError, match="lattice.bogus"):
        RunConfig.from_dict({"lattice": {"bogus": 1}})
    with pytest.raises(ConfigError, match="run_id"):
        RunConfig(run_id="Has.Dots")


def test_wire_codec_adds_the_entropy_stage():
    cfg = RunConfig()
    assert cfg.outer.entropy == "zstd" and cfg.outer.wire_codec() == f"{cfg.outer.codec}+zstd"
    assert cfg.outer.wire_codec("int4") == "int4+zstd"
    assert cfg.replace(outer={"entropy": "none"}).outer.wire_codec() == cfg.outer.codec
    assert cfg.replace(outer={"entropy": "none"}).content_hash() != cfg.content_hash()


def test_roundtrip_json_and_ints_as_floats():
    cfg = tiny_cpu().replace(outer={"lr": 1})
    assert cfg.outer.lr == 1.0 and isinstance(cfg.outer.lr, float)
    assert RunConfig.from_json(cfg.to_json()) == cfg


def test_shape_and_param_counts():
    lat = LatticeConfig(levels=2, modules_per_level=2)
    assert lat.num_paths == 4 and len(lat.paths()) == 4
    assert lat.module_ids() == ["embed", "L0M0", "L0M1", "L1M0", "L1M1", "head"]
    assert lat.path_modules((1, 0)) == ["embed", "L0M1", "L1M0", "head"]
    assert lat.paths_through("L0M1") == [(1, 0), (1, 1)]
    assert len(lat.paths_through("embed")) == 4
    private = LatticeConfig(shared_embed=False)
    assert private.path_modules((0, 1))[0] == "embed_0_1"
    d = lat.d_model
    assert lat.module_param_count("L0M0") == lat.blocks_per_module * (12 * d * d + 2 * d)
    assert lat.module_param_count("head") == d
    assert LatticeConfig(tie_embeddings=False).module_param_count("head") == d + 256 * d
    with pytest.raises(ConfigError):
        lat.path_modules((2, 0))


def test_parse_path_forms():
    assert parse_path("1,0") == (1, 0)
    assert parse_path("1-0") == (1, 0)
    assert parse_path("(1, 0)") == (1, 0)
    assert parse_path("L0M1-L1M0") == (1, 0)
    with pytest.raises(ConfigError, match="levels"):
        parse_path("1,0,1", levels=2)
    with pytest.raises(ConfigError):
        parse_path("a,b")


def test_load_run_config_toml(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('preset = "tiny"\nrun_id = "t1"\n[outer]\ninner_steps = 7\n[coordinator]\nlease_seconds = 5\n')
    cfg = load_run_config(f, ignore_sections=("coordinator",))
    assert cfg.run_id == "t1" and cfg.outer.inner_steps == 7 and cfg.lattice == tiny_cpu().lattice
    f.write_text("[outer\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_run_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "missing.toml")


def test_round_policy_validation():
    with pytest.raises(ConfigError, match="round_seconds"):
        OuterConfig(round_seconds=-1)
    assert OuterConfig(round_seconds=5).round_seconds == 5.0
