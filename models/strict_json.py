"""The one JSON writer: strict JSON in every file and stream hivepath writes.

Python's ``json`` writes ``NaN`` and ``Infinity`` by default, which are not JSON: a strict parser (a
browser, ``jq``, most other languages) refuses the whole document. A loss that has not been measured
yet, or a rate over zero seconds, is a non-finite float; here it becomes ``null``. Every writer in
the project goes through :func:`dumps` (``tests/models/test_strict_json.py`` checks that no other
``json.dump``/``json.dumps`` call is left).

Stdlib only: the coordinator's image and the command line use it.
"""

from __future__ import annotations

import json
import math
from typing import Any, TextIO

__all__ = ["finite", "dumps", "dump"]


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, +-inf) replaced by None; tuples become lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """``json.dumps`` of :func:`finite` ``(obj)``, refusing anything that is still not JSON."""
    return json.dumps(finite(obj), allow_nan=False, **kw)


def dump(obj: Any, fp: TextIO, **kw: Any) -> None:
    """``json.dump`` of :func:`finite` ``(obj)`` to ``fp``."""
    fp.write(dumps(obj, **kw))
