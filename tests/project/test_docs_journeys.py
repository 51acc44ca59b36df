"""Docs that run: the command blocks of the operator's and the volunteer's journeys, taken
from the docs and run in the order a reader would, against real processes in a temp directory. A doc
block that no longer works fails its test.

Blocks are the fenced ``bash`` blocks of a section (:func:`doc_commands`): lines joined at a trailing
backslash, comments dropped. Each command runs in ``bash`` in the temp directory, with ``HOME`` there
(so ``~/.hivepath`` is too) and this checkout's ``hivepath`` first on ``PATH``; ``export K=V`` sets a
variable for the commands after it; ``pip install`` lines are the test's own environment and are
skipped. What must differ from the page, and only that, is substituted (:class:`Reader`):

- the ports ``7700``/``7701`` of ``--port``, ``--http-port`` and ``HOST:7700`` become free ports, and
  ``coord.example.org`` becomes ``127.0.0.1``; the operator commands' default coordinator
  (``127.0.0.1:7700``) becomes that port through ``HIVEPATH_COORDINATOR``;
- the example peer id ``QmUTBN6Bp15euBud...`` (whole or shortened) becomes the id of a peer of the run;
- ``deploy/run.example.toml`` is copied from this checkout into the temp directory;
- the p2p port ``31337`` of ``--host_maddrs``/``--host-maddrs`` and ``--announce-maddrs`` and the lane
  port ``31338`` of ``--lane-port`` become free ports, the public example addresses ``198.51.100.7``
  (a forwarded port) become ``127.0.0.1``, and the bootstrap node's example address
  ``/ip4/203.0.113.7/tcp/31337/p2p/Qm...`` becomes the address the stock ``hivemind-dht`` node of the
  run printed (:attr:`Reader.bootstrap`), and that node reports its routing table every second
  (``--refresh_period 1``), not every 30 s;
- ``hivepath peer status`` asks the default status port ``7702``; the peers run with
  ``HIVEPATH_STATUS_PORT`` set to a free port instead (both read it), or with it off (``0``) where no
  doc command asks them.

What a page assumes the reader has is made for it: docs/deploy.md's volunteer has the operator's token
file as ``token`` (copied first) and a prepared dataset in ``data/`` (the first of its peers to start
prepares it there, once).

Long-running commands (``coordinator serve``, ``peer join``, ``archive``, ``hivemind-dht``) start in the
background and are waited for by their readiness (a port, a progress event, a printed address), then
stopped with SIGTERM (a drain).

``test_operator_journey`` (seconds) and the deploy journey outside containers (its blocks at once, about
forty seconds on a busy two-core machine) run in the default test run; the volunteer's, the small volunteer's
(docs/stage.md) and the generate journeys are ``slow``. Container and cloud commands (``docker``, ``sky``, ``kubectl``) are not run here: the Docker
tests (tests/docker) run the images and Compose, tests/deploy/test_deploy_static.py checks the templates.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest

from peer.localnet import free_port, wait_for
from helpers.procs import ROOT

pytestmark = pytest.mark.integration

EXAMPLE_PEER = "QmUTBN6Bp15euBudrpM9hih36odyxBWgvSJ18K6iD8f4R9"
"""The peer id the docs use in examples (one the program printed)."""
BOOTSTRAP_EXAMPLE = re.compile(r"/ip4/203\.0\.113\.7/tcp/31337/p2p/Qm\w+")
"""The stock bootstrap node's address as docs/deploy.md shows it (its printed line's form)."""
LONG_RUNNING = ("hivepath coordinator serve", "hivepath peer join", "hivepath archive", "hivemind-dht")


def doc_commands(doc: str, section: str, block: Optional[int] = None) -> list[str]:
    """The commands of the fenced ``bash`` blocks under heading ``section`` of ``doc`` (relative to the
    checkout), or only block number ``block`` of them."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    heading = re.search(rf"^#+ {re.escape(section)}\s*$", text, re.M)
    assert heading, f"{doc} has no section {section!r}"
    lines, fenced = [], False
    for line in text[heading.end():].splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", line):
            break  # the next heading (a '#' inside a block is a shell comment)
        lines.append(line)
    body = "".join(lines)
    blocks = re.findall(r"^ *```(?:bash|sh)\n(.*?)^ *```", body, re.M | re.S)  # a list item's block is indented
    assert blocks, f"{doc} section {section!r} has no bash block"
    if block is not None:
        blocks = [blocks[block]]
    commands = []
    for b in blocks:
        joined = re.sub(r"\\\n\s*", " ", b)
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


