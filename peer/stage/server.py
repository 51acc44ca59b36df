"""``StageServer``: one block module of the lattice served as a pipeline stage over hivemind's P2P.

SWARM parallelism (Ryabinin et al. 2023) lets peers too small for a whole path still train: each
serves one module, and trainers push micro-batches through the servers of a path's levels. A server
here answers :class:`protos.hivepath.peer.v1.stage_pb2.StageRequest` s on the run's stage protocol:

- ``FORWARD``: decode the activations (B, T, C), run the module without a graph, keep the input for
  the backward (bounded in number and time), return the output encoded with the request's codec.
- ``BACKWARD``: take the kept input (or the one the trainer resends after a failover), recompute the
  forward with a graph, backpropagate the trainer's gradient, return the gradient w.r.t. the input.
  Parameter gradients accumulate; once ``tokens_per_step`` tokens were backpropagated the inner
  optimizer steps on their mean. Recomputing (instead of keeping graphs) is what lets an inner step
  happen between a forward and its backward.

The inner optimizer is a :class:`peer.diloco.DiLoCoOptimizer` holding this one module with the
run's averager, so stage servers and path-mode holders of a module average in the same outer rounds
and keep bit-identical global copies. By default the exchange overlaps the next round (Streaming
DiLoCo), so a server keeps serving while its module averages.

Bad requests (malformed or oversized tensors, wrong shapes, NaN, another module or config hash) are
answered with an error code and message; the server keeps serving. It announces itself under
:func:`peer.stage.records.stage_servers_key` with its measured throughput and queue length.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from models.config import OuterConfig, RunConfig
from models.errors import ConfigError
from models.lattice import ModularLM
from models.training import autocast
from peer.averaging import ModuleAverager
from peer.diloco import JOIN_RAMP_ROUNDS, DiLoCoOptimizer, RoundReport
from peer.network import refresh_until, unwrap_dht
from peer.network.records import announce_within
from peer.network.frames import log_limited
from protos import versions
from protos.hivepath.peer.v1.stage_pb2 import StageReply, StageRequest
from peer.stage import endpoint
from peer.stage.activity import IdleHolds
from peer.stage.records import StageServerRecord, stage_record_value, stage_servers_key
from peer.stage.wire import WireError, activation_codec, decode_tensor, encode_tensor

__all__ = ["StageServer", "StageServerOptions", "StageEventHook"]

log = logging.getLogger(__name__)

StageEventHook = Callable[[str, int], None]
"""``hook(point, count)`` at ``forward`` / ``backward`` (count: requests of that kind received so
far, this one included) and ``step`` (count: inner steps taken): fault injection and timing."""


@dataclass(frozen=True)
class StageServerOptions:
    """How a stage server serves and announces itself."""

    max_elements: int = 2**20
    """Largest activation tensor (elements) a request may carry; larger ones are refused."""
    keep_timeout: float = 60.0
    """Seconds a forward's input is kept for its backward."""
    max_kept: int = 256
    """Most forward inputs kept at once (oldest dropped first)."""
    tokens_per_step: int = 0
    """Backpropagated tokens per inner step; 0: the run's batch (``batch_size * seq_len``)."""
    record_ttl: float = 10.0
    """Seconds a DHT record lives; refreshed every third of it."""
    overlap: bool = True
    """Average behind the next round (serving never waits on an exchange)."""
    pace_interval: float = 0.25
    """Seconds between looks at whether another holder waits for our round: the round then ends
    between inner steps (:meth:`peer.diloco.DiLoCoOptimizer.end_round_if_others_wait`)."""
    idle_timeout: float = 10.0
    """Seconds without a backward after which the server stops holding its module in rounds
    (:class:`peer.stage.activity.IdleHolds`); it holds it again at the next one."""
    serve_batch: int = 4
    """Queued requests the compute thread serves in one turn before it hands their replies back to the
    event loop together. Each hand-back wakes the loop, and on a busy CPU the woken loop takes the
    compute thread's turn on the core, which it regains only after every other runnable thread's
    (about 5 ms on a shared core, after each request); a loaded server that serves a few queued
    requests a turn keeps computing. A lone request is answered at once."""
    emulated_throughput: float = 0.0
    """Benchmarks: emulate a device of this many tokens/s (forward + backward; a forward is a third of
    the work): a request lasts at least its share. 0 runs at full speed."""


