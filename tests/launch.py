"""Run train_flux_cp.py as users do: `accelerate launch` for several processes, plain python for one; each process
forked from a server that imported the libraries once (tests/forkserver.py), where it can be."""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "train_flux_cp.py"
CPU_CONFIG = ROOT / "accelerate_configs" / "cpu_cp2.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FIXED_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
_SESSION_ENV = dict(os.environ)  # before any test sets a variable of its own: the fork server's environment


def env(**extra: str) -> dict:
    return {**os.environ, **FIXED_ENV, **extra}


FORKSERVER = ROOT / "tests" / "forkserver.py"
_server: dict = {}


def forkserver() -> str:
    """The socket of this test session's fork server (tests/forkserver.py), started at the first launch: the processes
    a test launches fork from it instead of importing torch and the libraries anew (and find it in TESTS_FORKSERVER,
    to fork theirs too). TESTS_NO_FORKSERVER=1: none (each process a new interpreter)."""
    if not _server and os.environ.get("TESTS_FORKSERVER"):  # a process a test started
        _server["path"] = os.environ["TESTS_FORKSERVER"]
    if not _server:
        folder = Path(tempfile.mkdtemp(prefix="flux_cp_forkserver_"))
        path = str(folder / "socket")
        log = open(folder / "server.log", "w")  # noqa: SIM115 - the server's for its lifetime
        proc = subprocess.Popen([sys.executable, str(FORKSERVER), "--serve", path, str(ROOT)], cwd=ROOT,
                                env={**_SESSION_ENV, **FIXED_ENV}, stdin=subprocess.PIPE, stdout=log,
                                stderr=log)  # fmt: skip
        _server.update(path=path, proc=proc)
        os.environ["TESTS_FORKSERVER"] = path

        @atexit.register
        def _stop() -> None:  # its standard input closes: it ends; what it forked runs on
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
            shutil.rmtree(folder, ignore_errors=True)

    return _server["path"]


def python_cmd(*args: str) -> list[str]:
    """`python ARGS` (a script or -m module and its arguments), forked by the fork server where it can."""
    if os.environ.get("TESTS_NO_FORKSERVER"):
        return [sys.executable, *args]
    return [sys.executable, str(FORKSERVER), forkserver(), *args]


def forked(cmd: list[str]) -> list[str]:
    """`cmd` forked by the fork server where it can be, when it runs this interpreter (`sys.executable ...`); the
    workers of an `accelerate launch` (of a script or `-m` module) too. Any other command as it is."""
    if cmd[:1] != [sys.executable]:
        return list(cmd)
    args = cmd[1:]
    if args[:2] == ["-m", "accelerate.commands.launch"]:
        i = next(i for i, a in enumerate(args) if i > 1 and (a == "-m" or a.endswith(".py")))
        n = 2 if args[i] == "-m" else 1
        args = [*args[:i], *python_cmd(*args[i : i + n])[1:], *args[i + n :]]
    return python_cmd(*args)


def worker_args(script: Path) -> list[str]:
    """What to give a launcher (accelerate launch, torchrun) as its training script for `script`: it runs
    `python -u WORKER_ARGS ARGS` on each process, forked by the fork server where it can be."""
    return python_cmd(str(script))[1:]


def launch_cmd(nproc: int, *args: str, launcher: tuple[str, ...] = (), script: Path = SCRIPT) -> list[str]:
    """`accelerate launch` of train_flux_cp.py (or another `script` that runs its `main`) with the CPU config (plain
    python for one process). The launcher and its workers are forked by the fork server where they can be."""
    if nproc == 1 and not launcher:
        return python_cmd(str(script), *args)
    port = () if "--main_process_port" in launcher else ("--main_process_port", str(free_port()))
    return python_cmd("-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG), "--num_processes",
                      str(nproc), *port, *launcher, *worker_args(script), *args)  # fmt: skip


