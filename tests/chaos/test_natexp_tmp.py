import re, time, pytest
from chaos.nsnet import CHAOS_PREFIX, CHAOS_SUBNET, NsNetwork
from chaos.scenario import prepare_dataset
from helpers import wait_for
import os

def test_exp(procs, tmp_path):
    from bench.netns import NetnsBridge
    data = prepare_dataset(tmp_path / "data")
    extra = os.environ.get("EXP_EXTRA", "").split()
    with NetnsBridge(4, rate="100mbit", subnet=CHAOS_SUBNET, prefix=CHAOS_PREFIX, nat=[2, 3]) as b:
        net = NsNetwork(procs, tmp_path, data.dir, data.manifest_hash, b, inner_steps=4)
        net.start_coordinator()
        net.start_peer_in("public", 1)
        wait_for(lambda: (net.status() or {}).get("peers"), 120, "pub")
        net.start_peer_in("nat2", 2, *extra)
        net.start_peer_in("nat3", 3, *extra)
        t0 = time.monotonic()
        wait_for(lambda: time.monotonic() - t0 > 60, 100, "60 s")
        for n in ("public", "nat2", "nat3"):
            log = net.procs.log(n)
            rounds = re.findall(r"round \d+: (.*?); waited", log)
            open(f"/tmp/natexp/{n}.log", "w").write(log)
            print(n, len(rounds), rounds[-3:] if rounds else None)
        print((net.status() or {}).get("modules"))
