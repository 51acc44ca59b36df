"""The local network every demo, benchmark and test starts (``peer.localnet``): its run config is the
``RunConfig`` it was given, read back by the coordinator as the peers' run; a coordinator that cannot
start is reported at once with its log; processes are real and reaped."""

from __future__ import annotations

import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.config import RunConfig
from models.errors import ConfigError, HivepathError
from models.presets import PRESETS, load_run_config
from peer.localnet import LocalNetwork, ProcessGroup, preset_network, wait_for


_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"
# run ids as [a-z0-9][a-z0-9-]{0,20}, built without st.from_regex: that strategy imports hypothesis's
# regex module on first draw, deep in the test's stack, where pytest's assertion rewriting compiles it
# and CPython 3.11.7 can fail with "AST constructor recursion depth mismatch"
_RUN_IDS = st.builds(str.__add__, st.sampled_from(_ALNUM), st.text(alphabet=_ALNUM + "-", max_size=20))


@settings(max_examples=60, deadline=None)
@given(preset=st.sampled_from(sorted(PRESETS)), inner=st.integers(1, 10_000),
       lr=st.floats(1e-6, 10.0, allow_nan=False), codec=st.sampled_from(["int8", "int4", "fp16", "topk16b2"]),
       run_id=_RUN_IDS, corpus=st.text(min_size=1, max_size=30))
def test_a_run_config_written_as_toml_reads_back_equal(tmp_path_factory, preset, inner, lr, codec, run_id, corpus):
    cfg = PRESETS[preset]().replace(run_id=run_id, outer={"inner_steps": inner, "lr": lr, "codec": codec},
                                    data={"corpus": corpus})
    path = tmp_path_factory.mktemp("toml") / "run.toml"
    path.write_text(cfg.to_toml(coordinator={"lease_timeout": 15.0, "planner": True}))
    assert load_run_config(path, ignore_sections=("coordinator",)) == cfg


def test_an_extra_table_may_not_replace_a_section_of_the_run():
    with pytest.raises(ConfigError, match="outer"):
        RunConfig().to_toml(outer={"lr": 1.0})


def test_the_coordinator_serves_the_run_and_table_it_was_given(procs, tmp_path):
    from coordinator.settings import load_run_and_settings

    net = preset_network(procs, tmp_path, tmp_path / "data", "ab" * 32, preset="demo", run_id="localnet",
                         inner_steps=7, lattice={"levels": 1, "modules_per_level": 1},
                         coordinator={"servers_per_level": 2})
    net.start_coordinator()
    assert net.status() is not None and net.status_json() is not None
    run, coordinator = load_run_and_settings(net.run_toml)  # what the coordinator read at start
    assert run == PRESETS["demo"]().replace(run_id="localnet", outer={"inner_steps": 7},
                                            lattice={"levels": 1, "modules_per_level": 1},
                                            data={"manifest_hash": "ab" * 32, "corpus": "default"})
    assert coordinator.servers_per_level == 2 and coordinator.lease_timeout == 8.0
    assert coordinator.heartbeat_interval == 1.0
    net.close()


def test_a_coordinator_that_exits_is_reported_at_once_with_its_log(procs, tmp_path):
    net = LocalNetwork(procs, tmp_path, tmp_path / "data", PRESETS["tiny"](), {"lease_timeout": -1.0})
    with pytest.raises(HivepathError, match="coordinator exited with code 2.*coordinator.log"):
        net.start_coordinator(timeout=300.0)
    assert "lease_timeout" in procs.log("coordinator")


def test_a_process_group_reaps_its_children_and_reads_their_events(tmp_path):
    import sys

    group = ProcessGroup(tmp_path / "logs")
    code = "import json, time\nprint(json.dumps({'event': 'join', 'n': 1}))\nprint('{cut')\nprint(json.dumps({'n': 2}))\ntime.sleep(600)"
    proc = group.start("child", [sys.executable, "-c", code])
    wait_for(lambda: len(group.json_lines("child")) == 2, 60, "the child's two events")
    assert group.json_lines("child", "join") == [{"event": "join", "n": 1}]
    assert group.exited() == []
    group.signal("child", signal.SIGTERM)
    wait_for(lambda: proc.poll() is not None, 60, "the child to exit on SIGTERM")
    assert group.exited() == ["child"]
    group.stop()


def test_none_exited_names_a_child_that_exited_with_the_end_of_its_log(tmp_path):
    import sys

    group = ProcessGroup(tmp_path / "logs")
    group.start("quitter", [sys.executable, "-c", "print('cannot bind the port'); raise SystemExit(3)"])
    group.start("stayer", [sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        wait_for(lambda: group.exited() == ["quitter"], 60, "the quitter to exit")
        assert group.none_exited(["stayer"])
        with pytest.raises(RuntimeError, match=r"exited early: \['quitter'\].*cannot bind the port"):
            wait_for(lambda: group.none_exited(), 60, "never", retry_on=())
    finally:
        group.stop()