class Reader:
    """Runs doc commands as a reader would, in ``home``, with the substitutions of the module docstring."""

    def __init__(self, procs, home: Path):
        self.procs = procs
        self.home = home
        self.port, self.http_port = free_port(), free_port()
        self.peer_id = EXAMPLE_PEER
        self.p2p_port = free_port()
        self.lane_port = free_port()
        self.bootstrap = ""
        """The multiaddr the stock ``hivemind-dht`` node printed (set once it runs)."""
        bin_dir = str(Path(sys.executable).parent)
        self.env = {**os.environ, "HOME": str(home), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
                    "HIVEPATH_THREADS": "1", "HIVEPATH_PROGRESS": "json", "HIVEPATH_STATUS_PORT": "0"}
        for name in ("HIVEPATH_TOKEN", "HIVEPATH_TOKEN_FILE"):
            self.env.pop(name, None)
        self.env["HIVEPATH_COORDINATOR"] = f"127.0.0.1:{self.port}"
        (home / "deploy").mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "deploy" / "run.example.toml", home / "deploy" / "run.example.toml")
        self.started: list[str] = []

    def substitute(self, cmd: str) -> str:
        cmd = cmd.replace("coord.example.org", "127.0.0.1")
        cmd = re.sub(r"--port 7700\b", f"--port {self.port}", cmd)
        cmd = re.sub(r"--http-port 7701\b", f"--http-port {self.http_port}", cmd)
        cmd = re.sub(r"(127\.0\.0\.1|HOST):7700\b", f"127.0.0.1:{self.port}", cmd)
        if self.bootstrap:
            cmd = BOOTSTRAP_EXAMPLE.sub(self.bootstrap, cmd)
        cmd = re.sub(r"/tcp/31337\b", f"/tcp/{self.p2p_port}", cmd).replace("/ip4/198.51.100.7/", "/ip4/127.0.0.1/")
        cmd = re.sub(r"--lane-port 31338\b", f"--lane-port {self.lane_port}", cmd)
        return re.sub(r"\b" + EXAMPLE_PEER[:16] + r"\w*", lambda m: self.peer_id[:len(m.group(0))], cmd)

    def run(self, commands: list[str], expect: int = 0) -> list[subprocess.CompletedProcess]:
        done = []
        for raw in commands:
            cmd = self.substitute(raw)
            if cmd.startswith("pip install"):
                continue
            if cmd.startswith("export "):
                key, _, value = cmd[len("export "):].partition("=")
                self.env[key] = value
                continue
            if cmd.startswith(LONG_RUNNING):
                name = f"doc{len(self.started)}"
                cmd = cmd.removesuffix("&").rstrip()  # the page's '&': started in the background here anyway
                self.procs.start(name, ["bash", "-c", f"exec {cmd}"], env=self.env, cwd=self.home)
                self.started.append(name)
                continue
            out = subprocess.run(["bash", "-c", cmd], cwd=self.home, env=self.env, capture_output=True, text=True,
                                 timeout=600)
            assert out.returncode == expect, f"doc command {raw!r} ran as {cmd!r}: exit {out.returncode}\n{out.stderr}"
            done.append(out)
        return done

    @contextlib.contextmanager
    def exported(self, **variables: str) -> Iterator[None]:
        """``variables`` set for the commands run within, as a reader's ``export`` for one stretch of a
        page (a command started in the background keeps them)."""
        before = dict(self.env)
        self.env.update(variables)
        try:
            yield
        finally:
            self.env = before

    def coordinator_answers(self) -> bool:
        out = subprocess.run(["bash", "-c", "hivepath coordinator status --json"], cwd=self.home, env=self.env,
                             capture_output=True, text=True, timeout=60)
        return out.returncode == 0


def _join_a_peer(reader: Reader, token: str, peer_id: str):
    from peer.coordinator_client import CoordinatorClient, PeerInfo

    client = CoordinatorClient(f"127.0.0.1:{reader.port}", token, PeerInfo(peer_id, "cpu", 8 << 30, 1000.0,
                                                                           public_key=b"doc"), retry_timeout=30.0)
    client.join()
    return client


