"""Run every benchmark in turn: ``python -m bench [name ...]`` (names: store, embedded, production, spark, console)."""

from __future__ import annotations

import importlib
import sys

ALL = ("store", "embedded", "production", "spark", "console")


def main() -> None:
    names = sys.argv[1:] or list(ALL)
    for name in names:
        if name not in ALL:
            sys.exit(f"bench: unknown benchmark {name!r} (choose from {', '.join(ALL)})")
        print(f"# --- bench {name} ---", file=sys.stderr, flush=True)
        importlib.import_module(f"bench.bench_{name}").main()


if __name__ == "__main__":
    main()
