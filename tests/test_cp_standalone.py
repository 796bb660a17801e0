"""`cp` is a library of its own: in a fresh interpreter that imports `cp` and diffusers alone, a tiny Flux transformer
with `cp.apply_context_parallel` trains (forward and backward) on one process and over 2 gloo ranks (Ulysses and
ring, against the same model without CP), and `flux_cp` is never imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flux_cp.families.flux1.tiny import TRANSFORMER_CONFIG

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import json
    import os
    import sys

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from diffusers import FluxTransformer2DModel

    import cp

    CONFIG, INIT = json.loads(sys.argv[1]), sys.argv[2]
    TEXT, IMAGE = 8, 16


    def model():
        torch.manual_seed(0)
        return FluxTransformer2DModel(**CONFIG)


    def inputs():
        g = torch.Generator().manual_seed(1)
        ids = torch.zeros(IMAGE, 3)
        ids[:, 1], ids[:, 2] = torch.arange(IMAGE) // 4, torch.arange(IMAGE) % 4
        return dict(
            hidden_states=torch.randn(1, IMAGE, CONFIG["in_channels"], generator=g),
            encoder_hidden_states=torch.randn(1, TEXT, CONFIG["joint_attention_dim"], generator=g),
            pooled_projections=torch.randn(1, CONFIG["pooled_projection_dim"], generator=g),
            timestep=torch.rand(1, generator=g), guidance=torch.full((1,), 3.5),
            img_ids=ids, txt_ids=torch.zeros(TEXT, 3),
        )


    def step(transformer, x, group=None):
        out = transformer(**x).sample
        out.square().sum().backward()  # over this rank's tokens: the ranks' gradients sum to the whole one
        grads = torch.cat([p.grad.flatten() for p in transformer.parameters()])
        if group is not None:
            dist.all_reduce(grads, group=group)
            out = cp.gather(out.detach(), 1, group)
        return out.detach(), grads


    def rank_main(rank, world, expected):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method="file://" + INIT, rank=rank, world_size=world)
        group = dist.group.WORLD
        for mode in ("ulysses", "ring"):
            transformer = cp.apply_context_parallel(model(), cp.CPContext(group, mode))
            x = inputs()
            for key, dim in (("hidden_states", 1), ("encoder_hidden_states", 1), ("img_ids", 0), ("txt_ids", 0)):
                x[key] = cp.shard(x[key], dim, group)
            out, grads = step(transformer, x, group)
            ref_out, ref_grads = expected
            assert (out - ref_out).abs().max() <= 2e-5 * ref_out.abs().max(), mode
            assert (grads - ref_grads).abs().max() <= 2e-5 * ref_grads.abs().max(), mode
        assert "flux_cp" not in sys.modules, "a rank imported flux_cp"
        dist.destroy_process_group()


    if __name__ == "__main__":
        torch.set_num_threads(1)
        plain = step(model(), inputs())
        one = step(cp.apply_context_parallel(model(), None), inputs())  # one process: cp's own kernels
        assert torch.allclose(one[0], plain[0], rtol=1e-5, atol=1e-6), "cp at one process differs from diffusers"
        # forked: the ranks start with this process's imports (spawned ones would import torch and diffusers again)
        mp.start_processes(rank_main, args=(2, plain), nprocs=2, start_method="fork")
        assert "flux_cp" not in sys.modules, "flux_cp was imported"
        print("ok")
    """
)


@pytest.mark.distributed
def test_cp_runs_without_flux_cp(tmp_path):
    script = tmp_path / "standalone.py"
    script.write_text(SCRIPT)
    config = json.dumps(TRANSFORMER_CONFIG)
    cmd = [sys.executable, str(script), config, str(tmp_path / "init")]
    # run from outside the repository, with the repository on the path: only what the script imports is loaded
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]
