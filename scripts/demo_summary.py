"""Print the demo's cold-vs-warm table from `build --json` and `verify --replay --json` output."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(build_json: str, replay_json: str) -> int:
    build = json.loads(Path(build_json).read_text())
    replay = json.loads(Path(replay_json).read_text())
    cold = {o["unit_id"]: o for o in build["outcomes"]}
    print(f"\n{'shape':<20}{'cold first call':>17}{'warm first call':>17}{'speed-up':>10}{'compiles':>10}")
    for unit in replay["units"]:
        c = cold[unit["unit_id"]]["first_call_s"]
        w = unit["first_call_s"]
        compiles = unit["compiles"] + len(unit["written"])
        print(f"{unit['unit_id']:<20}{c:>15.1f} s{w:>15.2f} s{c / w:>9.1f}x{compiles:>10}")
    print(f"\nrelease {build['release_id']}; replay: {replay['misses']} misses of {len(replay['units'])} units")
    return 0 if replay["misses"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
