"""The scale simulator behind ``python -m bench.scale``: thousands of volunteers against
the real coordinator and the real DHT record code, on a simulated clock and network.

- :mod:`bench.scale_sim.events`: the discrete-event loop and its clock (the only clock the
  coordinator sees in a simulation)
- :mod:`bench.scale_sim.population`: peers' devices, links, NAT and lifetimes, drawn from a seed
- :mod:`bench.scale_sim.dht`: an in-process DHT (dictionary values with subkeys, as hivemind's)
  that counts operations and bytes
- :mod:`bench.scale_sim.swarm`: the swarm: joins, heartbeats, churn and reassignment through
  :class:`coordinator.Coordinator` on an SQLite store; rounds, matchmaking and exchanges per module
"""

from bench.scale_sim.events import EventLoop
from bench.scale_sim.population import PeerSpec, draw_peers
from bench.scale_sim.swarm import SimConfig, SimResult, simulate

__all__ = ["EventLoop", "PeerSpec", "draw_peers", "SimConfig", "SimResult", "simulate"]
