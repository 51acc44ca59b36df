"""Stopping leaves nothing behind: the demo and a benchmark, stopped by SIGINT, SIGTERM or SIGHUP or
killed outright (SIGKILL: no handler runs), take every process they started with them, p2p daemons
and DHT processes included, within 30 s. The process trees are real: coordinator, archive, peers,
stage servers, and hivemind's p2pd under each.

Nor files: the unix sockets the tree had bound (hivemind's in ``/tmp``, torch's shared-memory
manager's in ``TMPDIR``) are gone too, and a private ``TMPDIR`` holds nothing the run made (torch's
compile cache, which the next run reuses, aside): counted for the demo and for a killed peer."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import psutil
import pytest

from peer.localnet import hivepath_cmd
from helpers.procs import ROOT
from peer.localnet import wait_for

pytestmark = pytest.mark.integration

LEFT_TIMEOUT = 30.0
"""The issue's bound: no process of the stopped command may be left after this many seconds."""


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _daemons(pid: int) -> int:
    return sum(1 for p in _tree(pid) if _name(p) == "p2pd")


def _daemon_sockets(pid: int) -> int:
    """How many ``hivemind-p2pd-*`` sockets the tree under ``pid`` has bound: a p2p daemon binds its
    socket a while after it is started, and the daemons of a tree start at about the same time."""
    sockets = _bound_sockets([psutil.Process(pid), *_tree(pid)]) if psutil.pid_exists(pid) else set()
    return sum(1 for s in sockets if os.path.basename(s).startswith("hivemind-p2pd-"))


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.NoSuchProcess:
        return ""


def _status(p: psutil.Process) -> str:
    try:
        return p.status()
    except psutil.NoSuchProcess:
        return psutil.STATUS_DEAD


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {' '.join(p.cmdline())[:120]} ({p.status()})"
    except psutil.NoSuchProcess:
        return f"{p.pid} (gone)"


KEPT_IN_TMPDIR = re.compile(r"torchinductor_\w+")
"""What may stay in a run's TMPDIR: torch's compile cache (kept for the next run, like pip's)."""
REGISTRY = re.compile(r"hivepath-\d+")
"""The machine's peer registry (``peer.node.machine_share``): its directories stay, empty."""


