"""The peer's progress views: JSON events follow the documented schema, one
object per line; the rich panel takes log records through its own console (above the panel)."""

from __future__ import annotations

import io
import json
import logging

import pytest
from rich.console import Console

from peer.node.progress import EVENTS, JsonLinesView, PeerStatus, RichView


def test_every_event_is_one_json_line_with_its_documented_fields():
    out = io.StringIO()
    view = JsonLinesView(out, min_interval=0.0)
    view.event("round", module="L0M1", round=3, status="failed", peers=["QmA", "QmB"], group_size=2, bytes_sent=10,
               bytes_received=12, seconds=1.5, reason="holders QmC at this round did not declare in time")
    view.event("drain", reason="SIGTERM received", preempting=False, drain_timeout=60.0)
    view.update(PeerStatus(peer_id="QmA"), force=True)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["event"] for e in lines] == ["round", "drain", "progress"]
    for e in lines[:2]:
        assert set(e) == {"time", "event", *EVENTS[e["event"]]}
    assert lines[0]["peers"] == ["QmA", "QmB"] and lines[0]["status"] == "failed"
    with pytest.raises(ValueError, match="no field"):
        view.event("leave", reason="x", bogus=1)


def test_the_rich_panel_prints_log_records_above_itself_and_gives_the_handlers_back():
    root = logging.getLogger()
    stream = io.StringIO()
    plain = logging.StreamHandler(stream)
    root.addHandler(plain)
    screen = io.StringIO()
    view = RichView(Console(file=screen, force_terminal=True, width=100))
    try:
        view.update(PeerStatus(peer_id="QmPanel"), force=True)
        logging.getLogger("peer.test").warning("a line while the panel is up")
        view.event("checkpoint", path="/w/checkpoints/round-000003", round=3)
    finally:
        view.close(PeerStatus(peer_id="QmPanel"))
    assert "a line while the panel is up" in screen.getvalue() and "checkpoint" in screen.getvalue()
    assert "a line while the panel is up" not in stream.getvalue(), "the plain handler wrote through the panel"
    assert plain in root.handlers
    logging.getLogger("peer.test").warning("after the panel")
    root.removeHandler(plain)
    assert "after the panel" in stream.getvalue()


def test_the_event_table_of_the_cli_docs_is_the_schema():
    """docs/cli.md's ``--progress json`` table has one row per event of :data:`EVENTS`, naming each
    of its fields."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "cli.md").read_text(encoding="utf-8")
    table = text[text.index("| `event` | fields"):].split("\n\n")[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| (.*?) \|", table, re.M)}
    del rows["event"]  # the header
    assert set(rows) == set(EVENTS)
    for kind, names in EVENTS.items():
        assert set(names) <= set(re.findall(r"`(\w+)`", rows[kind])), kind
