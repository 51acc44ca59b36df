"""``hivepath generate`` and the run-directory loader, on a tiny run trained through the real CLI.

The run (a 2x2 BPE lattice, every path) and a partial run (only path 1,0) are trained once per
session by ``hivepath train-local`` in subprocesses; ``test_export`` reuses them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import write_corpus
from peer.localnet import hivepath_cmd
from hivepath.cmd_eval import load_run
from models.checkpoint import CheckpointError, module_file
from models.config import format_path
from models.corpus import corpus_from_paths
from models.data import Dataset, DatasetMismatch, prepare
from models.errors import ConfigError, DataError
from models.generate import SamplingConfig, choose_path, generate, nearest_path, sample_next
from models.routing import PREFIX_TOKENS
from models.run_dir import load_run_dir

torch.set_num_threads(1)

ENV = {"HIVEPATH_THREADS": "1", "OMP_NUM_THREADS": "1"}
PROMPTS = {
    "scripture": "Chapter 7\n\n1 And the light of the earth was upon the",
    "plays": "_Enter Romeo_\n\n**Juliet**  \nO night, thou art",
    "code": "def run_3(self):\n    value = index + 4\n",
}


@dataclass(frozen=True)
class Runs:
    data: Path
    full: Path
    """Every path of a 2x2 lattice trained."""
    partial: Path
    """Only path 1,0 trained: modules embed, L0M1, L1M0, head."""


def cli(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess:
    """Run the installed ``hivepath`` command with one CPU thread."""
    import os

    return subprocess.run(hivepath_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **ENV})


def _train(data: Path, out: Path, *extra: str) -> None:
    r = cli("train-local", "--data", str(data), "--eval-docs", "1", "--out", str(out), *extra)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Runs:
    """A BPE dataset and two runs trained by the CLI; built once per session (cached in basetemp)."""
    root = tmp_path_factory.getbasetemp() / "generate-runs"
    done = root / "done"
    if not done.exists():
        if root.exists():
            shutil.rmtree(root)
        src = write_corpus(root / "src", per_domain=40)
        prepare(corpus_from_paths([str(src / d) for d in ("scripture", "plays", "code")]), root / "data",
                levels=2, modules=2, tokenizer="bpe:300")
        _train(root / "data", root / "full", "--steps", "30")
        _train(root / "data", root / "partial", "--path", "1,0", "--steps", "5")
        done.write_text("ok")
    return Runs(root / "data", root / "full", root / "partial")


def _json(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- the CLI -----------------------------------------------------------------------------------


def test_generate_is_deterministic_respects_max_tokens_and_decodes(runs):
    prompt = PROMPTS["plays"]
    args = ("generate", "--from", str(runs.full), prompt, "--max-tokens", "17", "--seed", "3", "--temperature", "1.5")
    a, plain = _json(cli(*args, "--json")), cli(*args)
    assert a["tokens"] == len(a["ids"]) == 17
    ds = Dataset(runs.data)
    assert a["text"] == ds.tokenizer.decode(a["ids"]) and a["text"]
    assert plain.returncode == 0 and plain.stdout == prompt + a["text"] + "\n", "another process sampled other text"
    rd = load_run_dir(runs.full)
    same = generate(rd, prompt, SamplingConfig(max_new_tokens=17, seed=3, temperature=1.5, top_k=40))
    other = generate(rd, prompt, SamplingConfig(max_new_tokens=17, seed=4, temperature=1.5, top_k=40))
    assert same.new_ids == a["ids"]
    assert other.new_ids != a["ids"], "another seed should sample another continuation at temperature 1.5"


def test_generate_picks_the_routers_path(runs):
    ds = Dataset(runs.data)
    prompt = PROMPTS["code"]
    out = _json(cli("generate", "--from", str(runs.full), prompt, "--max-tokens", "4", "--json"))
    want = ds.router.route_text(prompt, ds.tokenizer)
    assert out["decisions"] == [{"at_token": 0, "path": format_path(want), "routed": format_path(want), "reason": "router"}]
    rd = load_run_dir(runs.full)
    chosen = {}
    for name, text in PROMPTS.items():
        g = generate(rd, text, SamplingConfig(max_new_tokens=2))
        assert g.path == ds.router.route_text(text, ds.tokenizer) and g.decisions[0].reason == "router"
        chosen[name] = g.path
    assert len(set(chosen.values())) >= 2, f"prompts of different domains should route apart: {chosen}"


def test_generate_falls_back_to_the_nearest_available_path(runs):
    ds = Dataset(runs.data)
    prompt = next(p for p in PROMPTS.values() if ds.router.route_text(p, ds.tokenizer) != (1, 0))
    routed = ds.router.route_text(prompt, ds.tokenizer)
    r = cli("generate", "--from", str(runs.partial), prompt, "--max-tokens", "5", "--json")
    out = _json(r)
    assert out["path"] == "1,0" and out["tokens"] == 5
    assert out["decisions"][0]["routed"] == format_path(routed) and out["decisions"][0]["reason"] == "fallback"
    assert "nearest" in r.stderr and format_path(routed) in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (("--from", "{tmp}/nowhere", "hello"), "does not exist"),
        (("--from", "{full}", "hello", "--path", "2,0"), "is not in a 2-level lattice"),
        (("--from", "{full}", ""), "prompt"),
        (("--from", "{full}", "hello", "--temperature", "0"), "temperature"),
        (("--from", "{full}", "hello", "--max-tokens", "0"), "max-tokens"),
        (("--from", "{partial}", "hello", "--path", "0,0"), "L0M0"),
    ],
    ids=["missing-dir", "path-out-of-range", "empty-prompt", "zero-temperature", "zero-tokens", "absent-modules"],
)
def test_generate_bad_input_is_one_clear_line(runs, tmp_path, args, message):
    fill = {"tmp": str(tmp_path), "full": str(runs.full), "partial": str(runs.partial)}
    r = cli("generate", *(a.format(**fill) for a in args))
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("hivepath: error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


# -- the library -------------------------------------------------------------------------------


def test_rerouting_decides_every_w_tokens_and_uses_each_decision(runs):
    """Greedy decoding with re-routing equals a hand loop that switches paths where the router says."""
    rd = load_run_dir(runs.full)
    prompt = PROMPTS["scripture"]
    W, N = 3, 10
    g = generate(rd, prompt, SamplingConfig(max_new_tokens=N, top_k=1, reroute_every=W))
    assert [d.at_token for d in g.decisions] == [0, 3, 6, 9]
    context = list(g.prompt_ids)
    expected = []
    for step in range(N):
        window = context[:PREFIX_TOKENS] if step == 0 else context[-PREFIX_TOKENS:]
        if step % W == 0:
            want = rd.router.route_ids(np.asarray(window))
            decision = g.decisions[step // W]
            assert decision.routed == want and decision.path == want and decision.reason == "router"
        with torch.no_grad():
            logits, _ = rd.path_model(g.decisions[step // W].path)(torch.tensor([context[-rd.lattice.seq_len:]]))
        token = int(logits[0, -1].argmax())
        expected.append(token)
        context.append(token)
    assert g.new_ids == expected


def test_generation_beyond_the_context_window_slides_it(runs):
    rd = load_run_dir(runs.full)
    g = generate(rd, PROMPTS["code"], SamplingConfig(max_new_tokens=rd.lattice.seq_len + 5, seed=1))
    assert len(g.new_ids) == rd.lattice.seq_len + 5
    assert all(0 <= i < rd.lattice.vocab_size for i in g.new_ids)


def test_sample_next_honours_top_k_and_temperature():
    logits = torch.tensor([0.0, 5.0, 4.0, -1.0, 3.0])
    gen = torch.Generator().manual_seed(0)
    assert {sample_next(logits, 1.0, 1, gen) for _ in range(20)} == {1}
    draws = [sample_next(logits, 2.0, 2, gen) for _ in range(300)]
    assert set(draws) == {1, 2}
    cold = [sample_next(logits, 0.05, 0, gen) for _ in range(50)]
    assert set(cold) == {1}
    hot = [sample_next(logits, 100.0, 0, gen) for _ in range(400)]
    assert set(hot) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("field, kwargs", [("temperature", {"temperature": 0.0}), ("top-k", {"top_k": -1}),
                                           ("max-tokens", {"max_new_tokens": 0}), ("reroute-every", {"reroute_every": -2})])
def test_sampling_config_rejects_bad_values(field, kwargs):
    with pytest.raises(ConfigError, match=field):
        SamplingConfig(**kwargs)


def test_nearest_path_prefers_shared_modules_then_centroids(runs):
    ds = Dataset(runs.data)
    ids = ds.tokenizer.encode(PROMPTS["code"])
    assert nearest_path(ds.router, ids, (0, 0), [(1, 1), (0, 1)]) == (0, 1)
    assert nearest_path(ds.router, ids, (0, 0), [(1, 1)]) == (1, 1)
    a, b = nearest_path(ds.router, ids, (0, 0), [(1, 0), (0, 1)]), nearest_path(ds.router, ids, (0, 0), [(0, 1), (1, 0)])
    assert a == b, "the tie between paths sharing one module is broken by distance, not by order"


def test_choose_path_forced_and_absent(runs):
    rd = load_run_dir(runs.partial)
    assert rd.available_paths() == [(1, 0)]
    assert choose_path(rd, [1, 2, 3], 0, forced=(1, 0)).reason == "forced"
    with pytest.raises(DataError, match="L0M0"):
        choose_path(rd, [1, 2, 3], 0, forced=(0, 0))


def test_open_source_and_device_refuse_what_cannot_run(runs, tmp_path):
    from hivepath.cmd_generate import open_source

    assert open_source(runs.full).available_paths() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    from hivepath.cmd_generate import _device

    with pytest.raises(ConfigError, match="not a device"):
        _device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            _device("cuda")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(DataError, match="neither run.json nor config.json"):
        open_source(tmp_path)


def test_open_source_reads_the_newest_snapshot_of_a_checkpoint_root(runs, tmp_path):
    """An archive's directory or a peer's work directory is read at the snapshot LATEST names, as
    eval and export read it."""
    from hivepath.cmd_generate import open_source

    archive = tmp_path / "archive"
    shutil.copytree(runs.partial, archive / "round-000001")
    shutil.copytree(runs.full, archive / "round-000002")
    (archive / "LATEST").write_text("round-000002")
    assert open_source(archive).available_paths() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    work = tmp_path / "peer"
    shutil.copytree(archive, work / "checkpoints")
    (work / "checkpoints" / "LATEST").write_text("round-000001")
    assert open_source(work).available_paths() == [(1, 0)]


# -- run directories ---------------------------------------------------------------------------


def test_load_run_dir_matches_what_training_wrote(runs):
    rd = load_run_dir(runs.full)
    summary = json.loads((runs.full / "run.json").read_text())
    assert rd.summary == summary and rd.cfg.content_hash() == summary["config_hash"]
    assert rd.module_ids == summary["modules"] and rd.available_paths() == rd.lattice.paths()
    assert rd.manifest_hash == Dataset(runs.data).manifest_hash and rd.router is not None
    s, cfg, model = rd.as_tuple()
    assert s == summary and cfg == rd.cfg
    _, eval_cfg, eval_model = load_run(runs.full)  # engineer A's loader: the same weights
    assert eval_cfg == cfg
    for mid in summary["modules"]:
        saved = load_file(str(module_file(runs.full, mid)))
        mine = model.module_state(mid)
        assert saved.keys() == mine.keys() and all(torch.equal(saved[k], v) for k, v in mine.items())
        assert all(torch.equal(eval_model.module_state(mid)[k], v) for k, v in mine.items())


def test_load_run_dir_refuses_broken_directories(runs, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(runs.full, bad)
    with pytest.raises(DataError, match="does not exist"):
        load_run_dir(tmp_path / "nowhere")
    (bad / "run.json").write_text('{"config": ')
    with pytest.raises(DataError, match="corrupt"):
        load_run_dir(bad)
    shutil.copy(runs.full / "run.json", bad / "run.json")
    module_file(bad, "L1M1").unlink()
    with pytest.raises(DataError, match="L1M1"):
        load_run_dir(bad)
    shutil.copy(module_file(runs.full, "L1M1"), module_file(bad, "L1M1"))
    data = module_file(bad, "L0M0").read_bytes()
    module_file(bad, "L0M0").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_run_dir(bad)


def test_load_run_dir_refuses_another_dataset(runs, tmp_path):
    other = tmp_path / "other-data"
    shutil.copytree(runs.data, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["corpus"] = "something-else"
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetMismatch, match="pass --data"):
        load_run_dir(runs.full, data_dir=other)
    with pytest.raises(DataError, match="gone-data does not exist; check --data"):
        load_run_dir(runs.full, data_dir=tmp_path / "gone-data")
    moved = tmp_path / "moved-run"
    shutil.copytree(runs.full, moved)
    summary = json.loads((moved / "run.json").read_text())
    summary["data"]["dir"] = str(tmp_path / "gone-data")
    (moved / "run.json").write_text(json.dumps(summary))
    with pytest.raises(DataError, match="does not exist; pass --data DIR"):
        load_run_dir(moved)
    assert load_run_dir(moved, data_dir=runs.data).router is not None
    rd = load_run_dir(runs.full, data_dir=tmp_path / "gone-data", with_data=False)
    assert rd.router is None and rd.tokenizer is None and len(rd.module_ids) == 6


@pytest.mark.gpu
def test_generate_on_cuda_under_autocast(runs):
    rd = load_run_dir(runs.full)
    g = generate(rd, PROMPTS["plays"], SamplingConfig(max_new_tokens=12, seed=5), device="cuda")
    assert len(g.new_ids) == 12 and g.path == rd.router.route_text(PROMPTS["plays"], rd.tokenizer)
    assert next(rd.model.parameters()).device.type == "cuda"