def _bound_sockets(processes: Sequence[psutil.Process]) -> set[str]:
    """The paths of the unix sockets ``processes`` have bound: each one's socket inodes looked up in
    the table of its own network namespace (``/proc/PID/net/unix``). psutil reads the caller's table
    only, which misses every socket of a process in another namespace (bench.swarm's peers)."""
    paths = set()
    for p in processes:
        try:
            inodes = set()
            for fd in os.listdir(f"/proc/{p.pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{p.pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[len("socket:["):-1])
            with open(f"/proc/{p.pid}/net/unix") as table:
                next(table, None)  # Num RefCount Protocol Flags Type St Inode Path
                for row in table:
                    fields = row.split(None, 7)
                    if len(fields) == 8 and fields[6] in inodes and fields[7].startswith("/"):
                        paths.add(fields[7].rstrip("\n"))
        except OSError:
            continue
    return paths


def _left_on_disk(sockets: set[str], tmpdir: Optional[Path]) -> list[str]:
    """Which of ``sockets`` still exist, and what ``tmpdir`` holds besides :data:`KEPT_IN_TMPDIR`."""
    left = sorted(s for s in sockets if os.path.lexists(s))
    if tmpdir is not None:
        for p in sorted(tmpdir.iterdir()):
            if REGISTRY.fullmatch(p.name) and p.is_dir():
                left += [str(f) for f in sorted(p.rglob("*")) if not f.is_dir()]
            elif not KEPT_IN_TMPDIR.fullmatch(p.name):
                left.append(str(p))
    return left


def _tails(logs: Sequence[Path], lines: int = 30) -> str:
    out = []
    for path in logs:
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else ["(no log)"]
        out.append(f"----- {path} -----\n" + "\n".join(text))
    return "\n".join(out)


def _rounds_in(log: Path) -> bool:
    """Whether the peer whose JSON lines go to ``log`` finished an outer round (it is all up then)."""
    try:
        lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    except FileNotFoundError:
        return False
    for line in lines:
        with contextlib.suppress(ValueError):
            if json.loads(line).get("event") == "round":
                return True
    return False


def _stop_and_check(proc: subprocess.Popen, sig: int, daemons: int, start_timeout: float,
                    logs: Sequence[Path] = (), tmpdir: Optional[Path] = None, up: Optional[Path] = None) -> None:
    """Once ``proc``'s tree holds ``daemons`` p2p daemons, send ``sig`` to ``proc`` alone and check that
    ``proc`` and every process of its tree are gone within :data:`LEFT_TIMEOUT` seconds, and with them
    the unix sockets they had bound and, where the command ran with ``tmpdir`` as its TMPDIR, whatever
    it made there; ``up``: a peer's log in which the command is all up once a round is done (its
    sockets are bound then). ``logs``: the command's log files, whose tails a failure shows."""
    try:
        try:
            wait_for(lambda: proc.poll() is not None or (_daemons(proc.pid) >= daemons and _daemon_sockets(proc.pid) >= daemons
                                                         and (up is None or _rounds_in(up))),
                     start_timeout, f"{daemons} p2p daemons under the command, listening"
                     + (f", and a round in {up.name}" if up else ""))
        except TimeoutError as e:
            tree = "; ".join(_describe(p) for p in _tree(proc.pid))
            raise AssertionError(f"{e}; its processes: {tree}\n{_tails(logs)}") from None
        if proc.poll() is not None:
            raise AssertionError(f"the command exited with {proc.returncode} before it started {daemons} p2p "
                                 f"daemons:\n{_tails(logs)}")
        tree = _tree(proc.pid)  # the processes to be stopped: children, their DHT processes and p2pds
        assert len(tree) > daemons
        sockets = _bound_sockets([psutil.Process(proc.pid), *tree])
        assert any(os.path.basename(s).startswith("hivemind-p2pd-") for s in sockets), sockets
        proc.send_signal(sig)
        wait_for(lambda: proc.poll() is not None, LEFT_TIMEOUT, f"the command to exit on {sig.name}")
        left = lambda: [p for p in tree if p.is_running() and _status(p) != psutil.STATUS_ZOMBIE]  # noqa: E731
        try:
            wait_for(lambda: not left(), LEFT_TIMEOUT, f"every process under the command to exit after {sig.name}")
        except TimeoutError:
            raise AssertionError(f"left after {sig.name}: " + "; ".join(_describe(p) for p in left())) from None
        try:
            wait_for(lambda: not _left_on_disk(sockets, tmpdir), LEFT_TIMEOUT, f"the files of the tree to go after {sig.name}")
        except TimeoutError:
            raise AssertionError(f"left on disk after {sig.name}: {_left_on_disk(sockets, tmpdir)}") from None
    finally:
        for p in [*_tree(proc.pid), psutil.Process(proc.pid)] if proc.poll() is None else []:
            p.kill()
        proc.wait(timeout=30)


def _signals(*slow: signal.Signals) -> list:
    """Every stop signal, those in ``slow`` marked slow. SIGINT, SIGTERM and SIGHUP reach one handler in
    each command (``peer.node.startup.drain_signals`` in the demo, ``bench.common.run_main`` in a
    benchmark); SIGKILL runs none (the children's parent-death signal and watchdog). The default run
    sends each command one handled signal of its own (and the demo SIGKILL, which the killed-peer test
    covers for a lone peer too); ``make test-all`` sends all four."""
    return [pytest.param(s, id=s.name, marks=[pytest.mark.slow] if s in slow else [])
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL)]


@pytest.fixture
def short_tmpdir() -> Path:
    """A private TMPDIR for a command, short enough for the unix sockets made in it: torch's
    shared-memory manager binds ``TMPDIR/torch-shm-dir-XXXXXX/manager.sock``, and a socket's path
    holds at most 107 bytes, which pytest's ``tmp_path`` under xdist (``.../popen-gwN/test_..._0/``)
    exceeds (the manager then fails with EINVAL and no peer starts its DHT)."""
    path = Path(tempfile.mkdtemp(prefix="hp-stop-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    """The tiny preset's dataset, prepared once for every demo here (the demo's own preparation is
    ``test_peer_network.test_demo_short_run_writes_report``'s)."""
    from models.presets import PRESETS
    from peer.node.run_data import ensure_dataset

    root = tmp_path_factory.mktemp("tiny")
    return ensure_dataset(PRESETS["tiny"](), root / "data", root, "").dir


@pytest.mark.parametrize("sig", _signals(signal.SIGINT, signal.SIGTERM))
def test_demo_stops_every_process(tmp_path, short_tmpdir, tiny_data, sig):
    # one peer and the archive: two p2p daemons
    cmd = hivepath_cmd("demo", "--peers", "1", "--minutes", "5", "--preset", "tiny", "--out", str(tmp_path / "demo"),
                       "--data", str(tiny_data), "--no-live", "--eval-docs", "2")
    tmpdir = short_tmpdir  # the demo's own TMPDIR: hivemind's default shared-memory strategy, a manager each
    env = {k: v for k, v in os.environ.items() if k != "HIVEMIND_MEMORY_SHARING_STRATEGY"}
    with open(tmp_path / "demo.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env={**env, "TMPDIR": str(tmpdir)})
    _stop_and_check(proc, sig, daemons=2, start_timeout=240, tmpdir=tmpdir, up=tmp_path / "demo" / "logs" / "peer0.log",
                    logs=[tmp_path / "demo.log", *(tmp_path / "demo" / "logs" / f"{n}.log" for n in ("coordinator", "archive", "peer0"))])
    if sig != signal.SIGKILL:  # a handled signal drains: the report is still written, the exit is clean
        report = tmp_path / "demo" / "report.md"
        assert proc.returncode == 0 and report.is_file(), (proc.returncode, _tails([tmp_path / "demo.log"]))
        assert "routed validation bits per byte, after" in report.read_text()
        stopped = json.loads((tmp_path / "demo" / "summary.json").read_text())["stopped_by"]
        assert stopped.startswith(f"{sig.name} received after "), stopped


@pytest.mark.parametrize("sig", _signals(signal.SIGINT, signal.SIGHUP, signal.SIGKILL))
def test_swarm_benchmark_stops_every_process(tmp_path, sig):
    # the trainer's own DHT plus four stage servers, each with its p2p daemon
    with open(tmp_path / "swarm.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "bench.swarm", "--quick"], stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    _stop_and_check(proc, sig, daemons=5, start_timeout=180, logs=[tmp_path / "swarm.log"])


def test_killed_peer_takes_its_dht_process_and_p2p_daemon_with_it(procs, tmp_path, short_tmpdir):
    """``kill -9`` of a real ``hivepath peer join`` (no handler runs): its DHT process and p2p daemon,
    which hivemind starts without a parent-death signal, exit too (the peer's watchdog)."""
    from chaos.scenario import prepare_dataset
    from helpers.network import tiny_network

    data = prepare_dataset(tmp_path / "data")
    net = tiny_network(procs, tmp_path, data.dir, data.manifest_hash, inner_steps=4)
    tmpdir = short_tmpdir
    try:
        net.start_coordinator()
        net.env = {**net.env, "TMPDIR": str(tmpdir)}
        net.env.pop("HIVEMIND_MEMORY_SHARING_STRATEGY", None)  # hivemind's default, as a volunteer's peer runs
        net.start_peer("peer0")
        peer = net.procs.procs["peer0"]
        wait_for(lambda: _daemons(peer.pid) >= 1, 120, "the peer's p2p daemon")
        # all up (its sockets bound) once it finished a round, alone
        wait_for(lambda: any(e.get("event") == "round" for e in procs.json_lines("peer0")), 300, "the peer's first round")
        tree = [p for p in _tree(peer.pid) if "peer.node.lifetime" not in " ".join(p.cmdline())]
        assert any(_name(p) == "p2pd" for p in tree)
        sockets = _bound_sockets([psutil.Process(peer.pid), *tree])
        peer.send_signal(signal.SIGKILL)  # the peer alone, not its session
        peer.wait(timeout=10)
        left = lambda: [p for p in tree if p.is_running() and _status(p) != psutil.STATUS_ZOMBIE]  # noqa: E731
        try:
            wait_for(lambda: not left(), LEFT_TIMEOUT, "the killed peer's DHT process and p2p daemon to exit")
        except TimeoutError:
            raise AssertionError("left after kill -9: " + "; ".join(_describe(p) for p in left())) from None
        try:
            wait_for(lambda: not _left_on_disk(sockets, tmpdir), LEFT_TIMEOUT, "the killed peer's files to go")
        except TimeoutError:
            raise AssertionError(f"left on disk after kill -9: {_left_on_disk(sockets, tmpdir)}") from None
    finally:
        net.close()
