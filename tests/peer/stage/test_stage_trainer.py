"""The pipeline trainer: a holder waiting on the embedding's or head's round is not kept waiting for a
step still crossing the pipeline, and the next step's micro-batches follow this step's into the
pipeline with each step's gradient its own."""

from __future__ import annotations

import dataclasses
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from peer.localnet import wait_for
from models.lattice import ModularLM
from models.presets import tiny_cpu
from peer.averaging import LocalAverager
from peer.stage import decode_tensor, encode_tensor
from peer.stage.wire import activation_codec, codec_scheme

WAIT = 60.0
"""Seconds a condition may take on a loaded 2-core machine."""


class _GatedClient:
    """A :class:`peer.stage.StageClient` stand-in: runs each level here, in int8, and holds every
    forward until ``gate`` is set (a pipeline whose servers are busy)."""

    def __init__(self, modules: dict, codec: str = "int8"):
        self.scheme = codec_scheme(codec)
        self.codec = codec
        self.modules = modules
        self.gate = threading.Event()
        self.gate.set()
        self.held = 0

    def _cross(self, t: torch.Tensor) -> torch.Tensor:
        return decode_tensor(encode_tensor(t, activation_codec(self.codec)), "t", t.numel())

    def forward(self, module_id: str, x: torch.Tensor, codec=None):
        if not self.gate.is_set():
            self.held += 1
            assert self.gate.wait(WAIT), "the test never opened the gate"
        xin = self._cross(x).requires_grad_(True)
        y = self.modules[module_id](xin)
        return self._cross(y.detach()), (xin, y)

    def backward(self, hop, grad: torch.Tensor, codec=None) -> torch.Tensor:
        xin, y = hop
        y.backward(self._cross(grad))
        return self._cross(xin.grad)


class _Waiting:
    """A member averager whose ``others_waiting`` says another holder waits for our current round once
    ``waiting`` is set (as ``NetAverager.others_waiting`` reads it from the DHT); it counts the asks."""

    def __init__(self, member) -> None:
        self.member, self.waiting, self.asked = member, threading.Event(), 0

    def average(self, *args, **kw):
        return self.member.average(*args, **kw)

    def others_waiting(self, rounds, paced_too: bool = False) -> bool:
        self.asked += 1
        return self.waiting.is_set()


def _trainer(averager, overlap: bool = False, codec: str = "int8"):
    """A trainer of path 0,0 whose levels run in ``_GatedClient``; ``overlap=False``: its rounds'
    exchanges are synchronous, so a round's report comes as it ends."""
    from peer.node.stage_runner import StageTrainer

    base = tiny_cpu()
    cfg = dataclasses.replace(base, outer=dataclasses.replace(base.outer, inner_steps=1000, round_timeout=30.0))
    path = (0,) * cfg.lattice.levels
    ids = cfg.lattice.path_modules(path)
    lm = ModularLM(cfg.lattice, seed=cfg.seed, module_ids=ids[1:-1])
    client = _GatedClient({m: lm.mods[m] for m in ids[1:-1]}, codec)
    trainer = StageTrainer(cfg, path, client, torch.device("cpu"), averager=averager, micro_batches=2,
                           overlap=overlap)
    trainer.pace_interval = 0.05
    gen = torch.Generator().manual_seed(0)

    def batch():
        x = torch.randint(0, cfg.lattice.vocab_size, (4, cfg.lattice.seq_len), generator=gen)  # (B, T)
        return x, torch.roll(x, -1, dims=1)

    return trainer, client, batch


def _hold_next_step(trainer, client, batch, pool):
    """Take one step, close the pipeline, and start the next step on ``pool``; return its future once
    its micro-batches wait in the pipeline."""
    trainer.train_step(*batch())
    client.gate.clear()
    step = pool.submit(trainer.train_step, *batch())
    wait_for(lambda: client.held >= 1, WAIT, "the step to reach the pipeline")
    return step


def test_a_round_another_holder_waits_on_ends_while_the_step_crosses_the_pipeline():
    """One step done, the next held in the pipeline: once another holder waits on round 0, the round
    ends during the held step (its report reaches ``on_round`` while the forwards still wait), and
    the step then completes into round 1 with its loss and its inner update."""
    torch.set_num_threads(1)
    hub = LocalAverager()
    averager = _Waiting(hub.member("t", ["embed", "head"]))
    trainer, client, batch = _trainer(averager)
    ended = []
    trainer.on_round = ended.append
    try:
        loss0, reports0 = trainer.train_step(*batch())
        assert reports0 == [] and trainer.opt.module_round("embed") == 0
        client.gate.clear()
        with ThreadPoolExecutor(1) as pool:
            step = pool.submit(trainer.train_step, *batch())
            wait_for(lambda: client.held >= 1, WAIT, "the step to reach the pipeline")
            averager.waiting.set()
            wait_for(lambda: ended, WAIT, "round 0 to end while the step is held")
            assert not step.done() and trainer.opt.module_round("embed") == 1
            assert ended[0].round == 0 and ended[0].inner_steps == 1 and ended[0].applied, ended[0]
            averager.waiting.clear()
            embed_before = [p.detach().clone() for p in trainer.embed.parameters()]
            client.gate.set()
            loss1, reports1 = step.result(timeout=WAIT)
    finally:
        client.gate.set()  # a failed assertion must not leave the step held
        trainer.close()
    assert reports1 == ended and loss1 == loss1
    assert trainer.opt._steps_in_round == 1, "the held step did not land in round 1"
    assert any(not torch.equal(a, p.detach()) for a, p in zip(embed_before, trainer.embed.parameters())), \
        "the held step's inner update was not applied"