def test_operator_journey(procs, tmp_path):
    """docs/coordinator.md "Running it": the token, serve, the operator's status commands, then drain,
    ban and unban of a peer that joined (the example id stands for it)."""
    reader = Reader(procs, tmp_path)
    serve, status, moderation = (doc_commands("docs/coordinator.md", "Running it", i) for i in range(3))
    reader.run(serve)
    token = (tmp_path / "run.token").read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{32}", token) and (tmp_path / "run.token").stat().st_mode & 0o077 == 0
    reader.env["HIVEPATH_TOKEN_FILE"] = "run.token"  # the next block's export, for the readiness check
    wait_for(reader.coordinator_answers, 120, "the coordinator of the docs to answer")
    plain, as_json = reader.run(status)
    assert "run demo" in plain.stdout
    assert json.loads(as_json.stdout)["run_id"] == "demo"
    client = _join_a_peer(reader, token, "QmTkFbVDjvRJ6CU9cgWrNHeXRWoHzhtwsmS5CaxLyGqvJ1")
    try:
        reader.peer_id = client.peer.peer_id
        drained, banned, unbanned = reader.run(moderation)
        assert drained.stdout.startswith(f"{reader.peer_id}: ") and "draining" in drained.stdout
        assert banned.stdout.startswith(f"{reader.peer_id}: ") and unbanned.stdout.startswith(f"{reader.peer_id}: ")
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_volunteer_journey(procs, tmp_path):
    """The operator starts the coordinator (docs/coordinator.md), a volunteer joins as README "Joining a
    real run" says, trains a round and is drained by the operator's command."""
    reader = Reader(procs, tmp_path)
    reader.run(doc_commands("docs/coordinator.md", "Running it", 0))
    reader.env["HIVEPATH_TOKEN_FILE"] = "run.token"
    wait_for(reader.coordinator_answers, 120, "the coordinator to answer")
    del reader.env["HIVEPATH_TOKEN_FILE"]  # the volunteer passes --token-file as the README says
    reader.run(doc_commands("README.md", "Joining a real run"))
    volunteer = reader.started[-1]

    def events(kind):
        return [e for e in procs.json_lines(volunteer) if e.get("event") == kind]

    wait_for(lambda: events("round"), 1200, "the volunteer to finish a round")
    reader.peer_id = events("join")[0]["peer_id"]
    reader.run(doc_commands("docs/coordinator.md", "Running it", 1)[:1])  # export HIVEPATH_TOKEN_FILE
    reader.run(doc_commands("docs/coordinator.md", "Running it", 2)[:1])  # drain
    assert procs.procs[volunteer].wait(timeout=300) == 0, procs.log(volunteer)[-3000:]
    assert events("leave") and events("drain")[0]["reason"].startswith("drained by the coordinator")



