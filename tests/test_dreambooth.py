"""The DreamBooth data options on one process: --instance_data_dir, --repeats, --caption_dropout, prior preservation
and several --resolution values. What a slot trains on (its sample, caption, class image, noise) does not depend on
the layout, CP chunks of a prior-preservation batch average to diffusers' loss, every image appears at every
resolution, and the flags' mistakes are one line. (The trainer end to end, CP against one process:
tests/test_train_dreambooth.py.)"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flux_cp.config.parser import parse_config
from flux_cp.config.ranges import unused_flags
from flux_cp.config.training import DataConfig
from flux_cp.data.buckets import ClassGeometry, Geometry, bucket_divisor, run_buckets
from flux_cp.data.encode import ClassSamples, LiveData, Repeated, encode_dataset
from flux_cp.data.prior import (
    MARKER,
    check_generated_folder,
    class_images,
    class_source,
    generated_folder,
    generated_name,
    missing,
    missing_count,
)
from flux_cp.data.schedule import BatchSchedule, Repeats, check_epoch_size
from flux_cp.data.sources import BUNDLED_DATA, open_source
from flux_cp.errors import UsageError
from flux_cp.loss import batch_loss
from flux_cp.outputs.resume import check_prior_resume
from flux_cp.rng import Stream, generator
from flux_cp.shape.run_shape import check_tokens
from tests.fakes import D, FakeData, L, make_batches

EMPTY = {"prompt_embeds": torch.full((L, D), 7.0), "pooled_prompt_embeds": torch.full((D,), 7.0)}


class CaptionedData(FakeData):
    """FakeData whose empty caption encodes to sevens (no sample's embedding is constant)."""

    def text(self, caption: str) -> dict:
        assert caption == "", caption
        return {k: v.clone() for k, v in EMPTY.items()}


def _dropped(batch) -> list[bool]:
    """Which samples of a micro-batch carry the empty caption."""
    return [bool((e == 7.0).all()) for e in batch.inputs["encoder_hidden_states"]]


def _config(**kw) -> DataConfig:
    return DataConfig(random_flip=True, **kw)


# --- flags -----------------------------------------------------------------------------------------------------


def test_instance_data_dir_is_a_local_dataset_name_and_not_given_beside_it(tmp_path):
    pairs = str(BUNDLED_DATA.parent / "tiny_pairs")
    cfg = parse_config(["--instance_data_dir", pairs])
    assert cfg.data.dataset_name == cfg.data.instance_data_dir == pairs
    assert cfg.demo.name == "the FLUX.1 Kontext demo"  # as --dataset_name of the bundled pairs selects it
    cfg = parse_config(["--instance_data_dir", str(tmp_path)])
    assert cfg.data.dataset_name == str(tmp_path) and cfg.demo_off == ("instance_data_dir",)
    with pytest.raises(UsageError, match="^--dataset_name and --instance_data_dir both name the training data"):
        parse_config(["--instance_data_dir", str(tmp_path), "--dataset_name", str(tmp_path)])
    with pytest.raises(UsageError, match="^--instance_data_dir owner/name: no such folder"):
        parse_config(["--instance_data_dir", "owner/name"])


def test_resolutions_are_a_sorted_list_and_each_is_checked():
    cfg = parse_config(["--resolution", "128, 64"])
    assert cfg.data.resolution == (64, 128) and cfg.data.largest_resolution == 128
    assert cfg.validation.validation_resolution == 128
    for argv, message in [
        (["--resolution", "64,64"], "'64,64' names 64 more than once"),
        (["--resolution", "64,100"], "--resolution 100 must be a multiple of 16"),
        (["--resolution", "64,0"], "--resolution 0 is out of range"),
        (["--resolution", "64,big"], "'64,big': give sizes in pixels"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_config(argv)


def test_prior_preservation_flags_are_checked_and_unused_ones_named(tmp_path):
    with pytest.raises(UsageError, match=r"^--with_prior_preservation needs --class_data_dir \(the folder"):
        parse_config(["--with_prior_preservation", "--class_prompt", "a dog"])
    with pytest.raises(UsageError, match=r"^--with_prior_preservation needs --class_prompt \(the prompt"):
        parse_config(["--with_prior_preservation", "--class_data_dir", str(tmp_path)])
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        parse_config(["--with_prior_preservation", "--class_data_dir", str(tmp_path / "file"), "--class_prompt", "x"])
    flat = parse_config([]).flat()
    assert unused_flags({"class_prompt", "prior_loss_weight"}, flat) == [
        "--class_prompt has no effect without --with_prior_preservation",
        "--prior_loss_weight has no effect without --with_prior_preservation",
    ]


# --- several resolutions ---------------------------------------------------------------------------------------


def test_buckets_of_several_resolutions_divide_by_the_cp_size_at_each():
    buckets, per_resolution = run_buckets((64, 128, 256), 2, True)
    assert len(per_resolution) == 3 and all(per_resolution)
    for resolution, ids in zip((64, 128, 256), per_resolution):
        for w, h in (buckets[b] for b in ids):
            assert (w // 16) * (h // 16) % bucket_divisor(2) == 0
            assert abs(w * h - resolution**2) <= 0.25 * resolution**2  # each resolution's buckets are its own size
    square, ids = run_buckets((32, 64), 2, False)
    assert square == [(32, 32), (64, 64)] and ids == [[0], [1]]


def test_a_resolution_of_several_that_does_not_split_over_the_cp_group_is_refused():
    from flux_cp.config.flags import ValidationConfig
    from flux_cp.families import FLUX1
    from flux_cp.shape.run_shape import RunShape

    shape = RunShape(FLUX1, "m", None, None, ((32, 32), (48, 48)), ((0,), (1,)), 32, 2, 1, 2, False)
    with pytest.raises(UsageError, match="^--resolution 48 gives 9 image tokens, not divisible by --cp_size 2"):
        check_tokens(shape, DataConfig(resolution=(32, 48), max_sequence_length=32), ValidationConfig())


class _Encoders:
    """The VAE's latents are the pixels subsampled 8x, prompts zeros: enough for the cache's bookkeeping."""

    def latents(self, pixels):
        return pixels[:, :, ::8, ::8].float(), torch.ones_like(pixels[:, :, ::8, ::8]).float()

    def prompts(self, captions, max_len):
        return {"prompt_embeds": torch.zeros(len(captions), max_len, 4) + len(captions[0])}

    def latent_shape(self, size):
        return (3, size[1] // 8, size[0] // 8)

    def text_shapes(self, max_len):
        return {"prompt_embeds": (max_len, 4)}


@pytest.mark.parametrize("cached", [True, False])
def test_every_image_trains_at_every_resolution_each_epoch_and_repeats_repeat_it(tmp_path, cached):
    data = DataConfig(resolution=(64, 128), max_sequence_length=4, aspect_buckets=True, random_flip=True)
    source = open_source(data)
    buckets, per_resolution = run_buckets(data.resolution, 2, True)
    geometry = Geometry(buckets, per_resolution)
    if cached:
        encoded = encode_dataset(source, _Encoders(), geometry, data, 0, tmp_path, ("v", "t"), 0, 1, captions=("",))
    else:
        encoded = LiveData(source, _Encoders(), geometry, data, 0)
    n = len(source)
    assert len(encoded.buckets) == 2 * n
    for placement, ids in enumerate(per_resolution):
        for i in range(n):
            index = placement * n + i
            assert encoded.buckets[index] in ids  # a bucket of that resolution
            w, h = buckets[encoded.buckets[index]]
            assert encoded.load(index, False, 0)["latent_mean"].shape == (3, h // 8, w // 8)
    assert encoded.text("")["prompt_embeds"].shape == (4, 4)
    repeated = Repeated(encoded, 3)
    schedule = BatchSchedule(repeated.buckets, 1, seed=0)
    epoch = [b[0] for b in schedule.epoch(0)]
    assert Counter(i % n for i in epoch) == dict.fromkeys(range(n), 6)  # 2 resolutions x 3 repeats
    assert Counter(i % (2 * n) // n for i in epoch) == {0: 3 * n, 1: 3 * n}
    assert all(len({repeated.buckets[i] for i in b}) == 1 for b in BatchSchedule(repeated.buckets, 2, 0).epoch(0))
    assert torch.equal(repeated.load(2 * n + 5, False, 0)["latent_mean"], encoded.load(5, False, 0)["latent_mean"])


def _listed_schedule(buckets: list[int], global_batch: int, seed: int, epoch: int) -> list[list[int]]:
    """The schedule as it was computed from a list of every sample (every copy of --repeats listed)."""
    from flux_cp.rng import Stream, generator

    by_bucket: dict[int, list[int]] = {}
    for i, b in enumerate(buckets):
        by_bucket.setdefault(b, []).append(i)
    batches = []
    for b in sorted(by_bucket):
        idx = by_bucket[b]
        perm = torch.randperm(len(idx), generator=generator(Stream.BUCKET_ORDER, seed, epoch, b)).tolist()
        shuffled = [idx[p] for p in perm]
        batches += [shuffled[k * global_batch : (k + 1) * global_batch] for k in range(len(shuffled) // global_batch)]
    order = torch.randperm(len(batches), generator=generator(Stream.BATCH_ORDER, seed, epoch)).tolist()
    return [batches[o] for o in order]


def test_repeats_schedule_the_same_batches_without_listing_every_copy():
    """--repeats makes a schedule of the base samples' groups and a count: the same data order as the list of every
    copy gave (resumes of earlier runs continue alike), and a million repeats cost no list of every copy."""
    groups = [0, 1, 0, 2, 1, 0, 0]
    for repeats, g in ((1, 2), (3, 2), (5, 3)):
        schedule = BatchSchedule(Repeats(groups, repeats), g, seed=4)
        for epoch in (0, 1):
            assert schedule.epoch(epoch) == _listed_schedule(groups * repeats, g, 4, epoch)
        assert schedule.batch(schedule.batches_per_epoch + 1)[1] == _listed_schedule(groups * repeats, g, 4, 1)[1]
    many = Repeats(groups, 1_000_000)
    assert len(many) == 7_000_000 and many[6_999_999] == groups[-1] and len(many.base) == len(groups)
    assert BatchSchedule(many, 4, seed=0).batch(123)[0] == 0


def test_an_epoch_too_long_to_schedule_is_refused_naming_its_factors():
    check_epoch_size(1000, 2, 25_000)  # 50M: the most
    with pytest.raises(
        UsageError,
        match=r"^an epoch would hold 50000002000 samples \(25 images x 2 --resolution "
        r"sizes x 1000000040 --repeats\), more than 50000000: lower --repeats",
    ):
        check_epoch_size(25, 2, 1_000_000_040)


def test_one_resolution_keeps_the_crops_of_earlier_versions():
    """The first resolution's crop draw has the keys a run of one resolution always had (its cache, its data)."""
    from flux_cp.rng import Stream, generator

    geometry = Geometry([(64, 64)])
    assert torch.equal(torch.rand(3, generator=geometry.crop_generator(5, 7, 0)),
                       torch.rand(3, generator=generator(Stream.CROP, 5, 7)))  # fmt: skip
    assert torch.equal(torch.rand(3, generator=geometry.crop_generator(5, 7, 0, epoch=2)),
                       torch.rand(3, generator=generator(Stream.CROP, 5, 7, 2)))  # fmt: skip
    assert not torch.equal(torch.rand(3, generator=geometry.crop_generator(5, 7, 1)),
                           torch.rand(3, generator=geometry.crop_generator(5, 7, 0)))  # fmt: skip


# --- caption dropout ---------------------------------------------------------------------------------------------


def test_caption_dropout_is_a_slot_s_draw_the_same_on_every_layout():
    data = CaptionedData(8)
    config = _config(caption_dropout=0.5)
    whole = make_batches(data, dp=1, dp_rank=0, per_rank=2, data_config=config)
    halves = [make_batches(data, dp=2, dp_rank=r, data_config=config) for r in (0, 1)]
    seen = []
    for m in range(40):
        a = whole.micro(m)
        parts = [h.micro(m) for h in halves]
        for key in ("encoder_hidden_states", "pooled_projections", "hidden_states"):
            assert torch.equal(a.inputs[key], torch.cat([p.inputs[key] for p in parts])), (m, key)
        seen += _dropped(a)
    assert 25 <= sum(seen) <= 55, sum(seen)  # about half of 80
    # a dropped slot has the empty caption's encodings in full (T5 and CLIP), the others their own
    plain = make_batches(data, dp=1, dp_rank=0, per_rank=2, data_config=_config())
    for m in range(6):
        got, own = whole.micro(m), plain.micro(m)
        for k, dropped in enumerate(_dropped(got)):
            want = EMPTY["pooled_prompt_embeds"] if dropped else own.inputs["pooled_projections"][k]
            assert torch.equal(got.inputs["pooled_projections"][k], want)
            assert torch.equal(got.inputs["hidden_states"][k], own.inputs["hidden_states"][k])  # the same image


# --- prior preservation ----------------------------------------------------------------------------------------


class FakeClasses:
    """Class images: sample c's encodings of FakeData, offset so that they differ from any training sample's."""

    def __init__(self, count: int):
        self.data, self.count, self.calls = FakeData(count), count, []

    def load(self, image: int, bucket: int, epoch: int) -> dict:
        self.calls.append((image, bucket))
        s = self.data.load(image, False, epoch)
        return {k: v + 100.0 if k.startswith("latent") else v for k, v in s.items()}


def test_class_images_take_the_slots_after_the_batch_and_do_not_depend_on_the_layout():
    data, classes = CaptionedData(8), FakeClasses(3)
    config = _config(with_prior_preservation=True, caption_dropout=0.5, class_data_dir="c", class_prompt="p")
    whole = make_batches(data, dp=1, dp_rank=0, per_rank=2, data_config=config, classes=classes)
    halves = [make_batches(data, dp=2, dp_rank=r, data_config=config, classes=classes) for r in (0, 1)]
    for m in range(12):
        a, parts = whole.micro(m), [h.micro(m) for h in halves]
        assert a.prior == 2 and all(p.prior == 1 for p in parts)
        for key in ("hidden_states", "encoder_hidden_states", "timestep", "guidance"):
            # the whole batch is [own 0, own 1, class 0, class 1]; dp rank r holds [own r, class r]
            reordered = torch.cat([parts[0].inputs[key][:1], parts[1].inputs[key][:1], parts[0].inputs[key][1:],
                                   parts[1].inputs[key][1:]])  # fmt: skip
            assert torch.equal(a.inputs[key], reordered), (m, key)
        assert not any(_dropped(a)[2:]), "a class image's caption is never dropped"
        # a class slot draws its own noise and timestep, not its training sample's
        assert not torch.equal(a.inputs["timestep"][:2], a.inputs["timestep"][2:])
    assert {bucket for _, bucket in classes.calls} == {0}  # loaded in the batch's bucket


def test_every_class_image_is_used_equally_and_a_slot_s_choice_is_fixed():
    schedule = BatchSchedule([0] * 10, 4, seed=1)
    chosen = [c for m in range(15) for c in schedule.class_images(m, 6)]  # 60 slots: 10 rounds of 6
    assert Counter(chosen) == dict.fromkeys(range(6), 10)
    assert chosen[:6] != chosen[6:12]  # each round in an order of its own
    again = BatchSchedule([0] * 10, 4, seed=1)
    assert [again.class_images(m, 6) for m in (14, 3)] == [chosen[56:60], chosen[12:16]]


def test_prior_loss_is_diffusers_and_cp_chunks_average_to_it(fake_cp_group):
    group, state = fake_cp_group
    data, classes = CaptionedData(4), FakeClasses(2)
    config = _config(with_prior_preservation=True, prior_loss_weight=0.7, class_data_dir="c", class_prompt="p")
    whole = make_batches(data, dp=1, dp_rank=0, per_rank=2, data_config=config, classes=classes).micro(1)
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(whole.target.shape, generator=g, dtype=torch.float64)
    # diffusers' train_dreambooth_lora_flux.py: chunk prediction, target and weighting into halves, per-sample
    # means of the weighted squared error, the instance mean plus prior_loss_weight times the prior mean
    model_pred, model_pred_prior = torch.chunk(pred, 2, dim=0)
    target, target_prior = torch.chunk(whole.target, 2, dim=0)
    weighting, weighting_prior = torch.chunk(whole.weighting, 2, dim=0)
    prior_loss = torch.mean((weighting_prior.float() * (model_pred_prior.float() - target_prior.float()) ** 2)
                            .reshape(target_prior.shape[0], -1), 1).mean()  # fmt: skip
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1),
                      1).mean()  # fmt: skip
    reference = loss + 0.7 * prior_loss
    assert torch.allclose(batch_loss(pred, whole), reference, rtol=1e-6)
    assert not torch.allclose(batch_loss(pred, whole), (whole.weighting * (pred - whole.target) ** 2).mean().float())
    chunks = []
    for r in (0, 1):
        state["rank"] = r
        mb = make_batches(data, dp=1, dp_rank=0, cp_size=2, cp_rank=r, group=group, per_rank=2, data_config=config,
                          classes=classes).micro(1)  # fmt: skip
        n = mb.target.shape[1]
        chunks.append(batch_loss(pred[:, r * n : (r + 1) * n], mb))
    assert torch.allclose((chunks[0] + chunks[1]) / 2, reference, rtol=1e-6)


def _generated(folder: Path, *indices: int) -> Path:
    """flux-cp's generated/ subfolder of `folder`, with its marker and the generated images of `indices`."""
    target = generated_folder(folder)
    target.mkdir(parents=True, exist_ok=True)
    (target / MARKER).write_text("{}")
    for k in indices:
        img = Image.new("RGB", (8, 8), (k, 0, 0))
        img.save(target / generated_name(k, img))
    return target


def test_the_user_s_class_images_come_first_and_generated_ones_follow_by_index(tmp_path):
    for name in ("zebra.png", "aardvark.png"):  # one sorts after generated/, one before
        Image.new("RGB", (8, 8)).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not an image")
    _generated(tmp_path, 10, 2, 0)
    source = class_source(tmp_path, "a dog", 4)
    assert [Path(s.ref).relative_to(tmp_path).as_posix()[:15] for s in source.samples] == [
        "aardvark.png", "zebra.png", "generated/00000", "generated/00002"]  # fmt: skip
    assert {s.caption for s in source.samples} == {"a dog"}
    # place 2 + k is generated image k: with 2 of the user's, 5 class images need generated 0, 1 and 2
    assert missing(tmp_path, 5) == (4, [1]) and missing(tmp_path, 2) == (2, [])
    assert missing_count(tmp_path / "none", 3, True) == (0, [0, 1, 2])


def test_a_generated_folder_without_the_marker_is_the_user_s_and_never_written(tmp_path):
    (tmp_path / "generated").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "generated" / "mine.png")
    assert [p.name for p in class_images(tmp_path)] == ["mine.png"] and missing(tmp_path, 3) == (1, [0, 1])
    with pytest.raises(UsageError, match=r"generated/ holds files flux-cp did not write \(no \.flux_cp_class_images"):
        check_generated_folder(tmp_path)
    check_generated_folder(tmp_path / "new")  # new, or flux-cp's: fine
    check_generated_folder(_generated(tmp_path / "ours").parent)


def test_a_resume_needing_other_class_images_is_refused_naming_the_counts(tmp_path):
    data = DataConfig(with_prior_preservation=True, class_data_dir="c", class_prompt="p", num_class_images=5)
    rows = [[f"generated/0000{k}-x.png", "d", "c"] for k in range(3)]
    meta = {"run": {"prior": "abc", "prior_files": rows}, "args": {"num_class_images": 3}}
    with pytest.raises(UsageError) as e:
        check_prior_resume(meta, data, tmp_path / "checkpoint-2")
    assert str(e.value) == (
        f"--resume_from_checkpoint {tmp_path / 'checkpoint-2'} was trained with 3 class images, and this run asks "
        "for --num_class_images 5: resume with --num_class_images 3 (nothing is generated), or start a new "
        "--output_dir"
    )
    del meta["run"]["prior_files"]  # a checkpoint of a version that kept no rows: the flag it ran with
    with pytest.raises(UsageError, match="was trained with 3 class images"):
        check_prior_resume(meta, data, tmp_path)
    with pytest.raises(UsageError, match="was trained without --with_prior_preservation"):
        check_prior_resume({"run": {"prior": None}, "args": {}}, data, tmp_path)
    check_prior_resume({"run": {"prior": "abc", "prior_files": rows * 2, "args": {}}}, DataConfig(), tmp_path)
    check_prior_resume({"run": {"prior": "abc"}, "args": {"num_class_images": 5}}, data, tmp_path)


def test_generated_class_images_are_written_as_rendered_so_an_interrupted_generation_resumes(tmp_path, monkeypatch):
    """Ctrl-C after two of four class images keeps those two (written one by one, atomically); the next run renders
    only the other two, from the same noise keys (the seed and the image's index)."""
    import types

    from flux_cp.config.parser import parse_config
    from flux_cp.families import FLUX1
    from flux_cp.run import class_images as generation
    from flux_cp.run.class_images import generate_class_images

    folder = tmp_path / "class"
    folder.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "mine.png")
    cfg = parse_config(["--with_prior_preservation", "--class_data_dir", str(folder), "--class_prompt", "a dog",
                        "--num_class_images", "5", "--resolution", "32", "--seed", "7"])  # fmt: skip
    rendered = []

    def render(transformer, encoders, scheduler_config, embeds, layout, family, autocast, jobs, resolution,
               on_image=None, **call):  # fmt: skip
        for job, (_, gen) in enumerate(jobs):
            if len(rendered) == 2:
                raise KeyboardInterrupt
            rendered.append(torch.randint(0, 255, (1,), generator=gen).item())
            on_image(job, np.full((8, 8, 3), rendered[-1], dtype=np.uint8))
        return {}

    transformer = types.SimpleNamespace(requires_grad_=lambda on: None, config={"num_attention_heads": 4})
    monkeypatch.setattr(generation, "render", render)
    monkeypatch.setattr(generation, "load_transformer", lambda *a: transformer)
    monkeypatch.setattr(generation, "parallelize", lambda t, *a, **k: types.SimpleNamespace(model=t))
    family = types.SimpleNamespace(
        image_tokens=FLUX1.image_tokens, validation_embeds=lambda *a: {}, transformer_class=lambda: None
    )
    shape = types.SimpleNamespace(family=family, text_tokens=8, model_path="m")
    layout = types.SimpleNamespace(is_main=True, cp=1, cp_rank=0, cp_context=None)
    encoders = types.SimpleNamespace(placement=types.SimpleNamespace(release=lambda: None))
    args = (cfg, shape, layout, encoders, {}, torch.float32, torch.device("cpu"), None)
    with pytest.raises(KeyboardInterrupt):
        generate_class_images(*args)
    assert sorted(p.name[:5] for p in class_images(folder)) == ["00000", "00001", "mine."]
    assert (generated_folder(folder) / MARKER).is_file() and not list(generated_folder(folder).glob(".*.tmp"))
    first = list(rendered)
    rendered.clear()
    assert generate_class_images(*args) == 2
    again = [torch.randint(0, 255, (1,), generator=generator(Stream.CLASS_IMAGE, 7, k)).item() for k in range(4)]
    assert first + rendered == again  # images 2 and 3, each from its own noise key
    assert [p.name[:5] for p in class_images(folder)] == ["mine.", "00000", "00001", "00002", "00003"]


def test_generated_class_images_of_other_settings_are_rendered_again_and_the_log_says_so(tmp_path, monkeypatch, caplog):
    """The generated images are keyed by what rendered them: another class prompt, size, seed or model renders them
    again (those of the other settings removed, flux-cp's own), and the log says so; the same settings reuse them."""
    import logging
    import types

    from flux_cp.config.parser import parse_config
    from flux_cp.families import FLUX1
    from flux_cp.run import class_images as generation
    from flux_cp.run.class_images import generate_class_images

    folder = tmp_path / "class"

    def render(
        transformer,
        encoders,
        scheduler_config,
        embeds,
        layout,
        family,
        autocast,
        jobs,
        resolution,
        on_image=None,
        **call,
    ):
        for job, (_, gen) in enumerate(jobs):
            on_image(job, np.full((8, 8, 3), torch.randint(0, 255, (1,), generator=gen).item(), dtype=np.uint8))
        return {}

    transformer = types.SimpleNamespace(requires_grad_=lambda on: None, config={"num_attention_heads": 4})
    monkeypatch.setattr(generation, "render", render)
    monkeypatch.setattr(generation, "load_transformer", lambda *a: transformer)
    monkeypatch.setattr(generation, "parallelize", lambda t, *a, **k: types.SimpleNamespace(model=t))
    family = types.SimpleNamespace(
        image_tokens=FLUX1.image_tokens, validation_embeds=lambda *a: {}, transformer_class=lambda: None
    )
    shape = types.SimpleNamespace(family=family, text_tokens=8, model_path="m", transformer_config={"num_layers": 2})
    layout = types.SimpleNamespace(is_main=True, cp=1, cp_rank=0, cp_context=None)
    encoders = types.SimpleNamespace(placement=types.SimpleNamespace(release=lambda: None))

    def generate(flags=(), components=None, config=None, dtype=torch.float32, scheduler=None) -> int:
        cfg = parse_config(
            [
                "--with_prior_preservation",
                "--class_data_dir",
                str(folder),
                "--class_prompt",
                "a dog",
                "--num_class_images",
                "3",
                "--resolution",
                "32",
                "--seed",
                "7",
                *flags,
            ]
        )
        there = types.SimpleNamespace(**{**vars(shape), **({"transformer_config": config} if config else {})})
        return generate_class_images(
            cfg,
            there,
            layout,
            encoders,
            scheduler or {"shift": 3.0},
            dtype,
            torch.device("cpu"),
            None,
            components or {"vae": "v1"},
        )

    caplog.set_level(logging.INFO, logger="flux_cp")
    assert generate() == 3 and generate() == 0  # the same settings: reused
    changes = [
        dict(flags=("--class_prompt", "a cat")),
        dict(flags=("--resolution", "64")),
        dict(flags=("--seed", "8")),
        dict(components={"vae": "v2"}),
        dict(config={"num_layers": 3}),
        dict(scheduler={"shift": 1.0}),
        dict(dtype=torch.bfloat16),
    ]
    for change in changes:
        caplog.clear()
        assert generate(**change) == 3, change
        assert "the 3 class images generated in" in caplog.text and "rendering them again" in caplog.text, change
        assert len(class_images(folder)) == 3  # the other settings' images removed: flux-cp's own
    assert generate(**changes[-1]) == 0


def test_class_images_are_encoded_in_every_bucket_the_training_images_use(tmp_path):
    for k in range(2):
        Image.new("RGB", (40 + 8 * k, 32), (60 * k, 0, 0)).save(tmp_path / f"{k}.png")
    data = DataConfig(resolution=(32, 64), max_sequence_length=4)
    buckets, _ = run_buckets(data.resolution, 1, False)
    classes = class_source(tmp_path, "a shape", 2)
    encoded = encode_dataset(classes, _Encoders(), ClassGeometry(buckets, [1, 0]), data, 0, tmp_path / "cache",
                             ("v", "t"), 0, 1, flips=False)  # fmt: skip
    samples = ClassSamples(encoded, 2, [1, 0])
    for bucket, (w, h) in enumerate(buckets):
        for image in range(2):
            assert samples.load(image, bucket, 0)["latent_mean"].shape == (3, h // 8, w // 8)
    assert all(len(e["latents"]) == 1 for e in encoded.entries)  # never flipped


def test_prior_preservation_excludes_its_class_folder_from_the_training_images(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for src in sorted(BUNDLED_DATA.glob("*.png"))[:3]:
        (folder / src.name).write_bytes(src.read_bytes())
    (folder / "class").mkdir()
    Image.new("RGB", (16, 16)).save(folder / "class" / "00000-x.png")
    data = DataConfig(dataset_name=str(folder), instance_prompt="sks", with_prior_preservation=True,
                      class_data_dir=str(folder / "class"), class_prompt="a shape")  # fmt: skip
    assert len(open_source(data)) == 3
