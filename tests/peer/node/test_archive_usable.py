"""The archive is a run directory: a run on the built-in corpus that pins no
manifest hash (as deploy/run.example.toml), an archive given the dataset, and ``eval``, ``generate``
and ``export`` reading the archive's directory as it is, with no ``--data``."""

from __future__ import annotations

import json
import subprocess

import pytest

from peer.localnet import hivepath_cmd, wait_for
from helpers.network import tiny_network

def test_an_archive_without_a_snapshot_yet_says_so(tmp_path):
    from models.errors import DataError
    from models.run_dir import load_run_dir

    (tmp_path / "identity.key").write_bytes(b"key")
    for cmd in (["eval", "--from", str(tmp_path)], ["generate", "--from", str(tmp_path), "x"]):
        out = subprocess.run(hivepath_cmd(*cmd), capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and "holds no snapshot yet" in out.stderr and "Traceback" not in out.stderr
    with pytest.raises(DataError, match="holds no snapshot yet"):
        load_run_dir(tmp_path)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_eval_generate_export_read_the_archive(procs, tmp_path):
    from models.corpus import default_corpus
    from models.data import Dataset, prepare

    data = tmp_path / "data"
    prepare(default_corpus(), data, levels=2, modules=2, tokenizer="bytes")
    ds = Dataset(data)
    net = tiny_network(procs, tmp_path / "net", ds.dir, "", inner_steps=5)  # no manifest hash pinned
    net.start_coordinator()
    archive = net.start_archive()
    net.start_peer("peer0")
    def latest():
        name = (archive / "LATEST").read_text().strip()
        return json.loads((archive / name / "run.json").read_text())

    wait_for(lambda: latest()["paths"], 600, "an archive snapshot holding a whole path")

    def cli(*args):
        out = subprocess.run(hivepath_cmd(*args), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"{args}: {out.stderr[-2000:]}"
        return out

    summary = latest()
    assert summary["data"]["manifest_hash"] == ds.manifest_hash and summary["data"]["dir"]
    result = json.loads(cli("eval", "--from", str(archive), "--max-docs", "2", "--json").stdout)
    assert result["bpb"] > 0
    path = summary["paths"][0].replace("-", ",")
    text = cli("generate", "--from", str(archive), "To be", "--max-tokens", "4", "--path", path).stdout
    assert text.startswith("To be")
    cli("export", "--from", str(archive), "--path", path, "--out", str(tmp_path / "export"))
    assert (tmp_path / "export").is_dir()
