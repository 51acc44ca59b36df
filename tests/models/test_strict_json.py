"""Strict JSON in every file and stream hivepath writes: non-finite floats become null, and no writer
bypasses ``models.strict_json`` (swept over the source, so a new writer is covered the day it is added)."""

from __future__ import annotations

import json
import math
import re

import pytest

from helpers.procs import ROOT
from models import strict_json

PACKAGES = ("peer", "coordinator", "hivepath", "models", "bench", "deploy")


def _strict_loads(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_floats_become_null_everywhere_in_the_document():
    doc = {"loss": math.nan, "rate": math.inf, "curve": [1.5, -math.inf, (math.nan, 2)], "ok": 3, "name": "NaN"}
    text = strict_json.dumps(doc, sort_keys=True)
    assert _strict_loads(text) == {"loss": None, "rate": None, "curve": [1.5, None, [None, 2]], "ok": 3, "name": "NaN"}
    with pytest.raises(ValueError):  # what Python's json writes by default is refused by a strict reader
        _strict_loads(json.dumps(doc))


def test_no_writer_bypasses_strict_json():
    call = re.compile(r"\bjson\.dumps?\(")
    offenders = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "strict_json.py" or "_pb2" in path.name:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                # a writer that refuses NaN itself (config hashing: a NaN must fail, not hash as null) is strict too
                if call.search(line) and "allow_nan=False" not in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "write JSON through models.strict_json:\n" + "\n".join(offenders)
