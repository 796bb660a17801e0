"""FLUX.1-dev's blocks at 1024 px, bf16 and fp8, compiled, timed by flux_cp/plan/speed_measure.py's routine twice
each: 5 calls, then 30 calls after two seconds of matrix products (a GPU at its working clocks); and Dynamo's counters
(graphs and graph breaks).

    PYTHONPATH=. python3 diag2.py MODEL OUT.json    # MODEL: python -m flux_cp.tiny --preset flux1-dev-shapes
"""

import json
import sys
import time

import torch

from cp import Tuning
from cp.schedule import inductor_options
from flux_cp.families import FLUX1
from flux_cp.model.blocks import transformer_blocks
from flux_cp.plan import speed_measure as sm

cfg = json.load(open(sys.argv[1] + "/transformer/config.json"))
cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
dev = torch.device("cuda")
req = sm.Request(FLUX1, cfg, tokens=4608, text_tokens=512, batch=1, precisions=("fp8",), modes=("compiled",))


def ac():
    return torch.autocast("cuda", dtype=torch.bfloat16)


x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)


def busy(s):
    t = time.perf_counter()
    while time.perf_counter() - t < s:
        for _ in range(20):
            x @ x
        torch.cuda.synchronize()


res = {}
for prec in ("bf16", "fp8"):
    model = sm._one_of_each(req, prec, dev, torch.bfloat16)
    calls = sm._block_calls(model, FLUX1, sm._inputs(req, dev, torch.bfloat16), ac)
    for b in transformer_blocks(model):
        b.compile(options=inductor_options(None, Tuning(), 1))
    for kind, block, a, k in calls:
        r5 = sm._time_block(block, a, k, 3072, dev, ac, 5, False)
        busy(2.0)
        r30 = sm._time_block(block, a, k, 3072, dev, ac, 30, False)
        res[f"{prec}_{kind}"] = {"r5": r5, "r30_busy": r30}
        print(
            prec,
            kind,
            "r5",
            round(r5["forward"] * 1e3, 2),
            round(r5["backward"] * 1e3, 2),
            "r30",
            round(r30["forward"] * 1e3, 2),
            round(r30["backward"] * 1e3, 2),
            flush=True,
        )
    from torch._dynamo.utils import counters

    print(
        prec,
        "dynamo",
        {k: dict(v) for k, v in counters.items() if k in ("graph_break", "recompiles", "stats")},
        flush=True,
    )
    del model, calls
    torch._dynamo.reset()
    counters.clear()
json.dump(res, open(sys.argv[2], "w"), indent=1)
