"""Log lines a machine reads (``--log-format json``) and the demo's plain output off a terminal: every
log line of a command is one JSON object with the fields of the events (``time``, ``event``), hivemind's
and the warnings' too, and a user error ends with a JSON ``error`` line; the demo without its live
table prints a progress line at an interval and one line per event of a peer."""

from __future__ import annotations

import importlib
import io
import json
import logging
import subprocess
import sys

import pytest

from helpers.cli import run_cli
from helpers.procs import ROOT
from peer.localnet import hivepath_cmd
from models.log_format import JsonFormatter, event_extra
from models.presets import tiny_cpu
from peer.demo import DemoMonitor, PeerLines


def _record(msg: str, *args, exc=None, **extra) -> logging.LogRecord:
    record = logging.LogRecord("peer.x", logging.WARNING, __file__, 1, msg, args, exc)
    for k, v in extra.items():
        setattr(record, k, v)
    return record


def test_a_json_line_has_the_fields_of_the_events():
    line = json.loads(JsonFormatter().format(_record("disk %s full", "/data")))
    assert set(line) == {"time", "event", "level", "logger", "message"}
    assert line["event"] == "log" and line["level"] == "WARNING" and line["logger"] == "peer.x"
    assert line["message"] == "disk /data full" and isinstance(line["time"], float)


def test_a_json_line_names_the_standard_level_after_hivemind_renamed_it():
    importlib.import_module("hivemind.utils.logging")  # renames WARNING to WARN for the whole process
    assert logging.getLevelName(logging.WARNING) == "WARN"
    line = json.loads(JsonFormatter().format(_record("disk %s full", "/data")))
    assert line["level"] == "WARNING"


def test_an_event_record_carries_its_fields_and_a_traceback_its_text():
    extra = event_extra("round", module="L0M1", round=3, seconds=float("nan"), message="clash", path=(0, 1))
    line = json.loads(JsonFormatter().format(_record("round done", **extra)))
    assert line["event"] == "round" and line["module"] == "L0M1" and line["round"] == 3
    assert line["seconds"] is None, "non-finite numbers are null, as in every JSON line"
    assert line["message"] == "round done" and line["field_message"] == "clash" and line["path"] == [0, 1]
    try:
        raise KeyError("k")
    except KeyError:
        line = json.loads(JsonFormatter().format(_record("failed", exc=sys.exc_info())))
    assert line["exc"].startswith("Traceback") and "KeyError: 'k'" in line["exc"]


