"""The encoding phase on small GPUs: one component at a time on the accelerator (flux_cp.placement), text encoders
streamed from host memory encode bit for bit as resident ones, the VAE's tiles and what they change, the memory
estimates against what the CPU counts, the auto choices, the full-size presets (configs only) and the random
components `--transformer_init random` builds from them. Tiny models only; full sizes are built on the meta device."""

from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from flux_cp import tiny
from flux_cp.config.training import DataConfig, ModelConfig
from flux_cp.data.buckets import Geometry, training_buckets
from flux_cp.data.encode import encode_dataset
from flux_cp.data.sources import open_source
from flux_cp.errors import UsageError
from flux_cp.families import FLUX1, FLUX2, FLUX2_KLEIN
from flux_cp.families.components import load_part
from flux_cp.families.flux1.tiny import FLUX1_T5, FLUX1_VAE, ensure_tiny_pipeline
from flux_cp.model.loading import load_transformer
from flux_cp.placement import Placement
from flux_cp.plan import encoding as em
from flux_cp.random_weights import build_random, hashed_uniform_

CPU = torch.device("cpu")
FAKE_GPU = torch.device("cpu", 0)  # a device the host's tensors are not on: every move goes through `_copy`


class Watched(Placement):
    """A placement whose 'accelerator' copies are marked clones, so that a forward can tell which component's
    weights are on the accelerator on a machine without one."""

    def __init__(self, placement: Placement):
        super().__init__(placement.modules, FAKE_GPU)
        self.copies: list[torch.Tensor] = []  # kept alive: their storages stay theirs
        self.moves: dict[str, int] = {}

    def _to_device(self, name):
        self.moves[name] = self.moves.get(name, 0) + 1
        super()._to_device(name)

    def _copy(self, t, device):
        self.copies.append(t.clone())
        return self.copies[-1]

    def holds(self, module: torch.nn.Module) -> bool:
        ptrs = {c.data_ptr() for c in self.copies}
        return any(p.data_ptr() in ptrs for p in module.parameters())


def _watch(encoders) -> tuple[Watched, list[tuple[str, list[str]]]]:
    """Replace the encoders' placement by a watched one; record, at every forward of a component, which components'
    weights are on the accelerator."""
    watched = Watched(encoders.placement)
    encoders.placement = watched
    calls: list[tuple[str, list[str]]] = []
    for name, module in watched.modules.items():
        part = module.encoder if name == "vae" else module  # the VAE runs through vae.encode, not its forward
        part.register_forward_pre_hook(
            lambda m, a, name=name: calls.append((name, [n for n, x in watched.modules.items() if watched.holds(x)]))
        )
    return watched, calls


def test_each_encode_call_has_only_its_own_component_on_the_accelerator(tmp_path):
    folder = ensure_tiny_pipeline()
    encoders = FLUX1.load_encoders(ModelConfig(str(folder)), str(folder), torch.float32, FAKE_GPU)
    watched, calls = _watch(encoders)
    data = DataConfig(resolution=(64,), max_sequence_length=8)
    encode_dataset(open_source(data), encoders, Geometry(training_buckets(64, 1, False)), data, 0, tmp_path, ("v", "t"),
                   0, 1)  # fmt: skip
    FLUX1.validation_embeds(encoders, ["a red circle"], 8)
    assert {name for name, _ in calls} == {"vae", "text_encoder", "text_encoder_2"}
    assert all(on == [name] for name, on in calls), [c for c in calls if c[1] != [c[0]]][:3]
    # each component goes to the accelerator once for the data set (its captions fit one chunk), not once per image,
    # and each text encoder once more for the validation prompt
    assert watched.moves == {"vae": 1, "text_encoder": 2, "text_encoder_2": 2}
    encoders.free_text_encoders()
    watched.release()
    assert watched.on_device() == [] and not watched.holds(encoders.vae)


