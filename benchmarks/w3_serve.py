"""W3 against `petrel serve`: the same as `petrel bench serve` (kept so the commands in BENCHMARKS.md still run)."""

import sys

from petrel.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
