"""benchmarks/fp8_quality.py: the loss difference and the LoRA update cosine of two runs, on run folders made
here."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from benchmarks import fp8_quality, schema


def _run(path, losses, a, b, alpha=4):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": x}) + "\n" for i, x in
                                                enumerate(losses)))  # fmt: skip
    (path / "run_config.json").write_text(json.dumps({"lora_alpha": alpha, "rank": 2}))
    weights = {}
    for name, (ma, mb) in {"transformer.q": (a, b), "transformer.k": (a.flip(0), 2 * b)}.items():
        weights[f"{name}.lora_A.weight"], weights[f"{name}.lora_B.weight"] = ma, mb
    save_file(weights, path / "pytorch_lora_weights.safetensors")
    return path


def test_the_same_update_has_cosine_1_and_the_loss_difference_is_a_mean_of_relative_ones(tmp_path):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 8, generator=g), torch.randn(6, 2, generator=g)
    bf16 = _run(tmp_path / "bf16", [1.0, 2.0, 4.0], a, b)
    same = _run(tmp_path / "same", [1.01, 2.0, 3.96], a, b, alpha=8)  # twice the scale: same direction
    other = _run(tmp_path / "other", [1.0, 2.0, 4.0], a, torch.randn(6, 2, generator=g))
    row = fp8_quality.compare(bf16, same)
    assert row["mean_rel_loss_diff"] == pytest.approx((0.01 + 0 + 0.01) / 3, abs=1e-5)
    assert row["lora_update_cosine"] == pytest.approx(1.0) and row["passes"]
    assert fp8_quality.update_cosine(bf16, other) < 0.9 and not fp8_quality.compare(bf16, other)["passes"]
    deltas = fp8_quality.lora_deltas(bf16)
    assert torch.allclose(deltas["transformer.q"], (b @ a).double() * 2)
    fp8_quality.main([str(bf16), str(same), "--out", str(tmp_path / "q.json")])
    data = schema.load(tmp_path / "q.json")
    assert data["benchmark"] == "fp8_quality" and (tmp_path / "q.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="logged 3 and 2 steps"):
        fp8_quality.mean_relative_difference([1, 2, 3], [1, 2])
