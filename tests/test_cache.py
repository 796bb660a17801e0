"""The encoding cache: a damaged entry is recomputed, a cache that cannot be written is one line, and a cached
entry that breaks during training names its file."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from flux_cp import files
from flux_cp.config.training import DataConfig
from flux_cp.data.buckets import Geometry, training_buckets
from flux_cp.data.encode import encode_dataset
from flux_cp.data.sources import open_source
from flux_cp.errors import UsageError


class _Encoders:
    """Stands in for the VAE and text encoders: the cache logic only needs tensors of the right names."""

    text_keys = ("prompt_embeds", "pooled_prompt_embeds")

    def __init__(self):
        self.calls = 0

    def latents(self, pixels):
        self.calls += 1
        return pixels[:, :4, ::8, ::8].float(), torch.ones_like(pixels[:, :4, ::8, ::8]).float()

    def prompts(self, captions, max_len):
        self.calls += len(captions)
        n = len(captions)
        return {"prompt_embeds": torch.zeros(n, max_len, 8), "pooled_prompt_embeds": torch.zeros(n, 8)}

    def latent_shape(self, size):
        return (3, size[1] // 8, size[0] // 8)  # the RGB pixels, subsampled (latents above)

    def text_shapes(self, max_len):
        return {"prompt_embeds": (max_len, 8), "pooled_prompt_embeds": (8,)}


def _encode(cache, encoders, fingerprints=("v", "t")):
    data = DataConfig(resolution=64, max_sequence_length=8)
    source = open_source(data)
    return encode_dataset(
        source, encoders, Geometry(training_buckets(64, 1, False)), data, 0, cache, fingerprints, 0, 1
    )


def test_a_damaged_entry_is_recomputed_and_one_broken_later_names_its_file(tmp_path, caplog):
    first = _encode(tmp_path, _Encoders())
    captions = {s.caption for s in open_source(DataConfig()).samples}
    assert first.computed == 24 + len(captions)  # the bundled set's latents, and its distinct prompts
    latent = sorted((tmp_path / "latents").glob("*.safetensors"))[0]
    text = sorted((tmp_path / "text").glob("*.safetensors"))[0]
    latent.write_bytes(latent.read_bytes()[:40])  # truncated
    text.write_bytes(b"\x00" * 16)  # garbage
    again = _encode(tmp_path, _Encoders())
    assert again.computed == 2
    assert f"cache entry {latent} cannot be read" in caplog.text and "recomputing it" in caplog.text
    load_file(latent), load_file(text)
    text.unlink()  # gone after the start-up check: training names it
    index = next(i for i, e in enumerate(again.entries) if e["text"] == text.stem)
    with pytest.raises(UsageError, match=f"cache entry {text} cannot be read .*delete it and resume"):
        again.load(index, False, 0)


def test_a_cache_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    def full(path, tensors):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(files, "write_safetensors", full)
    with pytest.raises(UsageError) as e:
        _encode(tmp_path, _Encoders())
    message = str(e.value)
    assert message.startswith(f"cannot write the encoding cache under --encodings_dir {tmp_path} (")
    assert "\n" not in message
    assert message.endswith(
        "No space left on device. Free space there, choose another --encodings_dir, or pass --no_cache"
    )


def test_an_entry_of_the_right_names_but_another_shape_is_recomputed(tmp_path, caplog):
    """Written by another encoder or resolution under the same key (or damaged): it would fail only at step 1."""
    from safetensors.torch import save_file

    _encode(tmp_path, _Encoders())
    latent = sorted((tmp_path / "latents").glob("*.safetensors"))[0]
    text = sorted((tmp_path / "text").glob("*.safetensors"))[0]
    save_file({"latent_mean": torch.zeros(3, 4, 4), "latent_std": torch.zeros(3, 4, 4)}, latent)
    save_file({"prompt_embeds": torch.zeros(8, 16), "pooled_prompt_embeds": torch.zeros(8)}, text)
    again = _encode(tmp_path, _Encoders())
    assert again.computed == 2
    assert f"cache entry {latent} cannot be used (shape latent_mean [3, 4, 4] instead of [3, 8, 8]" in caplog.text
    assert "prompt_embeds [8, 16] instead of [8, 8]" in caplog.text
    assert load_file(latent)["latent_mean"].shape == (3, 8, 8) and load_file(text)["prompt_embeds"].shape == (8, 8)


def test_an_entry_of_another_dtype_is_recomputed_naming_it(tmp_path, caplog):
    """An entry's identity is its keys, shapes and dtypes: prompt embeddings cached in fp32 are not used by encoders
    that work in bf16 (nor latents that are not fp32)."""
    from safetensors.torch import save_file

    class Bf16(_Encoders):
        dtype = torch.bfloat16

        def prompts(self, captions, max_len):
            return {k: v.to(self.dtype) for k, v in super().prompts(captions, max_len).items()}

    _encode(tmp_path, _Encoders())  # text entries in fp32
    latent = sorted((tmp_path / "latents").glob("*.safetensors"))[0]
    save_file({k: v.half() for k, v in load_file(latent).items()}, latent)
    again = _encode(tmp_path, Bf16())
    texts = len(list((tmp_path / "text").glob("*.safetensors")))
    assert again.computed == 1 + texts
    expected = f"cache entry {latent} cannot be used (dtype latent_mean F16 instead of F32, dtype latent_std F16"
    assert expected in caplog.text
    assert "dtype prompt_embeds F32 instead of BF16" in caplog.text
    assert all(v.dtype == torch.bfloat16 for p in (tmp_path / "text").glob("*") for v in load_file(p).values())
    assert _encode(tmp_path, Bf16()).computed == 0


def _component(folder, weights: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, folder / "diffusion_pytorch_model.safetensors")


def test_a_component_is_known_by_its_config_and_the_content_of_its_weights(tmp_path):
    """Not by the path it was loaded from nor its files' times (a copied folder keeps its encodings and resumes), but
    weights saved again under the same names (a retrained text encoder) get another fingerprint; the hub cache's
    blob names are its files' content hashes. (The weights of the text encoders were not in it at all: they sit in
    a subfolder the fingerprint never listed.)"""
    import os
    import shutil

    from flux_cp.families.components import component_folder, model_fingerprint, weights_fingerprint

    weights = {"w": torch.arange(300_000, dtype=torch.float32)}
    _component(tmp_path / "a" / "vae", weights)
    copy = shutil.copytree(tmp_path / "a", tmp_path / "b")
    os.utime(copy / "vae" / "diffusion_pytorch_model.safetensors", (1, 1))
    first = weights_fingerprint(component_folder(str(tmp_path / "a"), "vae", None))
    assert first and weights_fingerprint(component_folder(str(copy), "vae", None)) == first
    weights["w"][150_000] += 1  # one value in the middle changed, the header the same
    _component(tmp_path / "a" / "vae", weights)
    assert weights_fingerprint(tmp_path / "a" / "vae") != first
    module = torch.nn.Linear(2, 2)
    module.config = {"_name_or_path": "/somewhere", "layers": 2}
    other = torch.nn.Linear(2, 2)
    other.config = {"_name_or_path": "/elsewhere", "layers": 2}
    assert model_fingerprint(module, copy / "vae") == model_fingerprint(other, copy / "vae")
    other.config["layers"] = 3
    assert model_fingerprint(module, copy / "vae") != model_fingerprint(other, copy / "vae")
    assert component_folder(str(tmp_path / "a"), "text_encoder", None) is None
    # the hub cache: snapshots/<commit>/<component>/<file> links to blobs/<content hash>
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "c0ffee" / "vae"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (blobs / "5ha256").write_bytes(b"x")
    (snap / "diffusion_pytorch_model.safetensors").symlink_to(blobs / "5ha256")
    (blobs / "0ther").write_bytes(b"x")
    linked = weights_fingerprint(snap)
    (snap / "diffusion_pytorch_model.safetensors").unlink()
    (snap / "diffusion_pytorch_model.safetensors").symlink_to(blobs / "0ther")
    assert weights_fingerprint(snap) != linked  # same bytes here, another content hash by name: the hub's word


def test_the_cache_keys_hold_the_vae_s_precision_the_tokenizers_and_the_weights_variant(tmp_path):
    """Latents are cached in fp32 whatever precision the VAE computed them in; a tokenizer gives the token ids the
    text encoders embed; --variant picks other weight files of the same folders. Each changed alone: what it made is
    computed again (the run's log line counts it), the rest reused."""
    from flux_cp.data.encode import encoder_fingerprints
    from flux_cp.families.components import files_fingerprint

    class Encoders(_Encoders):
        text_encoders = {"text_encoder": None}
        text_recipe = ""

        def __init__(self, dtype):
            super().__init__()
            self.dtype = dtype

    components = {"vae": "v", "text_encoder": "t"}
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "vocab.json").write_text('{"a": 0}')
    tokenizer = files_fingerprint(tmp_path / "tokenizer")
    cache = tmp_path / "cache"
    texts = len({s.caption for s in open_source(DataConfig()).samples})
    first = _encode(cache, _Encoders(), encoder_fingerprints(components, Encoders(torch.float32), tokenizer))
    assert first.computed == 24 + texts
    assert (
        _encode(cache, _Encoders(), encoder_fingerprints(components, Encoders(torch.float32), tokenizer)).computed == 0
    )
    bf16 = encoder_fingerprints(components, Encoders(torch.bfloat16), tokenizer)
    assert _encode(cache, _Encoders(), bf16).computed == 24  # latents of the VAE in bf16; the texts' key unchanged
    (tmp_path / "tokenizer" / "vocab.json").write_text('{"a": 1}')
    other = encoder_fingerprints(components, Encoders(torch.float32), files_fingerprint(tmp_path / "tokenizer"))
    assert _encode(cache, _Encoders(), other).computed == texts
    variant = encoder_fingerprints(components, Encoders(torch.float32), tokenizer, variant="fp16")
    assert _encode(cache, _Encoders(), variant).computed == 24 + texts
