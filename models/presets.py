"""Named run presets, and the TOML run-config file that starts from one.

Presets are plain functions returning a :class:`models.config.RunConfig`; a run-config file names
one (``preset = "tiny"``) or starts from the defaults, and overrides any field; the command line
overrides the file.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from models.config import InnerConfig, LatticeConfig, OuterConfig, RunConfig
from models.errors import ConfigError

__all__ = ["tiny_cpu", "demo", "dense", "PRESETS", "load_run_config", "read_toml"]


def tiny_cpu() -> RunConfig:
    """A few-thousand-parameter 2x2 lattice for tests: trains in seconds on one core."""
    return RunConfig(
        run_id="tiny",
        lattice=LatticeConfig(d_model=32, n_heads=2, blocks_per_module=1, seq_len=32),
        inner=InnerConfig(lr=3e-3, warmup_steps=5, batch_size=8),
        outer=OuterConfig(inner_steps=10, round_timeout=20.0),
    )


def demo() -> RunConfig:
    """The demo network's 2x2 byte-level lattice, sized for a 2-core laptop.

    Outer momentum 0.5 rather than DiLoCo's 0.9: at this scale it won at every H measured
    (``docs/BENCHMARKS.md``, outer hyperparameters)."""
    return RunConfig(
        run_id="demo",
        lattice=LatticeConfig(d_model=96, n_heads=4, blocks_per_module=1, seq_len=96),
        inner=InnerConfig(lr=3e-3, warmup_steps=30, batch_size=16),
        outer=OuterConfig(inner_steps=30, round_timeout=20.0, momentum=0.5),
    )


def dense() -> RunConfig:
    """The dense baseline: a 1x1 lattice (plain data-parallel DiLoCo)."""
    return RunConfig(
        run_id="dense",
        lattice=LatticeConfig(d_model=128, n_heads=4, blocks_per_module=2, levels=1, modules_per_level=1),
    )


PRESETS = {"tiny": tiny_cpu, "demo": demo, "dense": dense}
"""Preset functions by the name a run-config file or ``--preset`` gives."""


def _preset_name(name: Any) -> str:
    if name not in PRESETS:
        raise ConfigError("preset", f"'{name}' is not one of {', '.join(PRESETS)}")
    return name


def read_toml(path: Union[str, Path]) -> dict[str, Any]:
    """The tables of a run-config file; a missing, unreadable or malformed file is a
    :class:`ConfigError` naming it (the coordinator reads its ``[coordinator]`` table with this too)."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("run-config", f"file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("run-config", f"cannot read {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("run-config", f"{path} is not valid TOML: {e}") from None


def load_run_config(path: Union[str, Path], ignore_sections: tuple[str, ...] = ()) -> RunConfig:
    """Read a TOML run config; sections named in ``ignore_sections`` belong to someone else
    (the coordinator reads its own ``[coordinator]`` section)."""
    raw = {k: v for k, v in read_toml(path).items() if k not in ignore_sections}
    preset = raw.pop("preset", None)
    base = PRESETS[_preset_name(preset)]().to_dict() if preset else RunConfig().to_dict()
    for key, value in raw.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return RunConfig.from_dict(base)
