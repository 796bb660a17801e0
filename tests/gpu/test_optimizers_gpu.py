"""8-bit AdamW (bitsandbytes, `--use_8bit_adam`) on CUDA GPUs; skipped without a GPU or without bitsandbytes
(`pip install -e .[optim]`): `python -m pytest -q tests/gpu/test_optimizers_gpu.py`.

- A dropped non-finite step leaves its weights and quantised state as they were (it has no on-device skip: the
  trainer reads the step's flag first).
- Its state goes through the checkpoint (torch.distributed.checkpoint) and continues exactly.
- train_flux_cp.py with --use_8bit_adam on one GPU trains, checkpoints and resumes to the same losses and weights;
  with an FSDP config it is refused in one line before anything loads.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install -e .[optim])")

ROOT = Path(__file__).resolve().parents[2]


def _optimizer(params):
    from flux_cp.config.training import TrainConfig
    from flux_cp.model.optim import make_optimizer

    opt = make_optimizer(TrainConfig(use_8bit_adam=True, learning_rate=1e-2), params, global_batch=1)
    assert isinstance(opt, bnb.optim.AdamW8bit)
    return opt


def test_a_dropped_step_leaves_8bit_adamw_as_it_was():
    from flux_cp.model.optim import apply_update, skips_on_device

    torch.manual_seed(0)
    init = torch.randn(64, 128, device="cuda")
    p, q = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    opt, ref = _optimizer([p]), _optimizer([q])
    assert not skips_on_device(opt)
    sched, ref_sched = (torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0) for o in (opt, ref))
    grads = [torch.randn(64, 128, device="cuda") for _ in range(3)]
    one, nan = torch.tensor(1.0, device="cuda"), torch.tensor(math.nan, device="cuda")
    p.grad, q.grad = grads[0].clone(), grads[0].clone()
    apply_update(opt, sched, one, one)
    apply_update(ref, ref_sched, one, one)
    state = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
    p.grad = grads[1].clone()
    assert apply_update(opt, sched, nan, one).item() is True
    assert torch.equal(p, q) and all(torch.equal(opt.state[p][k], v) for k, v in state.items())
    ref_sched.step()
    p.grad, q.grad = grads[2].clone(), grads[2].clone()
    apply_update(opt, sched, one, one)
    apply_update(ref, ref_sched, one, one)
    assert not torch.equal(p, init) and torch.equal(p, q)


def test_8bit_adamw_state_resumes_exactly(tmp_path):
    from flux_cp.config.training import LoraConfig
    from flux_cp.families.flux1.tiny import tiny_transformer
    from flux_cp.model.loading import prepare_trainable, trainable_parameters
    from flux_cp.outputs import checkpoint

    def trained(steps: int):
        model = tiny_transformer().cuda()
        prepare_trainable(model, LoraConfig(rank=64, lora_alpha=64), seed=0)  # rank 64: 8-bit moments
        params = [p for _, p in trainable_parameters(model)]
        opt = _optimizer(params)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        pull(params, opt, sched, steps)
        return model, opt, sched

    def pull(params, opt, sched, steps: int) -> None:
        for _ in range(steps):
            sum(((p - 1.0) ** 2).sum() for p in params).backward()
            opt.step()
            sched.step()
            opt.zero_grad()

    model, opt, sched = trained(3)
    assert any(v.dtype == torch.uint8 for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    ckpt = checkpoint.save(str(tmp_path), 3, model, opt, sched, {"run": {}}, True, None)
    pull([p for _, p in trainable_parameters(model)], opt, sched, 2)
    model2, opt2, sched2 = trained(0)
    checkpoint.load(ckpt, model2, opt2, sched2)
    pull([p for _, p in trainable_parameters(model2)], opt2, sched2, 2)
    for (_, a), (_, b) in zip(trainable_parameters(model), trainable_parameters(model2)):
        assert torch.equal(a, b)


def _launch(config: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / config), str(ROOT / "train_flux_cp.py"), "--report_to", "none",
           "--output_dir", str(out), "--encodings_dir", str(out.parent / "encodings"), "--use_8bit_adam",
           "--rank", "64", "--max_train_steps", "4", "--checkpointing_steps", "2", *args]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", NCCL_NVLS_ENABLE="0")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_the_trainer_resumes_8bit_adamw_exactly_on_one_gpu(tmp_path):
    from safetensors.torch import load_file

    first = _launch("gpu1.yaml", tmp_path / "run")
    assert first.returncode == 0, first.stderr[-6000:]
    again = _launch("gpu1.yaml", tmp_path / "resumed", "--resume_from_checkpoint", str(tmp_path / "run/checkpoint-2"))
    assert again.returncode == 0, again.stderr[-6000:]
    straight, resumed = [r for r in _rows(tmp_path / "run") if r["step"] > 2], _rows(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    a, b = (load_file(tmp_path / n / "pytorch_lora_weights.safetensors") for n in ("run", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_8bit_adamw_with_fsdp_is_refused_before_anything_loads(tmp_path):
    r = _launch("fsdp2_cp2.yaml", tmp_path / "run", "--cp_size", "2")
    assert r.returncode == 2
    assert "error: --use_8bit_adam is not supported with FSDP (sharded weights): use a DDP config" in r.stderr
