"""`python -m benchmarks.gpu_bench`."""

import contextlib
import sys

from benchmarks.gpu_bench.run import main

if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
