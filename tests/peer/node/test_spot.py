"""Spot-notice watcher against a real local HTTP server playing AWS IMDSv2 and GCP metadata.

Bad input is checked here too: an endpoint that times out, refuses the connection,
answers 404 or answers nonsense is never taken for a preemption.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest

from peer.localnet import free_port, wait_for
from models.errors import ConfigError
from peer.node.spot import (
    AwsSpotNotice,
    GcpPreemptionNotice,
    SpotNotice,
    SpotOptions,
    SpotWatcher,
    build_sources,
)

_spec = importlib.util.spec_from_file_location(
    "fake_metadata", Path(__file__).resolve().parents[2] / "docker" / "fake_metadata.py")
fake_metadata = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_metadata)


@pytest.fixture
def meta():
    with fake_metadata.FakeMetadata() as server:
        yield server


def _refused_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


# -- AWS ---------------------------------------------------------------------------------------


def test_aws_no_action_is_not_a_notice_and_uses_an_imdsv2_token(meta):
    src = AwsSpotNotice(meta.url)
    assert src.check() is None  # 404: nothing scheduled
    puts = [r for r in meta.state.requests if r[0] == "PUT"]
    gets = [r for r in meta.state.requests if r[0] == "GET"]
    assert puts and puts[0][1] == "/latest/api/token" and int(puts[0][2]["x-aws-ec2-metadata-token-ttl-seconds"]) > 0
    assert gets[0][2]["x-aws-ec2-metadata-token"] in meta.state.valid_tokens
    assert src.check() is None
    assert len([r for r in meta.state.requests if r[0] == "PUT"]) == 1, "the token is reused until it expires"


def test_aws_instance_action_is_a_notice_with_its_deadline(meta):
    meta.state.control({"aws_action": "terminate", "aws_in": 90})
    notice = AwsSpotNotice(meta.url).check()
    assert notice is not None and notice.provider == "aws" and notice.action == "terminate"
    assert 80 <= notice.seconds_left() <= 91
    assert "aws: terminate" in notice.describe()


def test_aws_expired_token_is_refetched_once(meta):
    src = AwsSpotNotice(meta.url)
    assert src.check() is None
    meta.state.control({"expire_tokens": True, "aws_action": "stop"})
    notice = src.check()
    assert notice is not None and notice.action == "stop"
    assert len([r for r in meta.state.requests if r[0] == "PUT"]) == 2


def test_aws_imdsv1_only_instance_still_reads_the_action(meta):
    meta.state.token_enabled = False
    meta.state.control({"aws_action": "hibernate"})
    notice = AwsSpotNotice(meta.url).check()
    assert notice is not None and notice.action == "hibernate"


@pytest.mark.parametrize("raw", ["", "not json", '{"time": "2026-01-01T00:00:00Z"}', '{"action": "reboot"}'])
def test_aws_malformed_answer_is_not_a_notice(meta, raw):
    meta.state.aws_raw = raw
    assert AwsSpotNotice(meta.url).check() is None


# -- GCP ---------------------------------------------------------------------------------------


def test_gcp_false_then_true(meta):
    src = GcpPreemptionNotice(meta.url, notice_seconds=30.0)
    assert src.check() is None
    assert meta.state.requests[-1][2]["metadata-flavor"] == "Google"
    meta.state.control({"gcp_preempted": True})
    notice = src.check()
    assert notice is not None and notice.provider == "gcp" and notice.action == "preempt"
    assert 25 <= notice.seconds_left() <= 30


def test_gcp_answer_without_metadata_flavor_is_not_a_notice(meta):
    meta.state.control({"gcp_preempted": True})
    meta.state.gcp_flavor_header = False
    assert GcpPreemptionNotice(meta.url).check() is None


# -- endpoints that do not answer --------------------------------------------------------------


@pytest.mark.parametrize("cls", [AwsSpotNotice, GcpPreemptionNotice])
def test_connection_refused_is_not_a_notice(cls):
    assert cls(_refused_url(), request_timeout=0.5).check() is None


@pytest.mark.parametrize("cls", [AwsSpotNotice, GcpPreemptionNotice])
def test_404_is_not_a_notice(meta, cls):
    # A server that is not a metadata server at all: every path of ours is 404 under this prefix.
    assert cls(meta.url + "/elsewhere").check() is None


@pytest.mark.parametrize("cls", [AwsSpotNotice, GcpPreemptionNotice])
def test_timeout_is_not_a_notice(meta, cls):
    meta.state.control({"aws_action": "terminate", "gcp_preempted": True})
    meta.state.hang.set()
    # the endpoint would answer with a notice after 60 s: None means the request gave up at its timeout
    assert cls(meta.url, request_timeout=0.3).check() is None


# -- the watcher -------------------------------------------------------------------------------


def test_watcher_calls_back_once_on_the_first_notice(meta):
    seen: list[SpotNotice] = []
    fired = threading.Event()

    def on_notice(n: SpotNotice) -> None:
        seen.append(n)
        fired.set()

    watcher = SpotWatcher([AwsSpotNotice(meta.url)], on_notice, poll_interval=0.05).start()
    try:
        wait_for(lambda: watcher.polls >= 3, timeout=30.0, what="three quiet polls")
        assert not seen, "no notice is posted yet"
        meta.state.control({"aws_action": "terminate", "aws_in": 120})
        wait_for(fired.is_set, timeout=30.0, what="the notice callback")
        wait_for(lambda: not watcher.running, timeout=30.0, what="the watcher to finish")
        assert len(seen) == 1 and seen[0].action == "terminate" and watcher.notice == seen[0]
    finally:
        watcher.stop()


def test_auto_watches_both_clouds_and_ignores_the_silent_one(meta):
    opts = SpotOptions(provider="auto", base_url=meta.url, poll_interval=0.05)
    sources = build_sources(opts)
    assert [s.name for s in sources] == ["aws", "gcp"]
    meta.state.control({"gcp_preempted": True})  # AWS keeps answering 404
    fired = threading.Event()
    notices: list[SpotNotice] = []
    watcher = SpotWatcher.from_options(opts, lambda n: (notices.append(n), fired.set())).start()
    try:
        wait_for(fired.is_set, timeout=30.0, what="the GCP notice")
        assert notices[0].provider == "gcp"
    finally:
        watcher.stop()


def test_watcher_keeps_polling_through_a_broken_source(meta):
    class Broken:
        name = "broken"

        def check(self):
            raise RuntimeError("bug in a source")

    fired = threading.Event()
    meta.state.control({"gcp_preempted": True})
    watcher = SpotWatcher([Broken(), GcpPreemptionNotice(meta.url)], lambda n: fired.set(), poll_interval=0.05)
    assert watcher.check_once() is not None
    watcher.start()
    try:
        wait_for(fired.is_set, timeout=30.0, what="the notice past a broken source")
    finally:
        watcher.stop()


def test_watcher_stop_ends_a_quiet_watch():
    watcher = SpotWatcher([AwsSpotNotice(_refused_url(), request_timeout=0.2)], lambda n: None, poll_interval=0.05)
    watcher.start()
    wait_for(lambda: watcher.polls >= 2, timeout=30.0, what="two polls")
    watcher.stop()
    assert not watcher.running and watcher.notice is None


# -- options -----------------------------------------------------------------------------------


def test_options_from_env():
    assert SpotOptions.from_env({}).provider == "none"
    assert build_sources(SpotOptions.from_env({})) == []
    opts = SpotOptions.from_env({"HIVEPATH_SPOT": "GCP", "HIVEPATH_SPOT_URL": "http://meta:80",
                                 "HIVEPATH_SPOT_POLL_INTERVAL": "2.5"})
    assert (opts.provider, opts.base_url, opts.poll_interval) == ("gcp", "http://meta:80", 2.5)
    assert build_sources(opts)[0].base_url == "http://meta:80"


@pytest.mark.parametrize("env, field", [
    ({"HIVEPATH_SPOT": "azure"}, "spot"),
    ({"HIVEPATH_SPOT": "aws", "HIVEPATH_SPOT_POLL_INTERVAL": "soon"}, "spot-poll-interval"),
    ({"HIVEPATH_SPOT": "aws", "HIVEPATH_SPOT_POLL_INTERVAL": "0"}, "spot-poll-interval"),
])
def test_bad_options_name_the_problem(env, field):
    with pytest.raises(ConfigError) as e:
        SpotOptions.from_env(env)
    assert e.value.field == field and "\n" not in str(e.value)


# -- the supervisor the container images run (python -m peer.node.spot -- CMD) -----------------------

_CHILD = """
import os, signal, sys, threading
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: done.set())
open(sys.argv[1], "w").write("ready, HIVEPATH_SPOT=" + os.environ.get("HIVEPATH_SPOT", "(unset)"))
done.wait(60)
open(sys.argv[1], "w").write("drained")
sys.exit(0)
"""


def test_supervisor_sends_sigterm_on_a_notice_and_returns_the_child_exit_code(meta, procs, tmp_path):
    import os
    import sys

    marker = tmp_path / "state"
    env = {**os.environ, "HIVEPATH_SPOT": "gcp", "HIVEPATH_SPOT_URL": meta.url, "HIVEPATH_SPOT_POLL_INTERVAL": "0.1"}
    proc = procs.start("supervised", [sys.executable, "-m", "peer.node.spot", "--", sys.executable, "-c", _CHILD,
                                      str(marker)], env=env)
    # the supervisor is the one watcher: the child (a `hivepath peer join`) must not watch and drain too
    wait_for(lambda: marker.exists() and marker.read_text().startswith("ready"), timeout=20.0,
             what="the child to start")
    assert marker.read_text() == "ready, HIVEPATH_SPOT=none"
    wait_for(lambda: len(meta.state.requests) >= 2, timeout=30.0, what="the supervisor to poll")
    assert proc.poll() is None, "no notice yet: the child keeps running"
    meta.state.control({"gcp_preempted": True})
    assert proc.wait(timeout=20.0) == 0
    assert marker.read_text() == "drained"


def test_supervisor_bad_variable_is_one_line(procs):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HIVEPATH_SPOT": "azure"}
    out = subprocess.run([sys.executable, "-m", "peer.node.spot", "--", "true"], env=env, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "unknown spot provider 'azure'" in out.stderr


# -- a real peer watching in-process (`hivepath peer join --spot aws`) -------------------------------


@pytest.mark.integration
def test_real_peer_drains_on_an_aws_notice_and_leaves(meta, procs, tmp_path):
    """A real peer (coordinator, DHT, p2p daemon, training) with ``--spot aws`` polls the metadata
    endpoint in-process; the notice makes it finish its round, checkpoint, tell the coordinator and exit
    0 well within the notice's 2 minutes, and the coordinator no longer counts it as active."""
    from chaos.scenario import prepare_dataset
    from helpers.network import tiny_network

    data = prepare_dataset(tmp_path / "data")
    net = tiny_network(procs, tmp_path, data.dir, data.manifest_hash, inner_steps=4)
    try:
        net.start_coordinator()
        work = net.start_peer("peer0", "--spot", "aws", "--spot-url", meta.url, "--spot-poll-interval", "0.2")
        wait_for(lambda: "peer.node.trainer: round 1:" in net.procs.log("peer0"), 180, "peer0 to finish 2 rounds")
        peer_id = net.peer_id("peer0")
        assert net.peer_assignment(peer_id)["state"] == "active"
        assert net.procs.procs["peer0"].poll() is None, "no notice yet: the peer keeps training"
        meta.state.control({"aws_action": "terminate", "aws_in": 120})
        assert net.procs.procs["peer0"].wait(timeout=90) == 0
        log = net.procs.log("peer0")
        assert "stopping: spot preemption notice (aws: terminate" in log, log[-3000:]
        assert (work / "checkpoints" / "LATEST").exists()
        wait_for(lambda: (net.peer_assignment(peer_id) or {}).get("state") != "active", 30,
                 "the coordinator to see the peer leave")
    finally:
        net.close()