def test_a_held_step_ends_no_round_while_nobody_waits():
    """The control: the same held step, asked many times whether anyone waits, ends no round."""
    torch.set_num_threads(1)
    hub = LocalAverager()
    averager = _Waiting(hub.member("t", ["embed", "head"]))
    trainer, client, batch = _trainer(averager)
    try:
        with ThreadPoolExecutor(1) as pool:
            step = _hold_next_step(trainer, client, batch, pool)
            asked = averager.asked
            wait_for(lambda: averager.asked >= asked + 5, WAIT, "the trainer to ask whether anyone waits")
            client.gate.set()
            _, reports = step.result(timeout=WAIT)
    finally:
        client.gate.set()  # a failed assertion must not leave the step held
        trainer.close()
    assert reports == [] and trainer.opt.module_round("embed") == 0 and trainer.opt._steps_in_round == 2


def test_a_trainer_whose_modules_are_idle_ends_no_round_during_a_step():
    """While the embedding and head are announced idle (other holders neither wait for them nor count
    them), a waiting holder does not make the trainer end a round during a step: it could meet another
    idle holder's round alone and make a second average of it."""
    torch.set_num_threads(1)
    hub = LocalAverager()
    averager = _Waiting(hub.member("t", ["embed", "head"]))
    trainer, client, batch = _trainer(averager)
    polls: list[int] = []
    try:
        trainer.train_step(*batch())
        trainer.holding = lambda: bool(polls.append(1))  # idle: False, counting the trainer's checks
        averager.waiting.set()
        client.gate.clear()
        with ThreadPoolExecutor(1) as pool:
            step = pool.submit(trainer.train_step, *batch())
            wait_for(lambda: client.held >= 1 and len(polls) >= 5, WAIT, "the trainer to check its holds")
            client.gate.set()
            _, reports = step.result(timeout=WAIT)
    finally:
        client.gate.set()
        trainer.close()
    # the step itself, held again, ends the round at its inner step (another holder waits)
    assert [r.inner_steps for r in reports] == [2] and averager.asked >= 1


def test_an_overlapping_trainer_ends_a_waited_round_during_a_held_step_and_reports_it_once_applied():
    """The trainer as ``peer join`` runs it (its exchanges behind the next round): a round another
    holder waits on ends while the step is held in the pipeline, without waiting for the exchange,
    and its report comes once its average is applied, at an inner step after the exchange returned."""
    torch.set_num_threads(1)
    hub = LocalAverager()
    averager = _Waiting(hub.member("t", ["embed", "head"]))
    trainer, client, batch = _trainer(averager, overlap=True)
    ended = []
    trainer.on_round = ended.append
    try:
        with ThreadPoolExecutor(1) as pool:
            step = _hold_next_step(trainer, client, batch, pool)
            averager.waiting.set()
            wait_for(lambda: trainer.opt.module_round("embed") >= 1, WAIT, "round 0 to end while the step is held")
            averager.waiting.clear()
            assert not step.done()
            client.gate.set()
            step.result(timeout=WAIT)
        while not ended:  # the exchange returned (one member: at once); the next inner step applies it
            trainer.train_step(*batch())
    finally:
        client.gate.set()  # a failed assertion must not leave the step held
        trainer.close()
    assert ended[0].round == 0 and ended[0].overlap and ended[0].applied and ended[0].inner_steps == 1, ended[0]


def test_the_next_steps_micro_batches_enter_the_pipeline_before_this_step_is_taken():
    """Drawing from its shard, a step launches the next batch's micro-batches beside its own: here
    the pipeline answers no backward until the next step's micro-batches have reached it too (on a
    trainer that waited for its step before sending the next, the first step would never end), so
    the servers are not left idle while the trainer finishes and takes a step."""
    torch.set_num_threads(1)
    hub = LocalAverager()
    trainer, client, batch = _trainer(hub.member("t", ["embed", "head"]), overlap=True)
    trainer.batches = iter(batch, None)
    one_step = trainer.micro_batches * len(trainer.levels)  # forwards of one step's micro-batches
    forwards, seen = client.forward, threading.Condition()
    counted = {"forward": 0}

    def counting_forward(module_id, x, codec=None):
        with seen:
            counted["forward"] += 1
            seen.notify_all()
        return forwards(module_id, x, codec)

    backwards = client.backward

    def backward_once_the_next_step_came(hop, grad, codec=None):
        with seen:
            assert seen.wait_for(lambda: counted["forward"] > one_step, WAIT), \
                "the next step's micro-batches did not enter the pipeline during this step"
        return backwards(hop, grad, codec)

    client.forward, client.backward = counting_forward, backward_once_the_next_step_came
    try:
        loss1, _ = trainer.train_step()
        loss2, _ = trainer.train_step()
    finally:
        trainer.close()
    assert math.isfinite(loss1) and math.isfinite(loss2) and trainer.opt._steps_in_round == 2


