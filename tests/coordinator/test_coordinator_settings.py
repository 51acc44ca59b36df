"""The ``[coordinator]`` section of run.toml and the serve command's token sources."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.settings import CoordinatorSettings, load_run_and_settings, load_settings
from models.errors import ConfigError


def test_section_overrides_defaults_and_run_ignores_it(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('preset = "tiny"\n[outer]\ncodec = "fp16"\n[coordinator]\nlease_timeout = 12\nmax_peers = 5\n')
    run, settings = load_run_and_settings(p)
    assert run.run_id == "tiny" and run.outer.codec == "fp16"
    assert settings.lease_timeout == 12.0 and isinstance(settings.lease_timeout, float) and settings.max_peers == 5
    assert settings.heartbeat_interval == CoordinatorSettings().heartbeat_interval


def test_missing_section_gives_defaults(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('run_id = "x"\n')
    assert load_settings(p) == CoordinatorSettings()


@pytest.mark.parametrize("body,field", [
    ("lease_timeout = 0", "coordinator.lease_timeout"),
    ("heartbeat_interval = 40", "coordinator.heartbeat_interval"),
    ("memory_headroom = 1.5", "coordinator.memory_headroom"),
    ("sqlite_synchronous = \"OFF\"", "coordinator.sqlite_synchronous"),
    ("max_peers = true", "coordinator.max_peers"),
    ("restart_grace = \"soon\"", "coordinator.restart_grace"),
    ("typo = 1", "coordinator.typo"),
])
def test_bad_values_name_the_field(tmp_path, body, field):
    p = tmp_path / "run.toml"
    p.write_text(f"[coordinator]\n{body}\n")
    with pytest.raises(ConfigError) as e:
        load_settings(p)
    assert e.value.field == field


def test_huge_lattice_is_refused(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text("[lattice]\nlevels = 4\nmodules_per_level = 17\n")
    with pytest.raises(ConfigError, match="paths is more than the coordinator schedules"):
        load_run_and_settings(p)


def test_example_run_config_loads():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "deploy" / "run.example.toml"
    run, settings = load_run_and_settings(example)
    assert run.run_id == "demo" and run.lattice.num_paths == 4
    assert settings.lease_timeout == 30.0 and settings.rebalance_threshold == 0.25


def test_the_docs_table_of_the_settings_is_the_generated_one():
    """docs/coordinator.md's table of the ``[coordinator]`` fields comes from ``CoordinatorSettings``
    (type, default, docstring): a field added, or a default changed, without regenerating it fails here."""
    from pathlib import Path

    from coordinator.settings import CoordinatorSettings, field_docs, markdown_table, update_markdown

    docs = field_docs()
    assert set(docs) == {f.name for f in dataclasses.fields(CoordinatorSettings)}, "every field has a docstring"
    assert "| `lease_timeout` | float | `30.0` |" in markdown_table()
    text = (Path(__file__).resolve().parents[2] / "docs" / "coordinator.md").read_text()
    assert update_markdown(text) == text, "regenerate it: python -m coordinator.settings --update docs/coordinator.md"
