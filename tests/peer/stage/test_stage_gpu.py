"""Stage mode on CUDA: stage servers on the GPU serve forward and backward under bf16 autocast (as a
path peer trains), within bf16's error of fp32 on the CPU, and a pipeline trainer on the GPU trains
through them over real hivemind DHTs and p2p daemons. Skipped without CUDA (marker ``gpu``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.lattice import ModularLM
from models.presets import demo
from peer.network import DHTOptions, start_dht
from peer.stage import StageClient, StageServer

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


def test_stage_servers_on_cuda_serve_in_bf16_and_a_trainer_on_cuda_trains_through_them():
    from peer.node.stage_runner import StageTrainer

    cuda = torch.device("cuda")
    base = demo()
    cfg = dataclasses.replace(base, inner=dataclasses.replace(base.inner, warmup_steps=0))
    C, T = cfg.lattice.d_model, cfg.lattice.seq_len
    a = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    dhts = [a] + [start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=a.maddrs()))
                  for _ in range(2)]
    b = dhts[-1]
    servers = [StageServer(cfg, mid, dht, device=cuda).start() for mid, dht in (("L0M0", a), ("L1M0", dhts[1]))]
    clients = {name: StageClient(b, cfg.run_id, cfg.content_hash(), codec=name, request_timeout=30.0)
               for name in ("none", "int4tok+zstd/first=int5tok+zstd/residual")}
    trainer = None
    try:
        server = servers[0]
        ref = ModularLM(cfg.lattice, seed=cfg.seed, module_ids=["L0M0"]).mods["L0M0"]
        ref.load_state_dict(server.run_on_compute(lambda: {k: v.detach().cpu().clone()
                                                           for k, v in server.module.state_dict().items()}))
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(4, T, C, generator=gen)  # (B, T, C)
        g = torch.randn(4, T, C, generator=gen)  # (B, T, C)
        xr = x.clone().requires_grad_(True)
        yr = ref(xr)
        yr.backward(g)
        errors = {}
        for name, client in clients.items():
            y, hop = client.forward("L0M0", x)
            gx = client.backward(hop, g)
            errors[name] = (_rel(y, yr.detach()), _rel(gx, xr.grad))
        print("relative error against fp32 on the CPU (output, input gradient):", errors)
        assert errors["none"][0] < 0.02 and errors["none"][1] < 0.05, errors  # bf16 autocast, lossless wire
        assert max(errors["none"]) > 0, "the server did not run in bf16"
        speed = server.run_on_compute(lambda: server.measure_throughput(repeats=5))
        print(f"L0M0 on {torch.cuda.get_device_name(cuda)}: {speed:.0f} tokens/s (forward + backward), "
              f"{torch.cuda.max_memory_allocated(cuda) / 2**20:.1f} MiB allocated at most")
        assert speed > 0

        # a trainer on the GPU, the default codec scheme: the loss on a repeated batch falls
        trainer = StageTrainer(cfg, (0, 0), clients["int4tok+zstd/first=int5tok+zstd/residual"], cuda,
                               micro_batches=4)
        idx = torch.randint(0, cfg.lattice.vocab_size, (cfg.inner.batch_size, T + 1), generator=gen)  # (B, T+1)
        losses = [trainer.train_step(idx[:, :-1], idx[:, 1:])[0] for _ in range(30)]
        print("trainer losses:", [round(v, 3) for v in losses[::5]])
        assert all(v == v for v in losses) and losses[-1] < losses[0] - 0.5, losses
        assert trainer.embed.tok.weight.device.type == "cuda"
        assert all(s.tokens_trained > 0 for s in servers)
    finally:
        if trainer is not None:
            trainer.close()
        for client in clients.values():
            client.close()
        for server in servers:
            server.close()
        for dht in dhts:
            dht.shutdown()
