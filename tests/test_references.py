"""Several reference images per target (FLUX.2): metadata.jsonl lists and hub list columns with the checks every
path gets, the encoding cache and the live path holding each reference with its target's crop, batches that never
mix reference counts, the token counts CP splits, the step's input against Flux2Pipeline's own layout of two
references, the loss on the target tokens only (also over CP chunks of 2 and 3), and a resume that names a changed
second reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline

import cp.comm
from flux_cp.config.flags import ValidationConfig
from flux_cp.config.parser import parse_config
from flux_cp.config.training import DataConfig, ModelConfig, TrainConfig
from flux_cp.data.batches import Batches
from flux_cp.data.buckets import Geometry, crop_box
from flux_cp.data.encode import LiveData, encode_dataset, reference_key
from flux_cp.data.flow import per_sample_draws
from flux_cp.data.folders import read_metadata_file
from flux_cp.data.schedule import BatchSchedule, batch_groups
from flux_cp.data.sources import check_reference_limit, open_source
from flux_cp.errors import UsageError
from flux_cp.families import FLUX1, FLUX2
from flux_cp.images import to_pixels
from flux_cp.layout import Layout
from flux_cp.loss import batch_loss
from flux_cp.outputs import resume
from flux_cp.rng import Stream, generator
from flux_cp.shape.build import build_shape
from flux_cp.shape.run_shape import check_tokens
from tests.flux2_recipe_steps import flow_loss
from tests.reference_folders import PAIRS, references_folder, rows_of_pairs

CPU = torch.device("cpu")


# --- listing ------------------------------------------------------------------------------------------------------


def test_a_metadata_list_names_each_targets_references_in_order_and_each_enters_the_identity(tmp_path):
    folder = references_folder(tmp_path / "d", n=3)
    source = open_source(DataConfig(dataset_name=str(folder)))
    assert source.pairs and source.reference_counts() == {2: 0}
    rows = rows_of_pairs(3)
    for i, s in enumerate(source.samples):
        assert s.references == (str(folder / rows[i]["reference_file_name"]), str(folder / f"second_{i}.png"))
        assert s.reference == s.references[0]
    assert source.raw_bytes(1, reference=True, ref_index=1) == (folder / "second_1.png").read_bytes()
    identity = source.identity()
    assert identity.files[1][3::2] == [rows[1]["reference_file_name"], "second_1.png"]
    assert len(identity.files[1]) == 3 + 2 * 2
    # a one-element list is the same data set as the plain name (the identity of one-reference runs is unchanged)
    single = tmp_path / "single"
    shutil.copytree(folder, single)
    (single / "metadata.jsonl").write_text("".join(
        json.dumps({**r, "reference_file_name": r["reference_file_name"][0]}) + "\n"
        for r in map(json.loads, (folder / "metadata.jsonl").read_text().splitlines())
    ))  # fmt: skip
    listed = tmp_path / "listed"
    shutil.copytree(single, listed)
    text = (single / "metadata.jsonl").read_text().replace('"reference_file_name": "', '"reference_file_name": ["')
    (listed / "metadata.jsonl").write_text(text.replace('.png", "text"', '.png"], "text"'))
    one = [open_source(DataConfig(dataset_name=str(f))) for f in (single, listed)]
    assert [len(o.samples[0].references) for o in one] == [1, 1]
    assert one[0].identity().files == one[1].identity().files


@pytest.mark.parametrize(
    "value, message",
    [
        ([], "line 2: reference_file_name is an empty list: name one or more images"),
        (["01_green_square.png", 3], "line 2: reference_file_name[1] is 3, not a path relative to"),
        (["01_green_square.png", None], "line 2: reference_file_name[1] is null, not a path relative to"),
        (["01_green_square.png", "../x.png"], "line 2: reference_file_name[1] '../x.png' must be a path inside"),
        (["01_green_square.png", "/etc/hosts"], "line 2: reference_file_name[1] '/etc/hosts' must be a path inside"),
        (["01_green_square.png", "gone.png"], "line 2: reference_file_name[1] 'gone.png' does not exist in"),
        (["01_green_square.png", "./01_green_square.png"], "line 2: reference_file_name names './01_green_square"),
    ],
    ids=["empty", "number", "null", "climbs-out", "absolute", "missing", "twice"],
)
def test_every_path_of_a_reference_list_is_checked_with_its_line(tmp_path, value, message):
    folder = references_folder(tmp_path / "d", n=2)
    rows = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]
    rows[1]["reference_file_name"] = value
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UsageError) as e:
        read_metadata_file(folder)
    assert message in str(e.value) and "\n" not in str(e.value)


def _hub(monkeypatch, references: list) -> None:
    import datasets

    files = sorted(str(p) for p in PAIRS.glob("*_edited.png"))[: len(references)]
    table = {"image": files, "refs": references, "text": [f"edit {i}" for i in range(len(files))]}
    ds = datasets.Dataset.from_dict(table).cast_column("image", datasets.Image())
    ds = ds.cast_column("refs", datasets.List(datasets.Image()))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: ds)


def test_a_hub_column_of_image_lists_gives_each_row_its_references(monkeypatch):
    refs = sorted(str(p) for p in PAIRS.glob("*.png") if "_edited" not in p.name)
    _hub(monkeypatch, [[refs[0]], [refs[1], refs[2]], [refs[3], refs[4]]])
    source = open_source(DataConfig(dataset_name="someone/edits", cond_image_column="refs"))
    assert source.reference_counts() == {1: 0, 2: 1}
    assert source.raw_bytes(1, reference=True, ref_index=1) == Path(refs[2]).read_bytes()
    assert source.where(1, reference=True, ref_index=1) == "someone/edits row 1 column 'refs' item 2"
    assert source.identity().files[1][3::2] == ["row 1 refs[0]", "row 1 refs[1]"]
    _hub(monkeypatch, [[refs[0]], [], [refs[3]]])
    with pytest.raises(UsageError, match=r"^someone/edits row 1 has an empty list in --cond_image_column 'refs' "):
        open_source(DataConfig(dataset_name="someone/edits", cond_image_column="refs"))


def test_flux1_kontext_refuses_several_references_and_flux2_takes_them(tmp_path):
    folder = references_folder(tmp_path / "d", n=2, counts=[1, 2])
    meta = read_metadata_file(folder)
    validation = ValidationConfig(validation_prompt=("red",), validation_image=("a.png", "b.png"))
    source = open_source(DataConfig(dataset_name=str(folder)))
    check_reference_limit(FLUX2.max_references, FLUX2.pairs_label, validation, meta, "reference")
    check_reference_limit(FLUX2.max_references, FLUX2.pairs_label, validation, source=source)

    def kontext(**kw) -> None:
        check_reference_limit(FLUX1.max_references, FLUX1.pairs_label, **kw)

    with pytest.raises(UsageError, match=r"^--validation_image is given 2 times, but FLUX.1 Kontext edits one"):
        kontext(validation=validation)
    with pytest.raises(UsageError, match=r"line 2 \(reference_file_name\) names 2 reference images, but FLUX.1"):
        kontext(validation=ValidationConfig(), meta=meta, column="reference")
    with pytest.raises(UsageError, match=r"01_yellow_square_edited.png names 2 reference images, but FLUX.1 Kontext"):
        kontext(validation=ValidationConfig(), source=source)


# --- batches and token counts -----------------------------------------------------------------------------------


def test_batches_group_by_bucket_and_reference_count_and_one_count_keeps_the_order_of_before():
    buckets = [0, 1, 0, 1, 0, 0, 1, 1, 0, 1, 0, 1]
    assert batch_groups(buckets, [2] * 12) == buckets  # one count: the bucket alone, as before
    counts = [1, 1, 2, 2, 1, 2, 1, 2, 2, 1, 1, 2]
    groups = batch_groups(buckets, counts)
    schedule = BatchSchedule(groups, 2, seed=5)
    for epoch in range(3):
        batches = schedule.epoch(epoch)
        assert len(batches) == 4  # one of 2 from each (bucket, count) group of 3
        for batch in batches:
            assert len({(buckets[i], counts[i]) for i in batch}) == 1, batch
    assert schedule.unfilled() == {}
    # two samples with 2 references never fill a batch of 3: the trainer warns that they never train
    assert BatchSchedule(batch_groups([0] * 5, [1, 1, 1, 2, 2]), 3, seed=5).unfilled() == {2: 2}


@pytest.fixture
def token_check(tmp_path):
    def check(counts: list[int], *flags: str) -> None:
        folder = references_folder(tmp_path / "-".join(map(str, counts)), n=len(counts), counts=counts)
        cfg = parse_config(["--dataset_name", str(folder), "--max_sequence_length", "66", *flags])
        check_tokens(build_shape(cfg, cfg.parallel.cp_size), cfg.data, cfg.validation)

    return check


def test_cp_must_divide_the_target_and_all_references_together(token_check):
    token_check([2, 2], "--resolution", "64", "--cp_size", "3")  # 3 x 16 tokens
    with pytest.raises(UsageError, match="--resolution 64 gives 32 image tokens per pair, not divisible by --cp_"):
        token_check([1, 1], "--resolution", "64", "--cp_size", "3")
    with pytest.raises(UsageError, match="--resolution 64 gives 32 image tokens per pair, not divisible by --cp_"):
        token_check([1, 2], "--resolution", "64", "--cp_size", "3")  # a batch of each count runs
    with pytest.raises(UsageError, match="--resolution 48 gives 27 image tokens per target with 2 references, not"):
        token_check([2, 2], "--resolution", "48", "--cp_size", "2")
    token_check([1, 2], "--resolution", "128", "--cp_size", "3", "--aspect_buckets")  # every bucket divides
    edit = ["--validation_prompt", "red", "--validation_image", str(PAIRS / "00_blue_circle.png")]
    token_check([2, 2], "--resolution", "64", "--cp_size", "3", *edit, "--validation_image", edit[-1])
    with pytest.raises(UsageError, match="--validation_resolution 64 gives 32 image tokens per pair"):
        token_check([2, 2], "--resolution", "64", "--cp_size", "3", *edit)


# --- cache and live encodings ------------------------------------------------------------------------------------


class _Encoders:
    """Stands in for the VAE and text encoders: latents are the pixels, subsampled (so each can be checked)."""

    def __init__(self):
        self.calls = 0

    def latents(self, pixels):
        self.calls += 1
        return pixels[:, :, ::8, ::8].float(), torch.ones_like(pixels[:, :, ::8, ::8]).float()

    def prompts(self, captions, max_len):
        return {"prompt_embeds": torch.zeros(len(captions), max_len, 8)}

    def latent_shape(self, size):
        return (3, size[1] // 8, size[0] // 8)

    def text_shapes(self, max_len):
        return {"prompt_embeds": (max_len, 8)}


def test_each_reference_is_cached_with_its_targets_crop_and_a_changed_second_reference_is_recomputed(tmp_path):
    folder = references_folder(tmp_path / "d", n=3)
    data = DataConfig(dataset_name=str(folder), resolution=64, max_sequence_length=8, random_flip=True)
    geometry = Geometry([(64, 64)])

    def encode(source):
        return encode_dataset(source, _Encoders(), geometry, data, 0, tmp_path / "cache", ("v", "t"), 0, 1)

    source = open_source(data)
    encoded = encode(source)
    assert encoded.computed == 3 * 3 * 2 + 3  # target and two references, both flips; three captions
    for flip in (False, True):
        sample = encoded.load(2, flip, 0)
        img = source.load(2)
        resized, offset = crop_box(img.size, (64, 64), False, generator(Stream.CROP, 0, 2))
        for j in range(2):
            pixels = to_pixels(source.load(2, reference=True, ref_index=j), (64, 64), resized, offset, flip)
            assert torch.equal(sample[reference_key(j)], pixels[:, ::8, ::8]), (flip, j)
        assert not torch.equal(sample["reference_latent"], sample["reference_latent_2"])
        live = LiveData(source, _Encoders(), geometry, data, 0).load(2, flip, 0)  # per-epoch crops: another draw
        assert set(live) == set(sample)
    before = source.identity()
    (folder / "second_1.png").write_bytes((PAIRS / "04_red_square.png").read_bytes())
    source = open_source(data)
    again = encode(source)
    assert again.computed == 2  # the changed image's two flips, nothing else
    after = source.identity()
    assert before.fingerprint != after.fingerprint
    # a resume from a checkpoint of the first data set names the file
    ckpt = tmp_path / "checkpoint-5"
    ckpt.mkdir()
    (ckpt / "data.json").write_text(json.dumps({"data_files": before.files}))
    meta = {"run": {"data": before.fingerprint, "data_legacy": before.legacy}}
    with pytest.raises(UsageError) as e:
        resume.check_compatible(meta, {"data": after.fingerprint, "data_files": after.files}, ckpt)
    changed = "changed reference image: second_1.png (reference 2 of 01_yellow_square_edited.png)"
    assert f"data set differs ({changed})" in str(e.value)


def test_live_encodings_hold_every_reference_with_the_targets_crop(tmp_path):
    folder = references_folder(tmp_path / "d", n=2, counts=[1, 3])
    data = DataConfig(dataset_name=str(folder), resolution=64, max_sequence_length=8, center_crop=True)
    source = open_source(data)
    live = LiveData(source, _Encoders(), Geometry([(64, 64)]), data, 0)
    cached = encode_dataset(source, _Encoders(), Geometry([(64, 64)]), data, 0, tmp_path / "c", ("v", "t"), 0, 1)
    for i, count in enumerate((1, 3)):
        a, b = live.load(i, False, 3), cached.load(i, False, 0)
        assert set(a) == set(b) == {"latent_mean", "latent_std", "prompt_embeds",
                                    *(reference_key(j) for j in range(count))}  # fmt: skip
        assert all(torch.equal(a[k], b[k]) for k in a)


# --- the step against Flux2Pipeline ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dev():
    """The tiny FLUX.2 [dev] (the family's embedded default, built under the test session's FLUX_CP_HOME), its
    encoders and its pipeline."""
    folder = Path(FLUX2.embedded_default(pairs=False))
    encoders = FLUX2.load_encoders(ModelConfig(str(folder)), str(folder), torch.float32, CPU)
    return encoders, Flux2Pipeline.from_pretrained(folder)


class RefData:
    """A TrainingData of encoded images with two references each, as the cache holds them."""

    def __init__(self, enc, pixels, refs, embeds):
        mean, std = enc.latents(pixels)
        ref_means = [enc.latents(r)[0] for r in refs]
        self.samples = [{"latent_mean": mean[i], "latent_std": std[i], "prompt_embeds": embeds[i],
                         **{reference_key(j): m[i] for j, m in enumerate(ref_means)}}
                        for i in range(len(pixels))]  # fmt: skip
        self.buckets = [0] * len(pixels)

    def load(self, index: int, flip: bool, epoch: int) -> dict:
        return dict(self.samples[index])


def _batches(data, scheduler, vae, cp_size: int = 1, cp_rank: int = 0, group=None):
    train = TrainConfig(train_batch_size=2, seed=3)
    layout = Layout(cp_size, cp_rank, cp_size, 1, 0, cp_rank, group)
    schedule = BatchSchedule(data.buckets, 2, seed=3)
    return Batches(data, schedule, layout, DataConfig(), train, scheduler, FLUX2, FLUX2.normalizer(vae), True, CPU)


def _two_reference_batch(dev):
    enc, pipe = dev
    g = torch.Generator().manual_seed(7)
    pixels = torch.rand(2, 3, 64, 64, generator=g) * 2 - 1
    refs = [torch.rand(2, 3, 64, 64, generator=g) * 2 - 1 for _ in range(2)]
    data = RefData(enc, pixels, refs, torch.randn(2, 6, pipe.transformer.config.joint_attention_dim, generator=g))
    return data, pixels, refs


def test_the_steps_input_is_flux2_pipelines_layout_of_two_references(dev):
    """[noisy target; reference 1; reference 2], reference j at time id 10 + 10 j, each reference's tokens as
    Flux2Pipeline.prepare_image_latents encodes the image (mode, patchify, batch-norm statistics, pack), the ids as
    Flux2Pipeline._prepare_latent_ids and _prepare_image_ids give them."""
    enc, pipe = dev
    data, pixels, refs = _two_reference_batch(dev)
    mb = _batches(data, pipe.scheduler, enc.vae).micro(0)
    _, order = BatchSchedule(data.buckets, 2, seed=3).batch(0)
    t = 16  # 64 px: a 4 x 4 token grid
    hidden, ids = mb.inputs["hidden_states"], mb.inputs["img_ids"]
    assert hidden.shape == (2, 3 * t, 16) and mb.image_tokens == 3 * t and mb.target.shape == (2, t, 16)
    grid = torch.zeros(1, 16, 4, 4)
    assert torch.equal(ids[:t], Flux2Pipeline._prepare_latent_ids(grid)[0])
    assert torch.equal(ids[t:], Flux2Pipeline._prepare_image_ids([grid, grid])[0])
    assert ids[t:, 0].tolist() == [10] * t + [20] * t
    draws = per_sample_draws([generator(Stream.NOISE, 3, 0, s) for s in range(2)], (4, 8, 8), TrainConfig(seed=3),
                             pipe.scheduler, (16, 4, 4))  # fmt: skip
    for b, i in enumerate(order):
        image_latents, image_ids = pipe.prepare_image_latents([r[i : i + 1] for r in refs], 1, None, CPU, torch.float32)
        assert torch.equal(ids[t:], image_ids[0])
        torch.testing.assert_close(hidden[b, t:], image_latents[0], rtol=1e-5, atol=1e-5)
        # the target's tokens first: its latent as the pipeline encodes an image, noised with the step's draws
        x = pipe._encode_vae_image(pixels[i : i + 1], None)
        sigma = draws["sigmas"][b]
        noisy = (1 - sigma) * x + sigma * draws["noise"][b : b + 1]
        torch.testing.assert_close(hidden[b, :t], Flux2Pipeline._pack_latents(noisy)[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mb.target[b], Flux2Pipeline._pack_latents(draws["noise"][b : b + 1] - x)[0],
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


def _cp_group(monkeypatch, size: int, state: dict):
    """cp.shard's view of a CP group of `size` (this rank: state["rank"]), without a process group."""
    group = object()
    real_size, real_rank = cp.comm.group_size, cp.comm.group_rank
    monkeypatch.setattr(cp.comm, "group_size", lambda g: size if g is group else real_size(g))
    monkeypatch.setattr(cp.comm, "group_rank", lambda g: state["rank"] if g is group else real_rank(g))
    return group


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_the_loss_covers_the_target_tokens_only_and_cp_chunks_keep_it(dev, monkeypatch, cp_size):
    enc, _ = dev
    data, _, _ = _two_reference_batch(dev)
    scheduler = FlowMatchEulerDiscreteScheduler()
    whole = _batches(data, scheduler, enc.vae).micro(1)
    t = whole.target.shape[1]
    pred = torch.randn_like(whole.inputs["hidden_states"]).requires_grad_(True)
    loss = batch_loss(pred, whole)
    torch.testing.assert_close(loss, flow_loss(pred[:, :t], whole.target, whole.weighting.flatten()), rtol=1e-6,
                               atol=0)  # fmt: skip
    loss.backward()
    assert pred.grad[:, :t].abs().min() > 0 and pred.grad[:, t:].abs().max() == 0
    changed = pred.detach().clone()
    changed[:, t:] += 10.0
    assert batch_loss(changed, whole) == loss.detach()
    changed[:, t - 1] += 1.0
    assert batch_loss(changed, whole) != loss.detach()
    state = {"rank": 0}
    group = _cp_group(monkeypatch, cp_size, state) if cp_size > 1 else None
    chunks = []
    for r in range(cp_size):
        state["rank"] = r
        chunks.append(_batches(data, scheduler, enc.vae, cp_size, r, group).micro(1))
    for key, dim in {"hidden_states": 1, "encoder_hidden_states": 1, "img_ids": 0, "txt_ids": 0}.items():
        assert torch.equal(torch.cat([c.inputs[key] for c in chunks], dim), whole.inputs[key]), key
    size = pred.shape[1] // cp_size
    mean_of_chunks = (
        sum(batch_loss(pred.detach()[:, r * size : (r + 1) * size], c) for r, c in enumerate(chunks)) / cp_size
    )
    torch.testing.assert_close(mean_of_chunks, loss.detach(), rtol=1e-6, atol=0)


def test_the_plan_counts_every_reference(dev, tmp_path, capsys):
    from flux_cp.plan.report import print_plan

    folder = references_folder(tmp_path / "d", n=2, counts=[1, 3])
    model = str(FLUX2.embedded_default(pairs=False))
    print_plan(parse_config(["--plan", "--pretrained_model_name_or_path", model, "--dataset_name", str(folder),
                             "--resolution", "1024", "--gpu_memory_gib", "80"]))  # fmt: skip
    # the longest sample: the target and 3 references of 4,096 tokens each, and 512 text tokens
    assert "1024 px with 3 references (16896 tokens/sample)" in capsys.readouterr().out