def test_a_steps_gradient_is_the_whole_batchs_and_its_own():
    """With the levels run exactly (activations uncompressed), the gradient a step applies to the embedding
    and head is that of the path model on the whole batch: the micro-batches' gradients are summed
    per step, the tied embedding's from both its uses, and the next step's micro-batches, already in
    the pipeline, add nothing to it."""
    torch.set_num_threads(1)
    hub = LocalAverager()
    trainer, client, batch = _trainer(hub.member("t", ["embed", "head"]), overlap=True, codec="none")
    batches = [batch() for _ in range(3)]
    trainer.batches = iter(batches)
    cfg = trainer.cfg
    ids = cfg.lattice.path_modules(trainer.path)
    reference = ModularLM(cfg.lattice, seed=cfg.seed, module_ids=ids).path_model(trainer.path)
    reference.load_state_dict({**{f"embed.{k}": v for k, v in trainer.embed.state_dict().items()},
                               **{f"head.{k}": v for k, v in trainer.head.state_dict().items()},
                               **{f"stack.{i}.{k}": v for i, m in enumerate(ids[1:-1])
                                  for k, v in client.modules[m].state_dict().items()}})
    _, loss = reference(*batches[0])
    loss.backward()
    expected = [p.grad.clone() for p in [*reference.embed.parameters(), *reference.head.parameters()]]
    applied: list[list[torch.Tensor]] = []
    step = trainer.opt.step

    def recording_step(**kw):
        applied.append([p.grad.clone() for p in trainer._params])
        return step(**kw)

    trainer.opt.step = recording_step
    try:
        trainer.train_step()
    finally:
        trainer.close()
    assert len(applied) == 1 and len(applied[0]) == len(expected)
    for got, want in zip(applied[0], expected):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), (got - want).abs().max()


class _Usable:
    """A :class:`peer.stage.StageClient` stand-in for :func:`peer.node.stage_runner.detour`: the servers
    each module has."""

    def __init__(self, servers: dict[str, int]):
        self.servers = servers

    def usable(self, module_id: str) -> list[str]:
        return [f"{module_id}-{i}" for i in range(self.servers.get(module_id, 0))]


def test_a_detour_goes_home_first_else_to_the_best_served_path_whose_data_is_here():
    from peer.node.stage_runner import detour, whole_pipeline

    cfg = tiny_cpu()  # 2 levels x 2 modules
    everywhere = lambda p: True  # noqa: E731
    # home (1,0) lacks L0M1: the path whose least-served level has the most servers
    client = _Usable({"L0M0": 2, "L1M0": 1, "L1M1": 3})
    assert not whole_pipeline(client, cfg, (1, 0)) and whole_pipeline(client, cfg, (0, 1))
    assert detour(client, cfg, (1, 0), (1, 0), everywhere) == (0, 1)
    assert detour(client, cfg, (1, 0), (1, 0), lambda p: p != (0, 1)) == (0, 0)  # (0,1)'s shard is not here
    # home is whole again: it comes first, however thinly served
    client.servers["L0M1"] = 1
    assert detour(client, cfg, (0, 1), (1, 0), everywhere) == (1, 0)
    # no level-0 server at all: nowhere to go
    assert detour(_Usable({"L1M0": 1, "L1M1": 1}), cfg, (1, 0), (1, 0), everywhere) is None


def test_drive_sends_the_next_micro_batches_through_the_other_path_and_each_path_keeps_its_shard():
    trainer, client, batch = _trainer(LocalAverager())
    cfg = trainer.cfg
    other = (1,) * cfg.lattice.levels
    ids = cfg.lattice.path_modules(other)[1:-1]
    client.modules.update({m: ModularLM(cfg.lattice, seed=cfg.seed, module_ids=ids).mods[m] for m in ids})
    crossed = []
    forward = client.forward
    client.forward = lambda module_id, x, codec=None: (crossed.append(module_id), forward(module_id, x, codec))[1]
    home_batches, other_batches = iter(lambda: batch(), None), iter(lambda: batch(), None)
    trainer.batches = home_batches
    trainer._shards[other] = other_batches
    try:
        trainer.train_step(*batch())
        assert set(crossed) == set(trainer.levels) and trainer.driving == trainer.path
        crossed.clear()
        trainer.drive(other)
        assert trainer.batches is other_batches and trainer.levels == ids
        loss, _ = trainer.train_step(*batch())
        assert set(crossed) == set(ids) and math.isfinite(loss)
        trainer.drive(trainer.path)
        assert trainer.batches is home_batches and trainer._shards[other] is other_batches
    finally:
        trainer.close()
