"""Write the contracts' golden messages and schema fingerprints (``tests/golden/contracts/``).

    cd <repo> && .venv/bin/python tests/golden/regen_contracts.py

For each contract of :mod:`protos.versions`: ``{contract}-{version}.json`` (its sample messages at
the version this release speaks; files of earlier versions stay, and the tests read them all) and
its entry in ``fingerprints.json``. A contract whose schema changed while its version did not is
refused: raise its version in ``protos/versions.py`` first (a minor for optional fields only, listed
in ``Contract.added``; a major for anything a reader of the previous minor could not read), then run
this again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import contract_spec as spec  # noqa: E402
from protos import versions  # noqa: E402


def main() -> int:
    spec.HERE.mkdir(exist_ok=True)
    known = json.loads(spec.FINGERPRINTS.read_text()) if spec.FINGERPRINTS.exists() else {}
    refused = []
    for name, contract in versions.CONTRACTS.items():
        was = known.get(name)
        now = spec.fingerprint(name)
        if was is not None and was["version"] == contract.text and was["fingerprint"] != now:
            refused.append(f"{name}: its schema changed but its version is still {contract.text}; raise it in "
                           "protos/versions.py (and list the new fields in Contract.added)")
            continue
        known[name] = {"version": contract.text, "fingerprint": now}
        messages = {k: v.hex() for k, v in sorted(spec.samples(name).items())}
        spec.golden_path(name, contract.text).write_text(json.dumps(
            {"contract": name, "version": contract.text, "messages": messages}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {spec.golden_path(name, contract.text).name}")
    spec.FINGERPRINTS.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    for line in refused:
        print(line, file=sys.stderr)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
