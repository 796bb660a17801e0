"""Block timings of FLUX.1-dev at 1024 px two ways in one process: `new`, flux_cp/plan/speed_measure.py's (calls
queued back to back), then `old`, each call timed alone after a synchronize (the routine before that change, kept
here); the attention rate is timed the new way in both.

    PYTHONPATH=. python3 diag.py MODEL OUT.json new,old    # MODEL: python -m flux_cp.tiny --preset flux1-dev-shapes
"""

import json
import sys
import time

import torch

from flux_cp.families import FLUX1
from flux_cp.plan import speed_measure as sm

cfg = json.load(open(sys.argv[1] + "/transformer/config.json"))
cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
out = sys.argv[2]
dev = torch.device("cuda")
req = sm.Request(FLUX1, cfg, tokens=4608, text_tokens=512, batch=1, precisions=("fp8",), modes=("compiled", "eager"))


def old_time_block(block, args, kwargs, hidden, device, autocast, repeats, graphs):
    def grad(t):
        return isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == hidden and t.is_floating_point()

    a = tuple(t.detach().requires_grad_() if grad(t) else t for t in args)
    k = {n: (t.detach().requires_grad_() if grad(t) else t) for n, t in kwargs.items()}
    clock = sm._Clock(device)
    forward, backward, first = [], [], 0.0
    for i in range(repeats + 2):
        sm._sync(device)
        t0 = time.perf_counter()
        m0 = clock.mark()
        with autocast():
            o = block(*a, **k)
        m1 = clock.mark()
        outs = [
            t for t in (o if isinstance(o, (tuple, list)) else (o,)) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        m2 = clock.mark()
        sm._sync(device)
        if i == 0:
            first = time.perf_counter() - t0
        elif i > 1:
            forward.append(clock.seconds(m0, m1))
            backward.append(clock.seconds(m1, m2))
        for t in (*a, *k.values()):
            if isinstance(t, torch.Tensor):
                t.grad = None
    return {"forward": sm._median(forward), "backward": sm._median(backward), "first": first}


def old_rates(device, tokens, hidden, dtype, repeats=5):
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w1 = torch.randn(hidden, 4 * hidden, device=device, dtype=dtype)
    w2 = torch.randn(4 * hidden, hidden, device=device, dtype=dtype)
    clock, times = sm._Clock(device), []
    for _ in range(repeats + 1):
        a = clock.mark()
        (x @ w1) @ w2
        times.append(clock.seconds(a, clock.mark()))
    return 2 * 2 * tokens * hidden * 4 * hidden / sm._median(times[1:]) / 1e12


res = {}
for name in sys.argv[3].split(","):
    t = time.perf_counter()
    if name == "old":
        sm._time_block = old_time_block
        sm.matmul_tflops = old_rates
    raw = sm.measure_blocks(req, dev)
    raw["took_s"] = time.perf_counter() - t
    res[name] = raw
    json.dump(res, open(out, "w"), indent=1, default=str)
    print(name, round(raw["took_s"]), raw["matmul_tflops"], raw["attention_tflops"], raw["h2d_gib_per_s"], flush=True)
    for p, by in raw["blocks"].items():
        for m, bk in by.items():
            print(
                " ",
                p,
                m,
                {kk: (round(v["forward"] * 1e3, 2), round(v["backward"] * 1e3, 2)) for kk, v in bk.items()},
                flush=True,
            )