def _settle(done: list[tuple[asyncio.Future, Any]]) -> None:
    """Give each queued request's handler its reply (or the exception serving it raised)."""
    for future, outcome in done:
        if future.done():  # the handler was cancelled: its trainer hung up
            continue
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


class _Rejected(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class StageServer:
    """Serves ``module_id`` of ``cfg``'s lattice to trainers (see the module docstring).

    Call :meth:`start` to register the P2P handler and begin announcing, :meth:`close` to stop.
    ``averager``: the process's :class:`peer.averaging.ModuleAverager` (None: a lone holder).
    """

    def __init__(self, cfg: RunConfig, module_id: str, dht: Any, averager: Optional[ModuleAverager] = None,
                 device: torch.device = torch.device("cpu"), options: StageServerOptions = StageServerOptions(),
                 outer: Optional[OuterConfig] = None, event_hook: Optional[StageEventHook] = None,
                 on_round: Optional[Callable[[RoundReport], None]] = None):
        if cfg.lattice.module_kind(module_id) != "block" or module_id not in cfg.lattice.module_ids():
            raise ConfigError("module", f"'{module_id}' is not a block module of this lattice; stage servers serve "
                                        f"L<level>M<index> modules (embeddings and heads stay with trainers)")
        self.cfg = cfg
        self.module_id = module_id
        self.config_hash = cfg.content_hash()
        self.dht = unwrap_dht(dht)
        self.peer_id: str = self.dht.peer_id.to_base58()
        self.device = torch.device(device)
        self.options = options
        self.averager = averager
        self._hook = event_hook
        self._on_round = on_round
        self.module = ModularLM(cfg.lattice, seed=cfg.seed, module_ids=[module_id]).mods[module_id].to(self.device)
        outer_cfg = dataclasses.replace(outer or cfg.outer, overlap=options.overlap)
        self.opt = DiLoCoOptimizer({module_id: self.module}, inner=cfg.inner, outer=outer_cfg, lattice=cfg.lattice,
                                   averager=averager, join_ramp_rounds=JOIN_RAMP_ROUNDS,
                                   paced_min_share=0.0)  # steps far apart: a waiting holder is answered at once
        self.tokens_per_step = options.tokens_per_step or cfg.inner.batch_size * cfg.lattice.seq_len
        self._kept: OrderedDict[tuple[str, str], tuple[torch.Tensor, float]] = OrderedDict()
        self._counts = {"forward": 0, "backward": 0, "step": 0, "rejected": 0}
        self._acc_tokens = 0
        self._acc_batches = 0
        self.tokens_trained = 0
        self.queue_length = 0
        self.busy_seconds = 0.0
        """Seconds spent serving requests that were answered, all told (capacity over a window: the
        tokens trained over these seconds, both differenced)."""
        self._busy_seconds = 0.0
        self._busy_tokens = 0.0
        self.throughput = 0.0
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage-{module_id}")
        self._queue: list[tuple[StageRequest, str, asyncio.Future]] = []
        """Requests received and not yet served, oldest first, each with the future its reply settles."""
        self._queue_lock = threading.Lock()
        self._serving = False
        """Whether a turn of the compute thread is submitted (it serves the queue until it is empty)."""
        self._stopping = threading.Event()
        self._announcer: Optional[threading.Thread] = None
        self._attached = False
        self.holds: Optional[IdleHolds] = None

    # -- life cycle -----------------------------------------------------------------------------

    def start(self, startup_timeout: float = 30.0) -> "StageServer":
        """Measure throughput, register the handler on this process's P2P, and start announcing."""
        self.throughput = self.measure_throughput()
        endpoint.attach(self, self.dht, self.cfg.run_id, self.options.max_elements, startup_timeout)
        self._attached = True
        # held in rounds only while trainers drive us: an idle server must not hold back the module's others
        self.holds = IdleHolds(self.averager, [self.module_id], self.opt.module_round, self.options.idle_timeout,
                               f"stage {self.module_id}")
        self.announce()
        self._announcer = threading.Thread(target=self._announce_loop, name="stage-announce", daemon=True)
        self._announcer.start()
        self._pacer = threading.Thread(target=self._pace_loop, name="stage-pace", daemon=True)
        self._pacer.start()
        log.info("serving %s as a stage (%.0f tokens/s measured)", self.module_id, self.throughput)
        return self

    def close(self) -> None:
        """Stop announcing and serving; apply an exchange still in flight."""
        self._stopping.set()
        if self.holds is not None:
            self.holds.close()
        if self._attached:
            endpoint.detach(self, self.dht)
            self._attached = False
        self._compute.submit(self.opt.close).result()
        self._compute.shutdown(wait=True)

    def __enter__(self) -> "StageServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- announcing -----------------------------------------------------------------------------

    def record(self) -> StageServerRecord:
        return StageServerRecord(self.module_id, self.config_hash, float(self.throughput), int(self.queue_length))

    def announce(self) -> bool:
        """Store (or refresh) our record on the DHT; False, logged, when the store failed or took too long."""
        return announce_within(self.dht, stage_servers_key(self.cfg.run_id, self.module_id),
                               stage_record_value(self.record()), self.options.record_ttl, self.peer_id,
                               f"stage {self.module_id}")

    def _announce_loop(self) -> None:
        refresh_until(self._stopping, self.options.record_ttl / 3, self.announce)

    def _pace_loop(self) -> None:
        """A driven server's steps are a whole batch through the pipeline apart: once another holder waits
        for our round, end it between steps instead of at the next one."""
        pending = None
        while not self._stopping.wait(self.options.pace_interval):
            if self.holds is None or self.holds.paused or (pending is not None and not pending.done()):
                continue
            try:
                pending = self._compute.submit(self._end_round_if_waited)
            except RuntimeError:  # the compute pool shut down: we are closing
                return

    def _end_round_if_waited(self) -> None:
        if self._stopping.is_set():
            return
        report = self.opt.end_round_if_others_wait(sparse=True)  # steps a whole batch apart: no round waits on one
        if report is not None:
            self._after_round(report)

    @torch.no_grad()
    def measure_throughput(self, repeats: int = 2) -> float:
        """Tokens/s of a forward plus a recomputed forward and backward on one batch of the run."""
        cfg = self.cfg
        x = torch.randn(cfg.inner.batch_size, cfg.lattice.seq_len, cfg.lattice.d_model, device=self.device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            with autocast(self.device):
                self.module(x)
            with torch.enable_grad(), autocast(self.device):
                xi = x.clone().requires_grad_(True)
                self.module(xi).float().sum().backward()
        self.module.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        measured = repeats * x.shape[0] * x.shape[1] / max(seconds, 1e-9)
        return min(measured, self.options.emulated_throughput or measured)

    # -- serving --------------------------------------------------------------------------------

    @property
    def counts(self) -> dict[str, int]:
        """Requests received per kind, inner steps taken and requests rejected."""
        return dict(self._counts)

    async def handle(self, request: StageRequest, context: Any) -> StageReply:
        """Answer one request (on the stage endpoint's event loop; the work runs on our compute thread,
        in turns of up to ``options.serve_batch`` queued requests)."""
        self.queue_length += 1
        try:
            loop = asyncio.get_running_loop()
            reply: asyncio.Future = loop.create_future()
            with self._queue_lock:
                self._queue.append((request, context.remote_id.to_base58(), reply))
                start, self._serving = not self._serving, True
            if start:
                self._next_turn(loop)
            return await reply
        finally:
            self.queue_length -= 1

    def _next_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        """Submit a turn of the compute thread; it queues behind the thread's other work (a round's end,
        a snapshot). A closed server answers what is queued that it serves no more."""
        try:
            self._compute.submit(self._serve_turn, loop)
        except RuntimeError:  # the compute pool shut down: we are closing
            with self._queue_lock:
                left, self._queue, self._serving = self._queue, [], False
            closed = StageReply(code=StageReply.NOT_HELD, error=f"this server stopped serving {self.module_id}")
            loop.call_soon_threadsafe(_settle, [(f, closed) for _, _, f in left])

    def _serve_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve the oldest ``serve_batch`` queued requests, hand their replies back together, and submit
        the next turn while requests remain."""
        with self._queue_lock:
            turn = self._queue[:max(1, self.options.serve_batch)]
            del self._queue[:len(turn)]
        done: list[tuple[asyncio.Future, Any]] = []
        for request, caller, reply in turn:
            try:
                done.append((reply, self._serve(request, caller)))
            except Exception as e:  # _serve answers every failure it expects; a bug reaches the handler
                done.append((reply, e))
        try:
            loop.call_soon_threadsafe(_settle, done)
        except RuntimeError:  # the endpoint's loop is closed: the process is ending, no one awaits these
            pass
        with self._queue_lock:
            more = self._serving = bool(self._queue)
        if more:
            self._next_turn(loop)

    def _serve(self, request: StageRequest, caller: str) -> StageReply:
        t0 = time.perf_counter()
        try:
            other_major = versions.refusal("stage", request.protocol, who=f"trainer {caller[-8:]}", us="this server")
            if other_major:
                raise _Rejected(StageReply.BAD_REQUEST, other_major)
            if request.module_id != self.module_id:
                raise _Rejected(StageReply.NOT_HELD, f"this server serves {self.module_id}, not {request.module_id!r}")
            if request.config_hash != self.config_hash:
                raise _Rejected(StageReply.NOT_HELD, f"config hash {request.config_hash!r} differs from the "
                                                     f"server's {self.config_hash}")
            if len(request.request_id) > 128:
                raise _Rejected(StageReply.BAD_REQUEST, "request id longer than 128 characters")
            if request.kind == StageRequest.FORWARD:
                out, tokens, share = self._forward(request, caller), 0, 1 / 3
            elif request.kind == StageRequest.BACKWARD:
                (out, tokens), share = self._backward(request, caller), 2 / 3
            else:
                raise _Rejected(StageReply.BAD_REQUEST, f"unknown request kind {request.kind}")
            reply = StageReply(code=StageReply.OK, output=out, residual=request.residual)
            if self.options.emulated_throughput > 0:
                shape = request.input.shape if request.kind == StageRequest.FORWARD else request.grad.shape
                work = shape[0] * shape[1] * share / self.options.emulated_throughput
                time.sleep(max(0.0, work - (time.perf_counter() - t0)))  # an emulated slower device, not a wait
        except WireError as e:
            reply = self._reject(StageReply.BAD_REQUEST, str(e), caller)
        except _Rejected as e:
            reply = self._reject(e.code, str(e), caller)
        except Exception as e:  # a bug or a diverged module: the trainer retries elsewhere
            log.exception("stage %s failed a request from %s", self.module_id, caller)
            reply = self._reject(StageReply.INTERNAL, f"{type(e).__name__}: {e}", caller)
        else:
            self._account(time.perf_counter() - t0, tokens)
        reply.queue_length = max(0, self.queue_length - 1)
        reply.throughput = float(self.throughput)
        return reply

    def _reject(self, code: int, message: str, caller: str) -> StageReply:
        self._counts["rejected"] += 1
        log_limited(log, f"stage:{code}", "rejected a request from %s: %s", caller, message)
        return StageReply(code=code, error=message)

    def _account(self, seconds: float, tokens: int) -> None:
        """Throughput: backpropagated tokens over busy seconds, decayed so it follows the present."""
        self.busy_seconds += seconds
        self._busy_seconds = 0.95 * self._busy_seconds + seconds
        self._busy_tokens = 0.95 * self._busy_tokens + tokens
        if self._busy_tokens > 0:
            self.throughput = self._busy_tokens / self._busy_seconds

    def _decode_input(self, request: StageRequest) -> torch.Tensor:
        lat = self.cfg.lattice
        x = decode_tensor(request.input, "input activations", self.options.max_elements, last_dim=lat.d_model)
        if x.shape[1] > lat.seq_len:
            raise WireError(f"input activations hold {x.shape[1]} tokens, more than seq_len={lat.seq_len}")
        return x.to(self.device)  # (B, T, C)

    def _event(self, point: str) -> None:
        self._counts[point] += 1
        if self._hook is not None:
            self._hook(point, self._counts[point])

    @torch.no_grad()
    def _forward(self, request: StageRequest, caller: str) -> Any:
        self._event("forward")
        x = self._decode_input(request)  # (B, T, C)
        with autocast(self.device):  # bf16 on CUDA, as a path peer trains
            y = self.module(x).float()  # (B, T, C)
        if request.residual:
            y = y - x  # the blocks' residual branches: the trainer adds its exact input
        now = time.monotonic()
        while self._kept and (len(self._kept) >= self.options.max_kept or next(iter(self._kept.values()))[1] < now):
            self._kept.popitem(last=False)
        self._kept[(caller, request.request_id)] = (x, now + self.options.keep_timeout)
        return encode_tensor(y, activation_codec(request.input.codec))  # the request's, validated by decoding

    def _backward(self, request: StageRequest, caller: str) -> tuple[Any, int]:
        self._event("backward")
        if self.holds is not None:
            self.holds.active()
        key = (caller, request.request_id)
        kept = self._kept.get(key)
        if kept is not None and kept[1] >= time.monotonic():
            x = kept[0]
        elif request.HasField("input"):
            x = self._decode_input(request)
        else:
            raise _Rejected(StageReply.UNKNOWN_REQUEST, f"no kept input for request {request.request_id!r} "
                                                        "(expired or served elsewhere); resend it with the input")
        g = decode_tensor(request.grad, "output gradient", self.options.max_elements, shape=list(x.shape))
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            with autocast(self.device):
                y = self.module(x).float()  # (B, T, C)
            y.backward(g.to(self.device))
        g_in = x.grad - g.to(self.device) if request.residual else x.grad  # residual: the trainer adds its exact g
        grad_in = encode_tensor(g_in, activation_codec(request.grad.codec))
        self._kept.pop(key, None)  # only now: a backward that failed may be retried here
        tokens = x.shape[0] * x.shape[1]
        self._acc_tokens += tokens
        self._acc_batches += 1
        if self._acc_tokens >= self.tokens_per_step:
            self._inner_step()
        return grad_in, tokens

    def _inner_step(self) -> None:
        """The mean of the accumulated micro-batch gradients, one inner step (and outer round when due)."""
        if self._acc_batches > 1:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.div_(self._acc_batches)
        report = self.opt.step(tokens=float(self._acc_tokens))
        self.opt.zero_grad(set_to_none=True)
        self.tokens_trained += self._acc_tokens
        self._acc_tokens = self._acc_batches = 0
        self._event("step")
        if report is not None:
            self._after_round(report)

    def _after_round(self, report: RoundReport) -> None:
        if hasattr(self.averager, "hold"):  # announced idle while paused (NetAverager.pause)
            try:
                self.averager.hold(self.module_id, self.opt.module_round(self.module_id), wait=False)
            except Exception as e:
                log.debug("announcing the next round failed: %r", e)
        if self._on_round is not None:
            self._on_round(report)

    def run_on_compute(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the compute thread, between requests (state snapshots, flushes)."""
        return self._compute.submit(fn).result()
