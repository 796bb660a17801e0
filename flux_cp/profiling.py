"""`python -m flux_cp.profiling TRACE`: what a profiled step's trace says about the GPU's time
(flux_cp.outputs.profiling)."""

import sys

from flux_cp.outputs.profiling import main

if __name__ == "__main__":
    sys.exit(main())
