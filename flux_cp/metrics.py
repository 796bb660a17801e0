"""`python -m flux_cp.metrics METRICS.jsonl [OUT.png]`: a run's loss curve from its metrics file
(flux_cp.outputs.metrics)."""

import sys

from flux_cp.outputs.metrics import main

if __name__ == "__main__":
    sys.exit(main())