def train(nproc: int, *args: str, timeout: float = 600, extra_env: dict | None = None,
          script: Path = SCRIPT) -> subprocess.CompletedProcess:  # fmt: skip
    return subprocess.run(launch_cmd(nproc, *args, script=script), cwd=ROOT, env=env(**(extra_env or {})),
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


_STDERR = io.StringIO()  # one for every call: loggers set up by an earlier call keep writing to it


def in_process(argv: list[str]) -> tuple[int, str]:
    """The trainer's entry point as `python train_flux_cp.py` runs it, in this process (a second or two instead
    of the ~8 s of a new interpreter importing torch, diffusers and transformers): (exit code, stderr)."""
    import train_flux_cp
    from flux_cp.run import runner

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
    at zero, so their norm is the training update itself; a LoKr's w1 likewise). Per-element comparison would measure
    Adam's normalisation of near-zero gradient elements, whose fp32 summation-order noise it scales up to the step
    size."""
    import torch
    from safetensors.torch import load_file

    wa, wb = (load_file(Path(r) / "pytorch_lora_weights.safetensors") for r in (a, b))
    assert wa.keys() == wb.keys() and len(wa) > 0

    def flat(w: dict, part: str) -> torch.Tensor:
        return torch.cat([w[k].flatten().double() for k in sorted(w) if part in k])

    zero_start = "lora_B" if any("lora_B" in k for k in wb) else "lokr_w1"
    return max(((flat(wa, p) - flat(wb, p)).norm() / flat(wb, p).norm()).item() for p in ("", zero_start))


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


# flux_to_diffusers' top-level layers (diffusers name -> BFL name), common to both of its readings below.
_COMFY_FLUX_TOP_LEVEL = {
    "proj_out": "final_layer.linear",
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
}


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
    basic = {**_COMFY_FLUX_TOP_LEVEL, "norm_out.linear": "final_layer.adaLN_modulation.1"}
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


# --- ComfyUI's rules for FLUX.2 ---------------------------------------------------------------------------------
# Read at ComfyUI's (Comfy-Org/ComfyUI) comfy/lora.py 17358c8f, comfy/utils.py 09708eae, comfy/model_detection.py
# 0b61ce5b, comfy/model_base.py 26adb81a, comfy/weight_adapter/lora.py 6f98b150, comfy/lora_convert.py 2bffe2f4:
# - comfy/model_base.py: `class Flux2(Flux)`, so model_lora_keys_unet's Flux branch maps FLUX.2 too, through the
#   same comfy/utils.py `flux_to_diffusers`, which lists FLUX.2's diffusers names beside FLUX.1's (`ff.linear_in`,
#   `attn.to_qkv_mlp_proj`, `attn.to_out`, ...) and nothing for FLUX.2's shared modulations or its
#   `time_guidance_embed`; q/k/v are slices of the fused qkv (`hidden_size` rows each, from the checkpoint's img_in).
# - comfy/model_detection.py (flux2: `double_stream_modulation_img.lin.weight` present) and the Flux model of
#   comfy/ldm/flux: global modulation (`double_stream_modulation_img/txt.lin`, `single_stream_modulation.lin`, none
#   per block), gated-SiLU MLPs (`img_mlp.0` is 2 x mlp wide), no biases: the BFL names `comfy_flux2_weights` lists.
# - comfy/lora.py `model_lora_keys_unet`: every model weight `diffusion_model.<name>.weight` is reachable as
#   `lora_unet_<name, . as _>` and `diffusion_model.<name>`; every flux_to_diffusers name `<module>.weight` as
#   `transformer.<module>`, `lycoris_<module, . as _>`, `lora_transformer_<...>` and `<module>`; every
#   `<...>.linear1.weight` also as `<...>.linear1_qkv` (its first 3 x hidden rows).
# - comfy/lora.py `load_lora` + weight_adapter/lora.py `LoRAAdapter`: for each such prefix x, `x.alpha`, then
#   `x.lora_up/lora_down.weight` or `x.lora_B/lora_A.weight`; the patch adds (alpha / rank if alpha else 1) * up @
#   down to the target (its slice), reshaped to the target's shape (an error otherwise). Every other key: "lora key
#   not loaded". comfy/sd.py `load_lora_for_models`: a patch whose target the model lacks: "NOT LOADED".
# - comfy/lora_convert.py `convert_lora` rewrites only files it recognises by keys ours never have (BFL control
#   LoRAs, Wan Fun, USO, Krea2's fused `attn.to_qkv`): `comfy_convert_lora_leaves` checks that.


def comfy_flux2_weights(config: dict) -> dict[str, tuple[int, ...]]:
    """{weight name: shape} of a FLUX.2 checkpoint in BFL's layout, the one ComfyUI's FLUX.2 model loads as it is
    (its names without `diffusion_model.`), for a diffusers `Flux2Transformer2DModel` config: the linear weights,
    and the q/k norm scales (no LoRA goes there; diffusers' checkpoint converter wants them)."""
    h = config["num_attention_heads"] * config["attention_head_dim"]
    m, d = int(h * config["mlp_ratio"]), config["attention_head_dim"]
    io = config["in_channels"] * config.get("patch_size", 1) ** 2
    out = {"img_in.weight": (h, io), "txt_in.weight": (h, config["joint_attention_dim"])}
    embedders = ["time_in"] + (["guidance_in"] if config.get("guidance_embeds", True) else [])
    for e in embedders:
        out[f"{e}.in_layer.weight"] = (h, config.get("timestep_guidance_channels", 256))
        out[f"{e}.out_layer.weight"] = (h, h)
    out["double_stream_modulation_img.lin.weight"] = out["double_stream_modulation_txt.lin.weight"] = (6 * h, h)
    out["single_stream_modulation.lin.weight"] = (3 * h, h)
    for i in range(config["num_layers"]):
        for s in ("img", "txt"):
            b = f"double_blocks.{i}.{s}"
            out.update({f"{b}_attn.qkv.weight": (3 * h, h), f"{b}_attn.proj.weight": (h, h),
                        f"{b}_attn.norm.query_norm.scale": (d,), f"{b}_attn.norm.key_norm.scale": (d,),
                        f"{b}_mlp.0.weight": (2 * m, h), f"{b}_mlp.2.weight": (h, m)})  # fmt: skip
    for i in range(config["num_single_layers"]):
        b = f"single_blocks.{i}"
        out.update({f"{b}.linear1.weight": (3 * h + 2 * m, h), f"{b}.linear2.weight": (h, h + m),
                    f"{b}.norm.query_norm.scale": (d,), f"{b}.norm.key_norm.scale": (d,)})  # fmt: skip
    out["final_layer.linear.weight"] = (config.get("out_channels") or config["in_channels"], h)
    out["final_layer.adaLN_modulation.1.weight"] = (2 * h, h)
    return out


Target = tuple  # (model weight, (start, length) of its rows or None, "swap_scale_shift" or None)


def comfy_flux_to_diffusers_targets(depth: int, depth_single: int, hidden: int) -> dict[str, Target]:
    """{diffusers weight name: target} as comfy/utils.py `flux_to_diffusers` lists them, FLUX.1's and FLUX.2's
    names alike (`.weight` entries of linear layers; biases and norm scales left out)."""
    out: dict[str, Target] = {}

    def qkv(d: str, names: tuple[str, ...], fused: str) -> None:
        for n, name in enumerate(names):
            out[f"{d}.{name}.weight"] = (fused, (n * hidden, hidden), None)

    for i in range(depth):
        d, b = f"transformer_blocks.{i}", f"double_blocks.{i}"
        qkv(d, ("attn.to_q", "attn.to_k", "attn.to_v"), f"{b}.img_attn.qkv.weight")
        qkv(d, ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), f"{b}.txt_attn.qkv.weight")
        block_map = {
            "attn.to_out.0": "img_attn.proj", "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
            "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
            "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2", "ff.linear_in": "img_mlp.0",
            "ff.linear_out": "img_mlp.2", "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2",
        }  # fmt: skip
        out.update({f"{d}.{k}.weight": (f"{b}.{v}.weight", None, None) for k, v in block_map.items()})
    for i in range(depth_single):
        d, b = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        qkv(d, ("attn.to_q", "attn.to_k", "attn.to_v"), f"{b}.linear1.weight")
        out[f"{d}.proj_mlp.weight"] = (f"{b}.linear1.weight", (3 * hidden, 4 * hidden), None)
        block_map = {"norm.linear": "modulation.lin", "proj_out": "linear2", "attn.to_qkv_mlp_proj": "linear1",
                     "attn.to_out": "linear2"}  # fmt: skip
        out.update({f"{d}.{k}.weight": (f"{b}.{v}.weight", None, None) for k, v in block_map.items()})
    basic = {**_COMFY_FLUX_TOP_LEVEL, "controlnet_x_embedder": "pos_embed_input"}
    out.update({f"{k}.weight": (f"{v}.weight", None, None) for k, v in basic.items()})
    out["norm_out.linear.weight"] = ("final_layer.adaLN_modulation.1.weight", None, "swap_scale_shift")
    return out


def comfy_flux2_key_map(config: dict) -> dict[str, Target]:
    """{LoRA key prefix: target} of comfy/lora.py `model_lora_keys_unet` for ComfyUI's FLUX.2 model of `config`
    (targets without the `diffusion_model.` prefix)."""
    weights = comfy_flux2_weights(config)
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    key_map: dict[str, Target] = {}
    for k in weights:
        if k.endswith(".weight"):
            key_map["lora_unet_" + k[: -len(".weight")].replace(".", "_")] = (k, None, None)
            key_map["diffusion_model." + k[: -len(".weight")]] = (k, None, None)
    for k, target in comfy_flux_to_diffusers_targets(config["num_layers"], config["num_single_layers"], hidden).items():
        base = k[: -len(".weight")]
        for prefix in (f"transformer.{base}", "lycoris_" + base.replace(".", "_"),
                       "lora_transformer_" + base.replace(".", "_"), base):  # fmt: skip
            key_map[prefix] = target
    for k in weights:
        if k.endswith(".linear1.weight"):
            key_map["diffusion_model." + k.replace(".linear1.weight", ".linear1_qkv")] = (k, (0, 3 * hidden), None)
    return key_map


def comfy_convert_lora_leaves(sd: dict) -> bool:
    """comfy/lora_convert.py `convert_lora` returns the file's keys as they are (it recognises none of its
    formats in them)."""
    import re

    keys = set(sd)
    bfl_control = "img_in.lora_A.weight" in keys and "single_blocks.0.norm.key_norm.scale" in keys
    wan_fun = "lora_unet__blocks_0_cross_attn_k.lora_down.weight" in keys
    uso = "single_blocks.37.processor.qkv_lora.up.weight" in keys
    fused = re.compile(r"(.*attn[._]to_)qkv(?=\.|$)")
    krea2 = any(fused.search(k) and ("text_fusion" in k or "transformer_blocks" in k) for k in keys)
    return not (bfl_control or wan_fun or uso or krea2)


# comfy/weight_adapter/lokr.py (Comfy-Org/ComfyUI 2bffe2f4): `LoKrAdapter.load` reads these keys under each prefix of
# the key map (and `<x>.alpha`); `calculate_weight` builds w1 (or w1_a @ w1_b) and w2 (or w2_a @ w2_b), scales
# kron(w1, w2) by alpha / dim where an alpha is given and a factor is factored (dim: that factor's rank), else by 1,
# and adds it to the target (its slice) reshaped to its shape.
COMFY_LOKR_KEYS = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


def comfy_lokr_diff(lokr: dict, alpha=None):
    """The weight update ComfyUI's LoKr adapter computes from a module's `lokr_*` tensors (float64)."""
    import torch

    dim = None
    if "lokr_w1" in lokr:
        w1 = lokr["lokr_w1"].double()
    else:
        dim, w1 = lokr["lokr_w1_b"].shape[0], lokr["lokr_w1_a"].double() @ lokr["lokr_w1_b"].double()
    if "lokr_w2" in lokr:
        w2 = lokr["lokr_w2"].double()
    else:
        dim, w2 = lokr["lokr_w2_b"].shape[0], lokr["lokr_w2_a"].double() @ lokr["lokr_w2_b"].double()
    scale = alpha.item() / dim if alpha is not None and dim is not None else 1.0
    return torch.kron(w1, w2) * scale


def comfy_apply(sd: dict, key_map: dict[str, Target], model: dict) -> tuple[set[str], set[str], dict]:
    """What ComfyUI's LoRA loader does with the LoRA state dict `sd` on a model whose weights are `model` ({name:
    tensor}, BFL names): (keys it does not load, patches whose target the model lacks, the patched weights).
    A patch whose up @ down cannot take its target's shape raises, where ComfyUI logs an error and skips it."""
    import torch

    loaded, patches = set(), {}
    for x, target in key_map.items():
        alpha = sd.get(f"{x}.alpha")
        if alpha is not None:
            loaded.add(f"{x}.alpha")
        for up, down in (("lora_up", "lora_down"), ("lora_B", "lora_A")):
            if f"{x}.{up}.weight" in sd:
                loaded |= {f"{x}.{up}.weight", f"{x}.{down}.weight"}
                down_ = sd[f"{x}.{down}.weight"]
                scale = alpha.item() / down_.shape[0] if alpha is not None else 1.0
                patches[target] = (sd[f"{x}.{up}.weight"].double() @ down_.double()) * scale
                break
        else:  # comfy/weight_adapter/lokr.py `LoKrAdapter`: the keys it reads, the product it applies
            lokr = {s: sd[f"{x}.{s}"] for s in COMFY_LOKR_KEYS if f"{x}.{s}" in sd}
            if lokr:
                loaded |= {f"{x}.{s}" for s in lokr}
                patches[target] = comfy_lokr_diff(lokr, alpha)
    out = {k: v.clone() for k, v in model.items()}
    missing = set()
    for (name, rows, function), diff in patches.items():
        if name not in out:
            missing.add(name)
            continue
        weight = out[name] if rows is None else out[name].narrow(0, *rows)
        diff = diff.reshape(weight.shape)
        if function == "swap_scale_shift":
            shift, scale_ = diff.chunk(2, dim=0)
            diff = torch.cat([scale_, shift], dim=0)
        weight += diff.to(weight.dtype)
    return set(sd) - loaded, missing, out