def test_release_keep_resident_and_streamed_components():
    modules = {"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)}
    p = Watched(Placement(modules, CPU))
    with p.use("a"):
        assert p.on_device() == ["a"] and p.holds(modules["a"])
    with p.use("b"):
        assert p.on_device() == ["b"] and not p.holds(modules["a"])
    before = modules["a"].weight.data_ptr()
    p.release()
    assert p.on_device() == [] and modules["a"].weight.data_ptr() == before  # the host tensors are back, no copy
    p.keep_resident()
    with p.use("a"):
        assert sorted(p.on_device()) == ["a", "b"]
    p.stream("b")
    assert p.where()["b"] == "streamed"


def _flux2_encoders(klein: bool):
    family = FLUX2_KLEIN if klein else FLUX2
    folder = family.embedded_default(pairs=False)
    return family.load_encoders(ModelConfig(folder), folder, torch.float32, CPU)


@pytest.mark.parametrize("family", ["flux1", "flux2", "flux2-klein"])
def test_streamed_text_encoders_encode_bit_for_bit_as_resident_ones(family):
    if family == "flux1":
        folder = str(ensure_tiny_pipeline())
        encoders = FLUX1.load_encoders(ModelConfig(folder), folder, torch.float32, CPU)
    else:
        encoders = _flux2_encoders(family == "flux2-klein")
    captions = ["a red circle", "two blue squares on a white background", ""]
    resident = encoders.prompts(captions, 32)
    for name in list(encoders.text_encoders):
        encoders.placement.stream(name)
        assert all(p.is_meta for p in encoders.text_encoders[name].parameters())  # its weights stay in host memory
    streamed = encoders.prompts(captions, 32)
    assert set(streamed) == set(resident)
    for key in resident:
        assert torch.equal(streamed[key], resident[key]), key


def tiny_vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    cfg = {**FLUX1_VAE, "block_out_channels": (8, 16, 16, 16), "layers_per_block": 1, "norm_num_groups": 4,
           "latent_channels": 4, "sample_size": 32}  # fmt: skip
    return AutoencoderKL(**cfg).eval()


def tiled_difference(size: int = 64, tile: int = 32) -> tuple[float, float]:
    """Largest absolute difference, and relative RMS difference, between tiled and whole latent means and decoded
    images of one random `size`^2 image, with the tiny VAE and tiles of `tile` pixels (docs/small_gpus.md)."""
    vae = tiny_vae()
    torch.manual_seed(1)
    x = torch.rand(1, 3, size, size) * 2 - 1
    with torch.no_grad():
        whole = vae.encode(x).latent_dist.mean
        image = vae.decode(whole).sample
        vae.use_tiling, vae.tile_sample_min_size, vae.tile_latent_min_size = True, tile, tile // 8
        tiled = vae.encode(x).latent_dist.mean
        tiled_image = vae.decode(whole).sample
    rel = lambda a, b: float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())  # noqa: E731
    return float((tiled - whole).abs().max()), rel(tiled, whole), rel(tiled_image, image)


def test_tiled_vae_results_differ_from_whole_ones_by_the_blend_only():
    # docs/small_gpus.md gives these figures (python -c "from tests.test_encoding_memory import tiled_difference as t;
    # print(t(64, 32), t(256, 128))"): the random tiny VAE normalizes each tile by its own statistics (GroupNorm), so
    # tiles change its results far more than a trained VAE's are expected to change
    for size, tile in ((64, 32), (256, 128)):
        max_abs, rel_latent, rel_image = tiled_difference(size, tile)
        assert 0.01 < rel_latent < 1.5 and 0.01 < rel_image < 1.5 and 0 < max_abs < 10


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of the tensors the ops inside it made that are alive at once."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.seen:
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key, n):
        self.seen.discard(key)
        self.live -= n


