"""``hivepath export``: a path as a standalone model whose logits equal the run's path model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.config import format_path
from models.data import Dataset
from models.errors import DataError
from models.export import MODEL_FILE, export_path, is_export, load_export
from models.generate import SamplingConfig, generate
from models.run_dir import load_run_dir
from test_generate import PROMPTS, cli, runs  # noqa: F401  (``runs`` is the shared session fixture)

torch.set_num_threads(1)


def _export(runs, path: str, out: Path) -> None:
    r = cli("export", "--from", str(runs.full), "--path", path, "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"exported path {path}" in r.stdout


def test_export_round_trip_gives_the_same_logits(runs, tmp_path):
    out = tmp_path / "exp"
    _export(runs, "0,1", out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "the temporary directory was left behind"
    rd = load_run_dir(runs.full)
    config = json.loads((out / "config.json").read_text())
    assert config["path"] == "0,1" and config["module_ids"] == ["embed", "L0M0", "L1M1", "head"]
    assert config["lattice"] == rd.lattice.to_dict() and config["tokenizer"] == rd.cfg.data.tokenizer
    tensors = load_file(str(out / MODEL_FILE))
    want = {f"{m}.{k}" for m in config["module_ids"] for k in rd.model.module_state(m)}
    assert set(tensors) == want
    assert torch.equal(tensors["L1M1.blocks.0.qkv.weight"], rd.model.module_state("L1M1")["blocks.0.qkv.weight"])

    exported = load_export(out)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, rd.lattice.vocab_size, (3, rd.lattice.seq_len), generator=gen)  # (B, T)
    with torch.no_grad():
        a, _ = exported.path_model((0, 1))(idx)  # (B, T, V)
        b, _ = rd.path_model((0, 1))(idx)  # (B, T, V)
    assert torch.equal(a, b)
    text = PROMPTS["code"]
    assert exported.tokenizer.encode(text).tolist() == Dataset(runs.data).tokenizer.encode(text).tolist()


def test_generate_from_an_export_equals_the_run_with_that_path(runs, tmp_path):
    out = tmp_path / "exp"
    _export(runs, "1,1", out)
    args = (PROMPTS["scripture"], "--max-tokens", "12", "--seed", "7", "--json")
    from_export = json.loads(cli("generate", "--from", str(out), *args).stdout)
    from_run = json.loads(cli("generate", "--from", str(runs.full), "--path", "1,1", *args).stdout)
    assert from_export["ids"] == from_run["ids"] and from_export["text"] == from_run["text"]
    assert from_export["path"] == "1,1" and from_export["decisions"][0]["reason"] == "single path"


def test_export_replaces_an_earlier_export_and_refuses_other_directories(runs, tmp_path):
    rd = load_run_dir(runs.full)
    out = tmp_path / "exp"
    export_path(rd, (0, 0), out)
    export_path(rd, (1, 0), out)
    assert is_export(out) and json.loads((out / "config.json").read_text())["path"] == "1,0"
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a hivepath export"):
        export_path(rd, (0, 0), precious)
    assert [p.name for p in precious.iterdir()] == ["notes.txt"]


def test_an_export_refuses_other_paths_and_corruption(runs, tmp_path):
    out = tmp_path / "exp"
    export_path(load_run_dir(runs.full), (0, 1), out)
    exported = load_export(out)
    with pytest.raises(DataError, match="only"):
        exported.path_model((1, 1))
    g = generate(exported, PROMPTS["plays"], SamplingConfig(max_new_tokens=3))
    assert format_path(g.path) == "0,1" and len(g.new_ids) == 3
    (out / "tokenizer.json").unlink()
    with pytest.raises(DataError, match="tokenizer"):
        load_export(out)
    (out / "config.json").write_text("{")
    with pytest.raises(DataError, match="corrupt"):
        load_export(out)


@pytest.mark.parametrize(
    "args, message",
    [
        (("--from", "{tmp}/nowhere", "--path", "0,1", "--out", "{tmp}/o"), "does not exist"),
        (("--from", "{full}", "--path", "0,2", "--out", "{tmp}/o"), "is not in a 2-level lattice"),
        (("--from", "{full}", "--path", "zero", "--out", "{tmp}/o"), "is not a path"),
        (("--from", "{partial}", "--path", "0,0", "--out", "{tmp}/o"), "L0M0"),
    ],
    ids=["missing-dir", "path-out-of-range", "malformed-path", "absent-modules"],
)
def test_export_bad_input_is_one_clear_line(runs, tmp_path, args, message):
    fill = {"tmp": str(tmp_path), "full": str(runs.full), "partial": str(runs.partial)}
    r = cli("export", *(a.format(**fill) for a in args))
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("hivepath: error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()
