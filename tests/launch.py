"""Run train_flux_cp.py as users do: `accelerate launch` for several processes, plain python for one."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "train_flux_cp.py"
CPU_CONFIG = ROOT / "accelerate_configs" / "cpu_cp2.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict:
    e = dict(os.environ)
    e.update(
        {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    )
    e.update(extra)
    return e


def launch_cmd(nproc: int, *args: str, launcher: tuple[str, ...] = ()) -> list[str]:
    """`accelerate launch` of train_flux_cp.py with the CPU config (plain python for one process)."""
    if nproc == 1 and not launcher:
        return [sys.executable, str(SCRIPT), *args]
    port = () if "--main_process_port" in launcher else ("--main_process_port", str(free_port()))
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG),
            "--num_processes", str(nproc), *port, *launcher, str(SCRIPT), *args]  # fmt: skip


def train(nproc: int, *args: str, timeout: float = 600, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(launch_cmd(nproc, *args), cwd=ROOT, env=env(**(extra_env or {})), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


_STDERR = io.StringIO()  # one for every call: loggers set up by an earlier call keep writing to it


def in_process(argv: list[str]) -> tuple[int, str]:
    """The trainer's entry point as `python train_flux_cp.py` runs it, in this process (a second or two instead
    of the ~8 s of a new interpreter importing torch, diffusers and transformers): (exit code, stderr)."""
    import train_flux_cp
    from flux_cp import runner

    _STDERR.seek(0)
    _STDERR.truncate()
    with contextlib.redirect_stderr(_STDERR):
        try:
            code = runner.run(lambda: train_flux_cp.main(argv))
        except SystemExit as e:  # argparse's own usage errors
            code = e.code
    return code, _STDERR.getvalue()


def run_args(tmp: Path, name: str, steps: int, *extra: str, cache: bool = True) -> list[str]:
    """Flags every test run shares: its own output folder, the test's encoding cache, no trackers."""
    cache_flags = ["--encodings_dir", str(tmp / "cache")] if cache else []
    return ["--output_dir", str(tmp / name), *cache_flags, "--report_to", "none", "--max_train_steps", str(steps),
            *extra]  # fmt: skip


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    out, err = result.stdout[-4000:], result.stderr[-8000:]
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
    return result


def losses(output_dir: str | Path) -> list[float]:
    with open(Path(output_dir) / "metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def max_rel_weights(a: str | Path, b: str | Path) -> float:
    """Relative L2 error between two runs' LoRA weights, over all of them and over the B matrices alone (they start
    at zero, so their norm is the training update itself). Per-element comparison would measure Adam's
    normalisation of near-zero gradient elements, whose fp32 summation-order noise it scales up to the step size."""
    import torch
    from safetensors.torch import load_file

    wa, wb = (load_file(Path(r) / "pytorch_lora_weights.safetensors") for r in (a, b))
    assert wa.keys() == wb.keys() and len(wa) > 0

    def flat(w: dict, part: str) -> torch.Tensor:
        return torch.cat([w[k].flatten().double() for k in sorted(w) if part in k])

    return max(((flat(wa, p) - flat(wb, p)).norm() / flat(wb, p).norm()).item() for p in ("", "lora_B"))


def assert_same_trajectory(a: Path, b: Path, tol: float = 1e-5) -> None:
    la, lb = losses(a), losses(b)
    assert len(la) == len(lb) >= 10
    worst = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
    assert worst < tol, f"per-step losses differ by {worst:.2e} (relative): {la} vs {lb}"
    assert max_rel_weights(a, b) < tol
    assert len(set(round(x, 6) for x in la)) > 1, "losses do not change: the check would be blind"


# --- ComfyUI's rules, reproduced from its source -------------------------------------------------------------
# comfy/utils.py `flux_to_diffusers`: diffusers Flux weight names -> BFL names (q/k/v are slices of one qkv).
# comfy/lora.py `model_lora_keys_unet`: for a Flux model every BFL weight `diffusion_model.<name>.weight` is
# reachable as `lora_unet_<name with . as _>`, and every diffusers weight name `<module>.weight` of
# flux_to_diffusers as `transformer.<module>`. comfy/lora.py `load_lora` + comfy/weight_adapter/lora.py
# `LoRAAdapter.load`: for each such prefix x it reads `x.alpha`, then `x.lora_up.weight` + `x.lora_down.weight`
# or `x.lora_B.weight` + `x.lora_A.weight`; every other key is logged as "lora key not loaded" and ignored.


def comfy_flux_to_diffusers(depth: int, depth_single: int) -> dict[str, str]:
    """{diffusers weight name: BFL weight name} as comfy/utils.py `flux_to_diffusers` lists them (LoRA-relevant
    `.weight` entries; biases and norm scales left out)."""
    out = {}
    for i in range(depth):
        d, b = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for q in ("to_q", "to_k", "to_v"):
            out[f"{d}.attn.{q}.weight"] = f"{b}.img_attn.qkv.weight"
        for q in ("add_q_proj", "add_k_proj", "add_v_proj"):
            out[f"{d}.attn.{q}.weight"] = f"{b}.txt_attn.qkv.weight"
        block_map = {
            "attn.to_out.0": "img_attn.proj",
            "norm1.linear": "img_mod.lin",
            "norm1_context.linear": "txt_mod.lin",
            "attn.to_add_out": "txt_attn.proj",
            "ff.net.0.proj": "img_mlp.0",
            "ff.net.2": "img_mlp.2",
            "ff_context.net.0.proj": "txt_mlp.0",
            "ff_context.net.2": "txt_mlp.2",
        }
        out.update({f"{d}.{k}.weight": f"{b}.{v}.weight" for k, v in block_map.items()})
    for i in range(depth_single):
        d, b = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        for q in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"):
            out[f"{d}.{q}.weight"] = f"{b}.linear1.weight"
        out[f"{d}.norm.linear.weight"] = f"{b}.modulation.lin.weight"
        out[f"{d}.proj_out.weight"] = f"{b}.linear2.weight"
    basic = {
        "proj_out": "final_layer.linear",
        "x_embedder": "img_in",
        "context_embedder": "txt_in",
        "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
        "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "norm_out.linear": "final_layer.adaLN_modulation.1",
    }
    out.update({f"{k}.weight": f"{v}.weight" for k, v in basic.items()})
    return out


def comfy_lora_prefixes(depth: int, depth_single: int) -> set[str]:
    mapping = comfy_flux_to_diffusers(depth, depth_single)
    diffusers = {f"transformer.{k[: -len('.weight')]}" for k in mapping}
    bfl = {"lora_unet_" + v[: -len(".weight")].replace(".", "_") for v in mapping.values()}
    return diffusers | bfl


def comfy_not_loaded(sd: dict, prefixes: set[str]) -> set[str]:
    loaded = set()
    for x in prefixes:
        if f"{x}.alpha" in sd:
            loaded.add(f"{x}.alpha")
        for up, down in (("lora_up", "lora_down"), ("lora_B", "lora_A")):
            if f"{x}.{up}.weight" in sd:
                loaded |= {f"{x}.{up}.weight", f"{x}.{down}.weight"}
                break
    return set(sd) - loaded