@pytest.mark.parametrize("decode", [False, True], ids=["encode", "decode"])
def test_the_vae_estimate_bounds_what_the_cpu_counts(decode):
    vae = tiny_vae()
    shape = em.vae_shape(vae)
    for size in (64, 128):
        x = torch.rand(1, 3, size, size)
        z = torch.rand(1, 4, size // 8, size // 8)
        with torch.no_grad(), LiveBytes() as live:
            vae.decode(z) if decode else vae.encode(x)
        planned = em.vae_activation_bytes(shape, size, size, 4, decode, tiled=False)
        assert live.peak <= planned <= 1.6 * live.peak, (size, live.peak, planned)


def test_the_t5_estimate_bounds_what_the_cpu_counts():
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    t5 = T5EncoderModel(T5Config(**{**FLUX1_T5, "vocab_size": 64, "d_model": 64, "d_ff": 160, "num_layers": 2,
                                    "num_heads": 4, "d_kv": 16})).eval()  # fmt: skip
    shape = em.text_encoder_shape(t5)
    ids = torch.randint(0, 64, (4, 128))
    with torch.no_grad(), LiveBytes() as live:
        t5(ids)
    planned = em.text_activation_bytes(shape, 4, 128, 4)
    assert live.peak <= planned <= 3 * live.peak, (live.peak, planned)


def test_auto_streams_only_what_does_not_fit_and_tiles_only_where_a_whole_image_does_not():
    t5 = em.TextEncoderShape("t5", 10 * em.GIB, em.GIB // 2, 4096, 10240, 64, 2, True)
    assert em.offload_choice("auto", t5, 16, 512, 2, 24 * em.GIB)[0] is False
    streamed, why = em.offload_choice("auto", t5, 16, 512, 2, 12 * em.GIB)
    assert streamed and "does not fit in 90% of 12.0 GiB" in why
    assert em.offload_choice("auto", t5, 16, 512, 2, None) == (False, "auto: no GPU memory to fit")
    assert em.offload_choice("on", t5, 1, 8, 2, None)[0] and not em.offload_choice("off", t5, 16, 512, 2, 1)[0]
    vae = em.VaeShape(160 * 2**20, 128, 1024)
    whole_4k = em.vae_peak_bytes(vae, 4096, 4096, 2, True, tiled=False)
    tiled_4k = em.vae_peak_bytes(vae, 4096, 4096, 2, True, tiled=True)
    assert whole_4k > 20 * em.GIB and tiled_4k < 3 * em.GIB
    assert em.tiling_choice("auto", vae, 4096, 4096, 2, True, 10 * em.GIB)[0]
    assert not em.tiling_choice("auto", vae, 1024, 1024, 2, True, 10 * em.GIB)[0]
    # at most one tile's size, tiling changes nothing: a whole pass
    assert em.vae_activation_bytes(vae, 1024, 1024, 2, False, True) == em.vae_activation_bytes(
        vae, 1024, 1024, 2, False, False
    )
    plan = em.encoding_plan({"text_encoder_2": t5}, vae, dtype_bytes=2, tokens=512, resolution=1024,
                            validation_resolution=4096, offload="auto", tiling="auto", gpu_bytes=12 * em.GIB,
                            decode_budget=2 * em.GIB, batch=16)  # fmt: skip
    assert plan.streamed == {"text_encoder_2": True} and plan.tiled_decode and not plan.tiled_encode
    assert plan.lines()[0].startswith("encoding phase: ") and "streamed from host memory" in plan.lines()[0]


@pytest.fixture(scope="module")
def full_flux1(tmp_path_factory):
    from flux_cp.families.flux1.tiny import write_flux1_dev_full_shapes

    return Path(write_flux1_dev_full_shapes(tmp_path_factory.mktemp("f") / "full"))


def test_the_full_shapes_preset_writes_every_component_s_config_at_full_size_and_no_weights(full_flux1, capsys,
                                                                                            tmp_path):  # fmt: skip
    files = [p for p in full_flux1.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix in (".safetensors", ".bin")]
    assert sum(p.stat().st_size for p in files) < 1 << 20
    t5 = json.loads((full_flux1 / "text_encoder_2" / "config.json").read_text())
    assert (t5["d_model"], t5["d_ff"], t5["num_layers"], t5["num_heads"], t5["d_kv"], t5["vocab_size"],
            t5["feed_forward_proj"]) == (4096, 10240, 24, 64, 64, 32128, "gated-gelu")  # fmt: skip
    clip = json.loads((full_flux1 / "text_encoder" / "config.json").read_text())
    assert (clip["hidden_size"], clip["num_hidden_layers"]) == (768, 12)
    vae = json.loads((full_flux1 / "vae" / "config.json").read_text())
    assert (vae["latent_channels"], vae["block_out_channels"], vae["scaling_factor"], vae["shift_factor"],
            vae["use_quant_conv"], vae["use_post_quant_conv"]) == (16, [128, 256, 512, 512], 0.3611, 0.1159, False,
                                                                  False)  # fmt: skip
    # the planner counts them on the meta device: T5-XXL's encoder is 4.9B parameters (9.1 GiB in bf16)
    from flux_cp.config.parser import parse_config
    from flux_cp.plan.report import print_plan

    print_plan(parse_config(["--plan", "--pretrained_model_name_or_path", str(full_flux1), "--gpu_memory_gib", "24",
                             "--validation_prompt", "x", "--validation_resolution", "4096",
                             "--output_dir", str(tmp_path / "o")]))  # fmt: skip
    out = capsys.readouterr().out
    assert "encoding phase: 11.5 GiB (T5 encoder (24 layers, d_model 4096), 16 captions x 512 tokens)" in out, out
    assert "validation decode: " in out and "(VAE, tiled;" in out


@pytest.mark.parametrize("preset", ["flux2-dev-full-shapes", "flux2-klein-full-shapes"])
def test_the_flux2_full_shapes_presets_name_their_full_text_encoders(preset, tmp_path, capsys):
    assert tiny.main(["--preset", preset, "--out", str(tmp_path / "m")]) == 0
    config = json.loads((tmp_path / "m" / "text_encoder" / "config.json").read_text())
    hidden = config["text_config"]["hidden_size"] if "text_config" in config else config["hidden_size"]
    joint = json.loads((tmp_path / "m" / "transformer" / "config.json").read_text())["joint_attention_dim"]
    assert 3 * hidden == joint
    assert not list((tmp_path / "m").rglob("*.safetensors"))


def _configs_only(tmp_path: Path) -> Path:
    """The tiny FLUX.1 folder without the text encoders' and VAE's weight files."""
    folder = tmp_path / "configs"
    shutil.copytree(ensure_tiny_pipeline(), folder)
    for name in ("text_encoder", "text_encoder_2", "vae"):
        for p in (folder / name).iterdir():
            if p.suffix in (".safetensors", ".bin"):
                p.unlink()
    return folder


def test_random_init_builds_what_has_no_weights_the_same_every_time(tmp_path):
    from transformers import T5EncoderModel

    folder = _configs_only(tmp_path)
    model = ModelConfig(str(folder), transformer_init="random")
    a = load_part(T5EncoderModel, str(folder), "text_encoder_2", model, torch.bfloat16)
    b = load_part(T5EncoderModel, str(folder), "text_encoder_2", model, torch.bfloat16)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.device == CPU and p.dtype == torch.bfloat16 and not p.is_meta and torch.equal(p, q), name
    w = a.encoder.block[0].layer[1].DenseReluDense.wo.weight
    assert w.abs().max() <= 1 / w.shape[1] ** 0.5 and w.std() > 0  # uniform in +-1/sqrt(fan in)
    encoders = FLUX1.load_encoders(model, str(folder), torch.float32, CPU)
    assert torch.isfinite(encoders.prompts(["a red circle"], 8)["prompt_embeds"]).all()
    with pytest.raises(UsageError, match="cannot load text_encoder_2"):  # pretrained: missing weights stay an error
        load_part(T5EncoderModel, str(folder), "text_encoder_2", ModelConfig(str(folder)), torch.float32)


def test_a_random_transformer_depends_on_the_seed_only_and_is_built_where_asked(tmp_path):
    from diffusers import FluxTransformer2DModel

    folder = _configs_only(tmp_path)
    model = ModelConfig(str(folder), transformer_init="random")
    a = load_transformer(model, str(folder), FluxTransformer2DModel, torch.bfloat16, CPU, seed=3)
    b = load_transformer(model, str(folder), FluxTransformer2DModel, torch.bfloat16, CPU, seed=3)
    c = load_transformer(model, str(folder), FluxTransformer2DModel, torch.bfloat16, CPU, seed=4)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.device == CPU and p.dtype == torch.bfloat16 and not p.is_meta and torch.equal(p, q), name
    w = a.transformer_blocks[0].attn.to_q.weight
    assert w.abs().max() <= 1 / w.shape[1] ** 0.5 and w.std() > 0
    assert not torch.equal(w, c.transformer_blocks[0].attn.to_q.weight)
    assert all(not t.is_meta for t in a.buffers())


def test_hashed_values_do_not_depend_on_how_they_are_chunked(monkeypatch):
    import flux_cp.random_weights as rw

    whole = hashed_uniform_(torch.empty(1000), 7, 0.5)
    monkeypatch.setattr(rw, "_CHUNK", 64)
    chunked = hashed_uniform_(torch.empty(1000), 7, 0.5)
    assert torch.equal(whole, chunked) and whole.abs().max() <= 0.5 and abs(float(whole.mean())) < 0.05
    assert not torch.equal(whole, hashed_uniform_(torch.empty(1000), 8, 0.5))


def test_a_random_component_keeps_its_buffers_and_ties():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=2, head_dim=8,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    model = build_random(Qwen3ForCausalLM, config, torch.float32, CPU, 0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(not b.is_meta for b in model.buffers())
    assert torch.isfinite(model(torch.arange(8)[None]).logits).all()
