"""`--smoke` for every bench: tiny sizes and one round, so the test command can run each bench
(tests/test_bench.py) and a format change that breaks one fails CI instead of rotting unseen.
Its figures mean nothing; explicit flags still win over the smoke sizes."""

from __future__ import annotations

import argparse
from typing import Any


def parse(parser: argparse.ArgumentParser, **tiny: Any) -> argparse.Namespace:
    """Parse the command line; with --smoke, `tiny` replaces the defaults first."""
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes, one round: only checks that the bench still runs"
    )
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(**tiny)
    return parser.parse_args()
