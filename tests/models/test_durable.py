"""``models.durable``: a replaced file holds the old content or the whole new one, never a torn mix,
and no temporary file is left behind either way."""

from __future__ import annotations

import pytest

from models.durable import atomic_write, atomic_write_bytes, atomic_write_text


def test_a_file_is_replaced_whole(tmp_path):
    path = tmp_path / "deep" / "state.json"
    atomic_write_text(path, "first")
    atomic_write_bytes(path, b"second")
    assert path.read_bytes() == b"second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")

    def half(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write("ha")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(path, half)
    with pytest.raises(OSError, match="No space"):
        atomic_write(path, half, temp_name="state.json.tmp")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_named_temporary_is_where_the_reader_expects_none(tmp_path):
    """A fixed ``temp_name`` (a hand-off file whose reader polls for the final name) is renamed away."""
    atomic_write_text(tmp_path / "maddrs", "[]", temp_name="maddrs.tmp")
    assert (tmp_path / "maddrs").read_text() == "[]" and not (tmp_path / "maddrs.tmp").exists()
