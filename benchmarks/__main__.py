"""``python -m benchmarks [--quick] [--readme]``: run every benchmark script (see benchmarks/run_all.py)."""

import sys

from benchmarks.run_all import main

sys.exit(main())
