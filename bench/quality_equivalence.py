"""One point run twice: by the simulator the sweeps use, and by the peers' own optimizer wrapper.

The sweeps train with ``peer.simulator.DiLoCoSimulator``. A networked peer trains with
``peer.diloco.DiLoCoOptimizer`` (the optimizer-like wrapper of DiLoCo, Douillard et al. 2023) and an
averager. This runs ``K`` workers as threads, each with its own ``DiLoCoOptimizer`` joined to an
in-process ``peer.averaging.LocalAverager`` (the reduction the network all-reduce reproduces bit for
bit, see ``tests/peer/averaging/test_net_averaging.py``), on the same seeds and batches as the simulator, and reports
how far the two final models are apart (max absolute weight difference, bits per byte of each).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from bench.quality_runs import RunContext, dense_bpb, seed_batches, make_config
from models.lattice import ModularLM
from models.training import make_adamw, warmup_lr
from peer.averaging import LocalAverager
from peer.diloco import DiLoCoOptimizer
from peer.simulator import DiLoCoSimulator

__all__ = ["run_equivalence"]


def run_equivalence(ctx: RunContext, tokenizer: str = "bytes", workers: int = 4, inner_steps: int = 10,
                    rounds: int = 3, codec: str = "int8") -> dict[str, Any]:
    """Train ``rounds`` rounds both ways and compare the final global models."""
    cfg = make_config(ctx, tokenizer, inner_steps=inner_steps, codec=codec)
    ds = ctx.dataset(tokenizer)
    batches = seed_batches(ds, cfg, dense=True)
    steps = inner_steps * rounds
    sim = DiLoCoSimulator(cfg, [(0,)], workers, batches, device="cpu")
    sim.train(steps)
    sim_model = sim.global_model()

    hub = LocalAverager()
    models, errors = [], []
    module_ids = cfg.lattice.path_modules((0,))
    members = [hub.member(f"w{k}", module_ids) for k in range(workers)]  # sorted ids = worker order

    def worker(k: int) -> None:
        try:
            model = ModularLM(cfg.lattice, seed=cfg.seed, module_ids=module_ids)
            pm = model.path_model((0,))
            inner = make_adamw(pm.parameters(), cfg.inner)
            opt = DiLoCoOptimizer({m: model.mods[m] for m in module_ids}, inner, cfg.outer, lattice=cfg.lattice,
                                  averager=members[k])
            it = batches(k, (0,))
            params = [p for p in pm.parameters() if p.requires_grad]
            for step in range(steps):
                x, y = next(it)
                _, loss = pm(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
                for group in opt.param_groups:
                    group["lr"] = warmup_lr(cfg.inner, step)
                opt.step(tokens=float(x.numel()))
                opt.zero_grad(set_to_none=True)
            opt.close()
            models.append((k, model))
        except Exception as e:  # surfaced below: a thread cannot raise into the caller
            errors.append(f"worker {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(k,), name=f"equiv-{k}") for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    peer_model = dict(models)[0]
    diff = max(float((a.detach() - b.detach()).abs().max())
               for mid in module_ids
               for a, b in zip(sim_model.mods[mid].parameters(), peer_model.mods[mid].parameters()))
    replicas = max(float((a.detach() - b.detach()).abs().max())
                   for _, m in models for mid in module_ids
                   for a, b in zip(m.mods[mid].parameters(), peer_model.mods[mid].parameters()))
    sim_bpb = dense_bpb(ctx, sim_model.path_model((0,)), tokenizer)
    peer_bpb = dense_bpb(ctx, peer_model.path_model((0,)), tokenizer)
    return {"bpb": peer_bpb, "simulator_bpb": sim_bpb, "max_abs_weight_diff": diff,
            "max_abs_diff_between_peers": replicas, "workers": workers, "rounds": rounds, "codec": codec,
            "tokens": workers * steps * cfg.inner.batch_size * cfg.lattice.seq_len,
            "curve": [{"step": steps, "tokens": workers * steps * cfg.inner.batch_size * cfg.lattice.seq_len,
                       "bytes": 0.0, "bpb": peer_bpb}]}
