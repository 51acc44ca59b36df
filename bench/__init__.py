"""Benchmarks: each runs as ``python -m bench.NAME``, prints one JSON object as its last line and
writes it to ``bench/results/NAME.json``; ``make bench`` runs them all."""
