"""A peer's p2p doors in a process of their own, for the raw-frame tests: a real DHT and p2p daemon with
the averaging handlers (Join, Part, State, with a state to serve) and a stage server of the tiny preset.

Run as ``python tests/helpers/p2p_host.py``: prints one JSON line (``peer_id``, ``maddrs``, ``run_id``,
``config_hash``, ``module``) once every handler is registered, then serves until stdin closes, and
logs to stderr like a peer does (every logger at INFO, hivemind's included).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

MODULE = "L0M0"


def main() -> int:
    from hivemind.utils.logging import use_hivemind_log_handler

    from models.lattice import ModularLM
    from models.presets import tiny_cpu
    from peer.averaging.net_averager import NetAverager
    from peer.network import DHTOptions, start_dht
    from peer.outer import ModuleState
    from peer.stage import StageServer, StageServerOptions

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    use_hivemind_log_handler("in_root_logger")
    torch.set_num_threads(1)
    cfg = tiny_cpu()
    params = [p.detach().clone() for p in ModularLM(cfg.lattice, seed=0, module_ids=[MODULE]).mods[MODULE].parameters()]
    state = ModuleState(params, [torch.zeros_like(p) for p in params], round_no=3)
    dht = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    averager = NetAverager(dht, cfg.run_id, cfg.content_hash(), state_provider=lambda mid: state if mid == MODULE else None)
    server = StageServer(cfg, MODULE, dht, options=StageServerOptions(max_elements=4 * cfg.lattice.seq_len * cfg.lattice.d_model)).start()
    print(json.dumps({"peer_id": str(dht.peer_id), "maddrs": [str(m) for m in dht.maddrs()],
                      "run_id": cfg.run_id, "config_hash": cfg.content_hash(), "module": MODULE}), flush=True)
    try:
        sys.stdin.read()  # until the test closes our stdin (or dies)
    finally:
        server.close()
        averager.shutdown()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