def test_json_mode_takes_hivemind_and_warnings_too():
    """hivemind gives its loggers a coloured handler of its own when imported; in JSON mode its records
    are JSON lines like the others, whether it was imported before the set-up or after."""
    code = """if True:
        import logging, sys, warnings
        from models.log_format import setup_logging
        if sys.argv[1] == "before":
            import hivemind.utils.logging
        setup_logging("INFO", "json")
        from hivemind.utils.logging import get_logger
        get_logger("hivemind.dht.x").info("from hivemind")
        warnings.warn("from warnings")
        logging.getLogger("peer.y").info("from peer")
    """
    for when in ("before", "after"):
        r = subprocess.run([sys.executable, "-c", code, when], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        lines = [json.loads(line) for line in r.stderr.splitlines()]  # every line is JSON, or this raises
        assert [(l["logger"], l["event"]) for l in lines] == [
            ("hivemind.dht.x", "log"), ("py.warnings", "log"), ("peer.y", "log")], (when, lines)
        assert "from warnings" in lines[1]["message"]


def test_the_command_line_ends_an_error_with_a_json_error_line():
    """The installed command, in its own process: JSON mode changes the process's logging for good."""
    r = subprocess.run(hivepath_cmd("--log-format", "json", "coordinator", "status", "--coordinator", "no:port:here",
                                    "--token", "x"), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    [line] = [json.loads(l) for l in r.stderr.splitlines()]
    assert line["event"] == "error" and line["exit_code"] == 2 and line["level"] == "ERROR"
    assert "no:port:here" in line["message"]
    plain = run_cli("coordinator", "status", "--coordinator", "no:port:here", "--token", "x")
    assert plain.stderr.startswith("hivepath: error: ") and "no:port:here" in plain.stderr


def test_a_bad_log_format_variable_is_one_line_naming_it():
    r = run_cli("coordinator", "status", env={"HIVEPATH_LOG_FORMAT": "xml"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "HIVEPATH_LOG_FORMAT" in line and "'xml'" in line and "text, json" in line


# -- the demo off a terminal ----------------------------------------------------------------------


def _status(tokens: int) -> dict:
    return {"peers": [{"peer_id": "QmA", "mode": "path", "tokens": tokens, "path": [0, 1]},
                      {"peer_id": "QmArchive", "mode": "archive", "tokens": 0}],
            "modules": [{"module_id": "L0M0", "round": 2}], "paths": [], "bytes_exchanged": 2_500_000}


class _Client:
    def __init__(self):
        self.tokens = 0

    def status(self):
        self.tokens += 512
        return _status(self.tokens)


def test_the_plain_demo_prints_progress_at_its_interval_and_every_event(tmp_path, caplog):
    log = tmp_path / "peer0.log"
    log.write_text("")
    lines = PeerLines()
    lines.watch("peer0", log)
    monitor = DemoMonitor(tiny_cpu(), live=False, lines=lines, interval=3600.0)
    monitor.bpb_before = 8.123
    with open(log, "a") as f:
        f.write(json.dumps({"time": 1.0, "event": "join", "peer_id": "QmA", "run_id": "r", "reachability": "x"}) + "\n")
        f.write(json.dumps({"time": 2.0, "event": "progress", "peer_id": "QmA", "mode": "path", "assignment": "0,1",
                            "state": "training", "tokens": 512}) + "\n")
        f.write("12:00:00 INFO peer.node: a log line\n")
        f.write(json.dumps({"time": 3.0, "event": "round", "module": "L0M0", "round": 2, "status": "done"}) + "\n")
    client = _Client()
    with caplog.at_level(logging.INFO, logger="peer.demo"):
        with monitor:
            monitor.poll(client, {}, http_port=1)  # nothing listens on port 1: no validation score yet
            monitor.poll(client, {}, http_port=1)  # within the interval: no second progress line
    text = [r.getMessage() for r in caplog.records]
    progress = [t for t in text if t.startswith("demo ")]
    assert len(progress) == 1, text
    assert "1 peers, 512 tokens, 2.5 MB exchanged, rounds L0M0:r2, bits per byte 8.123 before" in progress[0]
    assert [t for t in text if t.startswith("peer0 ")] == ["peer0 join: peer_id=QmA run_id=r reachability=x",
                                                           "peer0 round: module=L0M0 round=2 status=done"]
    record = next(r for r in caplog.records if r.getMessage().startswith("demo "))
    line = json.loads(JsonFormatter().format(record))
    assert line["event"] == "demo_progress" and line["tokens"] == 512 and line["peers"] == 1
    assert line["rounds"] == {"L0M0": 2} and line["bpb_before"] == 8.123 and line["bpb_now"] is None
    event = json.loads(JsonFormatter().format(next(r for r in caplog.records if "round:" in r.getMessage())))
    assert event["event"] == "round" and event["peer"] == "peer0" and event["module"] == "L0M0"


def test_the_live_demo_prints_no_plain_lines(caplog):
    monitor = DemoMonitor(tiny_cpu(), live=True, interval=0.0)
    monitor.console.file = io.StringIO()
    with caplog.at_level(logging.INFO, logger="peer.demo"):
        with monitor:
            monitor.poll(_Client(), {}, http_port=1)
    assert not [r for r in caplog.records if r.getMessage().startswith("demo ")]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("argv,terminal,live", [([], True, True), ([], False, False), (["--no-live"], True, False),
                                                (["--log-format", "json"], True, False)])
def test_the_demo_draws_its_table_only_on_a_terminal(argv, terminal, live, monkeypatch):
    """The live table needs a terminal on stderr, no --no-live and text logs; else plain lines."""
    import hivepath.cmd_demo as cmd_demo
    from hivepath.cli import build_parser

    seen = {}

    def record_options(opts):
        seen["live"] = opts.live
        raise SystemExit(0)

    monkeypatch.setattr("peer.demo.run_demo", record_options)
    top = argv if argv[:1] == ["--log-format"] else []  # a flag of hivepath itself goes before the command
    args = build_parser().parse_args([*top, "demo", *(argv if not top else [])])
    monkeypatch.setattr(sys, "stderr", _Terminal() if terminal else io.StringIO())
    with pytest.raises(SystemExit):
        cmd_demo.run(args)
    assert seen["live"] is live
