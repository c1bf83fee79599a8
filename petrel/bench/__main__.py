"""`python -m petrel.bench ...`: the same as `petrel bench ...` (petrel bench compare runs petrel this way)."""

import sys

from petrel.bench import main

sys.exit(main())
