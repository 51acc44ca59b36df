"""The link's own ceiling for an all-reduce: bare TCP moving the same bytes in the same pattern.

``bench.comm`` asks how close hivepath's exchange comes to the link. This measures what the link and
the kernel's TCP allow for that traffic when no CPU work is done at all: in fresh namespaces at the
same rate (:class:`peer.localnet.netns.NetnsBridge`), ``n`` small processes each send part ``j`` of a
``size``-byte vector (zeros: no encoding, no TLS, no copies worth counting) to peer ``j``, cut into
the same segments as the averager's pipeline; a peer returns a segment's "average" of its part to
every sender as soon as it holds that segment from all of them. Each peer's time runs from a shared
start to the last average it receives; the round's time is the slowest peer's, and its link
efficiency is ``bench.comm``'s: ``2 (n - 1) / n * size / rate`` over that time.

Four schedules, ways one might carry the traffic:

- ``per_pair``: one connection per ordered pair of peers, segments back to back, averages returned on it;
- ``per_segment``: one connection per segment and part, the next segment sent once the last one is
  handed to the kernel (a pipeline with no bound on what is in flight);
- ``paced``: as ``per_segment``, but the next segment also waits until the reducer acknowledged the
  one before the last (a byte it sends back as soon as it holds the segment): the averager's bound on
  segments in flight (``peer.averaging.group_round.IN_FLIGHT``) alone;
- ``ahead``: as ``paced``, but a peer returns a segment's averages only once its own segments through
  the next one are handed to the kernel: what the averager does
  (``peer.averaging.reducer.CONTRIBUTIONS_AHEAD``).

``measure`` runs ``rounds`` of each and reports each schedule's median link efficiency, and the
ceiling: the best median. Everything the processes send is counted by the namespaces' ``tbf``
too, so the gap between this ceiling and 1.0 is what TCP/IP headers, acknowledgements and the
congestion control's own pacing leave of the link (about 5% is headers and acknowledgements alone).

Run by ``bench.comm`` (its ``tcp_ceiling`` key); ``python -m bench.tcp_ceiling --peer ...`` is the
in-namespace process.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from typing import Optional

from models import strict_json

__all__ = ["measure", "SCHEDULES"]

SCHEDULES = ("per_pair", "per_segment", "paced", "ahead")
IN_FLIGHT = 2
"""``paced`` and ``ahead``: most segments of a sender at one reducer not yet acknowledged: the averager's
``peer.averaging.group_round.IN_FLIGHT``, not imported (it would bring torch into these small processes)."""
CONTRIBUTIONS_AHEAD = 1
"""``ahead``: the averager's ``peer.averaging.reducer.CONTRIBUTIONS_AHEAD`` (not imported, as above)."""
_ACKED = ("paced", "ahead")
PORT = 47211
_HEADER = struct.Struct(">II")  # sender, segment
_IO_TIMEOUT = 60.0


def _recv_exactly(conn: socket.socket, n: int, buf: "bytearray | memoryview") -> None:
    """Receive ``n`` bytes into ``buf``: from its start when it holds them all, else over and over
    (a payload only counted)."""
    view = memoryview(buf)
    while n:
        got = conn.recv_into(view, min(n, len(view)))
        if not got:
            raise ConnectionError("closed early")
        n -= got


