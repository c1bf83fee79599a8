"""W3 against `petrel serve`: the same as `petrel bench serve` (kept so the commands in docs/benchmarks-history.md
still run)."""

import sys

from petrel.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
