"""``python -m tests.chaos --backend postgresql --profile ci --seed 1`` (from the repository root)."""

from __future__ import annotations

import argparse
import sys

from .harness import PROFILES, run, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument(
        "--backend",
        action="append",
        choices=["sqlite", "postgresql", "mysql", "mariadb"],
        help="repeatable; all three by default",
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="ci")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the history and worker logs even when it passes")
    args = parser.parse_args(argv)
    results = [
        run(b, args.profile, args.seed, keep=args.keep) for b in args.backend or ["sqlite", "postgresql", "mysql"]
    ]
    print(table(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