@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_small_volunteer_journey(procs, tmp_path):
    """docs/stage.md "A small volunteer's journey": three volunteers too small for a path of the
    operator's run (docs/coordinator.md) join with the page's command, one after another. What is small
    depends on the run's lattice, so the page's ``--max-memory 0.5`` becomes one that fits a stage and a
    trainer of it but not a path (:func:`peer.demo.small_peer_memory`), and each volunteer has a work
    directory of its own. The first logs its role with the coordinator's reason and waits for a pipeline,
    reporting no throughput; with the other two a pipeline forms, its trainer trains and each of its
    servers serves tokens; all three drain on SIGTERM."""
    from models.presets import load_run_config
    from peer.demo import small_peer_memory

    reader = Reader(procs, tmp_path)
    reader.env["HIVEPATH_MEASURE_SECONDS"] = "0.1"
    reader.env["HIVEPATH_PEERS_DIR"] = str(tmp_path / "machine")
    reader.run(doc_commands("docs/coordinator.md", "Running it", 0))
    shutil.copy(tmp_path / "run.token", tmp_path / "token")  # the volunteer has the operator's token file
    with reader.exported(HIVEPATH_TOKEN_FILE="run.token"):
        wait_for(reader.coordinator_answers, 120, "the coordinator to answer")
    (join,) = doc_commands("docs/stage.md", "A small volunteer's journey")
    assert "--max-memory 0.5" in join, join
    small = small_peer_memory(load_run_config(ROOT / "deploy" / "run.example.toml", ignore_sections=("coordinator",)))
    join = join.replace("--max-memory 0.5", f"--max-memory {small.max_memory_gb}")
    reader.env["HIVEPATH_DATA"] = "data"  # prepared once, by the first volunteer (the built-in corpus)

    def start(i: int) -> str:
        with reader.exported(HIVEPATH_WORK_DIR=str(tmp_path / f"volunteer-{i}")):
            reader.run([join])
        return reader.started[-1]

    def progress(name: str) -> list[dict]:
        return procs.json_lines(name, "progress")

    def alive(name: str) -> None:
        assert procs.procs[name].poll() is None, procs.log(name)[-3000:]

    first = start(0)
    joined = wait_for(lambda: re.search(r"joined run demo as \S+: (stage L\dM\d) \((a path needs \d+ bytes, more than "
                                        r"\d+ usable[^)]*)", procs.log(first)) or alive(first), 600,
                      "the first volunteer to join")
    assert joined.group(1).startswith("stage "), joined.group(0)
    wait_for(lambda: "waiting for a trainer to drive it" in procs.log(first) or alive(first), 120,
             "the first volunteer to wait for a pipeline")
    waiting = wait_for(lambda: [p for p in progress(first) if p["state"] == "waiting"] or alive(first), 120,
                       "a progress line of the waiting server")
    assert waiting[-1]["mode"] == "stage" and waiting[-1]["tokens_per_s"] == 0, waiting[-1]
    others = [start(1), start(2)]
    volunteers = [first, *others]

    def roles() -> dict[str, str]:
        return {n: ([p["mode"] for p in progress(n)] or [""])[-1] for n in volunteers}

    wait_for(lambda: sorted(roles().values()) == ["stage", "stage", "trainer"], 600,
             "two stage servers and a pipeline trainer")
    trainer = next(n for n, mode in roles().items() if mode == "trainer")

    def trained() -> bool:
        for n in volunteers:
            alive(n)
        return all((progress(n) or [{}])[-1].get("tokens", 0) > 0 for n in volunteers)

    wait_for(trained, 600, "the trainer to train and each server to serve tokens")
    assert any(p["state"] == "training" for p in progress(trainer)), progress(trainer)[-3:]
    procs.signal(volunteers, 15)
    for name in volunteers:
        assert procs.procs[name].wait(timeout=300) == 0, procs.log(name)[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_generate_journey(procs, tmp_path):
    """docs/generate.md "Commands", every line as written."""
    reader = Reader(procs, tmp_path)
    outs = reader.run(doc_commands("docs/generate.md", "Commands"))
    assert outs[1].stdout.startswith("To be, or not to be") and "[path" in outs[1].stderr
    assert (tmp_path / "exports" / "r1-0-1").is_dir()


@pytest.mark.timeout(900)
def test_deploy_journey_without_containers(procs, tmp_path):
    """docs/deploy.md outside containers, in the default run: one peer per GPU as "On a GPU box" starts
    them (on the CPU here: they share its memory); a peer announcing a forwarded port that the
    coordinator's dial-back reaches, and one forwarding its lane port too ("Behind NAT or a
    firewall"); a peer bootstrapped from the address a stock hivemind DHT node printed ("Bootstrap
    peers") and its health checks ("Health checks").

    One coordinator and one stock node serve every block, and the blocks run at once as their readers,
    on machines of their own, would: the peers start together, those behind NAT each with a work
    directory of its own (``HIVEPATH_WORK_DIR``). Peers measure their speed for a tenth of a second
    (``HIVEPATH_MEASURE_SECONDS``): what the blocks show does not depend on it."""
    reader = Reader(procs, tmp_path)
    reader.env["HIVEPATH_MEASURE_SECONDS"] = "0.1"
    reader.env["HIVEPATH_PEERS_DIR"] = str(tmp_path / "machine")  # not counted by other tests' peers, nor they here
    stock, join = doc_commands("docs/deploy.md", "Bootstrap peers")
    assert BOOTSTRAP_EXAMPLE.search(join), "the page's bootstrap address is not the form hivemind-dht prints"
    reader.run([f"{stock} --refresh_period 1"])  # its routing table reported every second, not every 30
    node, stock_port = reader.started[-1], reader.p2p_port
    reader.run(doc_commands("docs/coordinator.md", "Running it", 0))
    shutil.copy(tmp_path / "run.token", tmp_path / "token")  # the volunteer has the operator's token file
    with reader.exported(HIVEPATH_TOKEN_FILE="run.token"):
        wait_for(reader.coordinator_answers, 120, "the coordinator to answer")

    def events(name, kind):
        return [e for e in procs.json_lines(name) if e.get("event") == kind]

    def joined_or_exited(name):
        """The peer's join event; a peer that exited first (a doc command that no longer works) fails."""
        wait_for(lambda: events(name, "join") or procs.procs[name].poll() is not None, 600, f"{name} to join")
        assert procs.procs[name].poll() is None, procs.log(name)[-3000:]
        return events(name, "join")[0]

    def stopped(*names):
        """Each of ``names`` (sent SIGTERM) drained and exited 0."""
        for name in names:
            assert procs.procs[name].wait(timeout=300) == 0, procs.log(name)[-3000:]

    # the page assumes the volunteers have a prepared copy of the data in data/ (the bootstrap block's
    # --data data/; HIVEPATH_DATA for the blocks that name none): the first peer to start prepares it, once
    reader.env["HIVEPATH_DATA"] = "data"
    box = doc_commands("docs/deploy.md", "On a GPU box", 0)
    assert len(box) == 2 and all(c.endswith("&") and "--work-dir" in c for c in box), box
    # the box's peers log for a log collector, as deploy.md's HIVEPATH_LOG_FORMAT says: every line JSON
    with reader.exported(HIVEPATH_PEERS_DIR=str(tmp_path / "peers"), HIVEPATH_LOG_FORMAT="json"):
        reader.run(box)
    gpu_box = reader.started[-2:]
    # the page's two blocks are two ways to start a peer behind NAT: one peer each, in a work dir of its own
    behind_nat = [doc_commands("docs/deploy.md", "Behind NAT or a firewall", i) for i in range(2)]
    assert "--lane-port" not in behind_nat[0][0] and "--lane-port 31338" in behind_nat[1][0]
    nat = []
    for i, block in enumerate(behind_nat):
        reader.p2p_port = free_port()  # the stock node keeps its own
        with reader.exported(HIVEPATH_WORK_DIR=str(tmp_path / f"behind-nat-{i}")):
            reader.run(block)
        nat.append((reader.started[-1], reader.p2p_port))
    printed = wait_for(lambda: re.search(r"--initial_peers (\S+)", procs.log(node)), 120,
                       "the stock node to print its address")
    reader.bootstrap = printed.group(1)
    assert re.fullmatch(rf"/ip4/[\d.]+/tcp/{stock_port}/p2p/Qm\w{{44}}", reader.bootstrap), reader.bootstrap
    status_port = str(free_port())
    with reader.exported(HIVEPATH_STATUS_PORT=status_port):
        reader.run([join])
    peer = reader.started[-1]

    # on a GPU box without a GPU both peers take the CPU, register in one directory and the later of the
    # two offers half the machine's free memory
    for name in gpu_box:
        joined_or_exited(name)
    shared = re.compile(r"sharing the machine's [\d.]+ GB free with 1 other peer: offering [\d.]+ GB")
    assert any(shared.search(procs.log(name)) for name in gpu_box), [procs.log(n)[-2000:] for n in gpu_box]
    procs.signal(gpu_box, 15)

    for i, (name, p2p_port) in enumerate(nat):
        joined = joined_or_exited(name)
        assert joined["reachability"].startswith(f"reachable at /ip4/127.0.0.1/tcp/{p2p_port}/"), joined
        if i == 1:  # the lane listens at the port the page forwards
            wait_for(lambda: _accepts(reader.lane_port), 60, f"the direct lane to listen on {reader.lane_port}")
    procs.signal([name for name, _ in nat], 15)

    joined = joined_or_exited(peer)
    assert "bootstrap failed" not in procs.log(peer)
    # nothing but this peer was given the stock node's address: the node's routing table counts it
    wait_for(lambda: re.search(r"\b([2-9]|\d\d+) DHT nodes \(including this one\)", procs.log(node)), 120,
             "the stock node to know the bootstrapped peer")
    health = [c for c in doc_commands("docs/deploy.md", "Health checks") if not c.startswith("docker ")]
    with reader.exported(HIVEPATH_STATUS_PORT=status_port):
        plain, as_json = reader.run(health)
    document = json.loads(as_json.stdout)
    assert document["peer_id"] == joined["peer_id"] and document["healthy"] is True
    assert plain.stdout.startswith(f"peer {joined['peer_id'][:16]} ") and "| healthy: " in plain.stdout
    procs.signal(peer, 15)
    stopped(peer, *gpu_box, *(name for name, _ in nat))
    for name in gpu_box:
        lines = procs.log(name).splitlines()
        assert lines and not [line for line in lines if not _json_object(line)], lines


def _json_object(line: str) -> bool:
    """Whether ``line`` is one JSON object."""
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _accepts(port: int) -> bool:
    """Whether something accepts TCP connections on loopback ``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
        return True
    except OSError:
        return False
