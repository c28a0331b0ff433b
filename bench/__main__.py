"""Run every benchmark in turn: ``python -m bench [name ...]`` (names: store, embedded, production,
peers, spark, console). Each prints how long it took."""

from __future__ import annotations

import importlib
import sys
import time

ALL = ("store", "embedded", "production", "peers", "spark", "console")


def main() -> None:
    names = sys.argv[1:] or list(ALL)
    for name in names:
        if name not in ALL:
            sys.exit(f"bench: unknown benchmark {name!r} (choose from {', '.join(ALL)})")
        print(f"# --- bench {name} ---", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        importlib.import_module(f"bench.bench_{name}").main()
        print(f"# --- bench {name}: {time.monotonic() - t0:.0f} s ---", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
