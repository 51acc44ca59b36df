"""Benchmarks: each runs as ``python -m bench.NAME``, prints one JSON object as its last line and
writes it to ``bench/results/NAME.json``; ``make bench`` runs them all."""

from models.grpc_fork import grpc_fork_safe

grpc_fork_safe()  # before a benchmark imports grpc: the processes it starts must not be aborted by it