def _peer(me: int, addrs: list[str], size: int, segments: int, schedule: str, start_at: float) -> float:
    """One peer's round: seconds from ``start_at`` to the last average it received."""
    n = len(addrs)
    seg = size // n // segments  # one segment of one part
    payload = b"\0" * seg
    lock = threading.Condition()
    have = [set() for _ in range(segments)]  # senders whose segment s of our part arrived
    reply_to: dict[tuple[int, int], socket.socket] = {}
    errors: list[BaseException] = []
    handed_of = [0] * segments  # our own segments handed to the kernel, by segment (``ahead``)

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((addrs[me], PORT))
    server.listen(64)
    server.settimeout(_IO_TIMEOUT)

    def serve(conn: socket.socket) -> None:
        buf = bytearray(1 << 20)
        try:
            while True:
                head = bytearray(_HEADER.size)
                got = conn.recv_into(head)
                if got == 0:
                    return
                if got < _HEADER.size:  # the rest after what came
                    _recv_exactly(conn, _HEADER.size - got, memoryview(head)[got:])
                sender, s = _HEADER.unpack(head)
                _recv_exactly(conn, seg, buf)
                if schedule in _ACKED:
                    conn.sendall(b"\1")  # before the average can be: the reply waits for ``have`` below
                with lock:
                    have[s].add(sender)
                    reply_to[(sender, s)] = conn
                    lock.notify_all()
                if schedule != "per_pair":
                    return
        except OSError as e:
            errors.append(e)

    expected = (n - 1) * (1 if schedule == "per_pair" else segments)

    def accept() -> None:
        try:
            for _ in range(expected):
                conn, _ = server.accept()
                conn.settimeout(_IO_TIMEOUT)
                threading.Thread(target=serve, args=(conn,), daemon=True).start()
        except OSError as e:
            errors.append(e)

    def reply(sender: int) -> None:
        """Averages of our part to ``sender``, segment after segment, each once every sender's is here."""
        try:
            for s in range(segments):
                through = min(s + CONTRIBUTIONS_AHEAD, segments - 1) if schedule == "ahead" else -1
                with lock:
                    while (len(have[s]) < n - 1 or any(h < n - 1 for h in handed_of[:through + 1])) and not errors:
                        lock.wait(1.0)
                    conn = reply_to.get((sender, s))
                if conn is None:
                    return
                conn.sendall(payload)
        except OSError as e:
            errors.append(e)

    def exchange(j: int) -> None:
        """Our part ``j``, its segments to peer ``j``, and their averages back."""
        buf = bytearray(1 << 20)
        try:
            if schedule == "per_pair":
                conn = socket.create_connection((addrs[j], PORT), timeout=_IO_TIMEOUT)
                for s in range(segments):
                    conn.sendall(_HEADER.pack(me, s) + payload)
                for _ in range(segments):
                    _recv_exactly(conn, seg, buf)
                done.append(time.time())
                return
            handed = [threading.Event() for _ in range(segments)]
            acked = [threading.Event() for _ in range(segments)]
            waits = []

            def one(s: int) -> None:
                try:
                    conn = socket.create_connection((addrs[j], PORT), timeout=_IO_TIMEOUT)
                    conn.sendall(_HEADER.pack(me, s) + payload)
                    handed[s].set()
                    with lock:
                        handed_of[s] += 1
                        lock.notify_all()
                    if schedule in _ACKED:
                        _recv_exactly(conn, 1, bytearray(1))
                        acked[s].set()
                    _recv_exactly(conn, seg, bytearray(1 << 20))
                except OSError as e:
                    errors.append(e)
                finally:
                    handed[s].set()
                    acked[s].set()

            for s in range(segments):
                t = threading.Thread(target=one, args=(s,), daemon=True)
                t.start()
                waits.append(t)
                handed[s].wait(_IO_TIMEOUT)
                if schedule in _ACKED and s + 1 >= IN_FLIGHT:
                    acked[s + 1 - IN_FLIGHT].wait(_IO_TIMEOUT)
            for t in waits:
                t.join(_IO_TIMEOUT)
            done.append(time.time())
        except OSError as e:
            errors.append(e)

    done: list[float] = []
    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    while time.time() < start_at:
        time.sleep(0.0005)
    repliers = [threading.Thread(target=reply, args=(k,), daemon=True) for k in range(n) if k != me]
    senders = [threading.Thread(target=exchange, args=(j,), daemon=True) for j in range(n) if j != me]
    for t in repliers + senders:
        t.start()
    for t in senders + repliers:  # our averages out before we close anything
        t.join(_IO_TIMEOUT)
    if errors or len(done) < n - 1:
        raise RuntimeError(f"peer {me}: {errors[:1] or 'an exchange did not finish'}")
    return max(done) - start_at


def _round(net, n: int, size: int, segments: int, schedule: str) -> float:
    """One round in every namespace at once: the slowest peer's seconds."""
    addrs = ",".join(net.address(i) for i in range(n))
    start_at = time.time() + 1.0  # the processes start (no torch import) well within this
    procs = [net.popen(i, [sys.executable, "-m", "bench.tcp_ceiling", "--peer", str(i), "--addrs", addrs,
                           "--size", str(size), "--segments", str(segments), "--schedule", schedule,
                           "--start-at", repr(start_at)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    seconds = []
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=3 * _IO_TIMEOUT)
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise RuntimeError(f"tcp_ceiling peer {i} exited {p.returncode}: {err[-2000:]}")
        seconds.append(json.loads(out.strip().splitlines()[-1])["seconds"])
    return max(seconds)


def measure(n: int, rate_mbit: int, size: int, segments: int, rounds: int = 5, prefix: str = "hpl") -> dict:
    """Bare TCP's link efficiency for an all-reduce of ``size`` bytes per peer among ``n`` peers at
    ``rate_mbit`` (see the module docstring): per schedule its rounds and median, and ``ceiling``."""
    from peer.localnet.netns import NetnsBridge

    rate = rate_mbit * 1e6 / 8
    optimal = 2 * (n - 1) / n * size / rate
    out: dict = {"size_bytes": size, "segments": segments, "rounds": rounds, "optimal_seconds": round(optimal, 3)}
    with NetnsBridge(n, rate=f"{rate_mbit}mbit", prefix=prefix, subnet="10.78.9") as net:
        for schedule in SCHEDULES:
            effs = [round(optimal / _round(net, n, size, segments, schedule), 3) for _ in range(rounds)]
            out[schedule] = {"link_efficiency": round(statistics.median(effs), 3), "link_efficiency_by_round": effs}
    out["link_efficiency"] = max(out[s]["link_efficiency"] for s in SCHEDULES)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tcp_ceiling", description=__doc__.split("\n")[0])
    parser.add_argument("--peer", type=int, required=True)
    parser.add_argument("--addrs", required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--segments", type=int, required=True)
    parser.add_argument("--schedule", choices=SCHEDULES, required=True)
    parser.add_argument("--start-at", type=float, required=True)
    args = parser.parse_args(argv)
    seconds = _peer(args.peer, args.addrs.split(","), args.size, args.segments, args.schedule, args.start_at)
    print(strict_json.dumps({"peer": args.peer, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
