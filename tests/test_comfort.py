"""Cached encodings, aspect buckets, validation images with CP, trackers, the loss-curve command."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image

from flux_cp.data.buckets import bucket_divisor, bucket_sizes, nearest_bucket
from flux_cp.data.schedule import BatchSchedule
from flux_cp.data.sources import BUNDLED_DATA
from flux_cp.outputs.metrics import read_metrics
from tests.launch import ROOT, env, losses, ok, python_cmd, run_args, train


def _common(tmp, name, steps, *extra):
    return run_args(tmp, name, steps, "--seed", "2", "--learning_rate", "1e-3", *extra, cache=False)


def _computed(result) -> int:
    """Encodings the run computed: image latents and caption embeddings."""
    counts = r"encodings: \d+ samples; newly computed: (\d+) image latents? \(.*?\), (\d+) caption embeddings?"
    m = re.search(counts, result.stdout + result.stderr)
    assert m, result.stderr[-2000:]
    return int(m.group(1)) + int(m.group(2))


@pytest.mark.e2e
def test_second_run_reads_the_cache_and_a_changed_caption_recomputes_only_itself(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(BUNDLED_DATA, data)
    cache = ["--encodings_dir", str(tmp_path / "cache"), "--dataset_name", str(data)]
    first = ok(train(2, *_common(tmp_path, "a", 4, "--cp_size", "2", *cache)))
    assert _computed(first) > 24  # every latent and every distinct caption
    second = ok(train(2, *_common(tmp_path, "b", 4, "--cp_size", "2", *cache)))
    assert _computed(second) == 0
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    rows = [json.loads(x) for x in (data / "metadata.jsonl").read_text().splitlines()]
    rows[0]["text"] = "a completely new caption"
    (data / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    third = ok(train(1, *_common(tmp_path, "c", 1, *cache)))
    assert _computed(third) == 1
    fourth = ok(train(1, *_common(tmp_path, "d", 1, *cache, "--resolution", "80")))
    assert _computed(fourth) == 24  # a new resolution re-encodes the images, not the captions


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("res", [256, 1024, 2048])
def test_every_bucket_splits_evenly_over_the_cp_group(cp, res):
    buckets = bucket_sizes(res, bucket_divisor(cp))
    assert buckets, "no bucket"
    assert (res, res) in buckets or ((res // 16) ** 2) % bucket_divisor(cp)
    if cp in (1, 2, 4, 8):
        assert buckets == bucket_sizes(res, bucket_divisor(1)), "buckets must not depend on the CP size"
    for w, h in buckets:
        assert w % 16 == 0 and h % 16 == 0
        assert ((w // 16) * (h // 16)) % cp == 0, (w, h)
        assert 0.75 <= (w * h) / res**2 <= 1.25
        assert 0.5 <= w / h <= 2.0


def test_nearest_bucket_follows_the_aspect_ratio():
    buckets = bucket_sizes(1024, bucket_divisor(2))
    wide = buckets[nearest_bucket(1920, 1080, buckets)]
    tall = buckets[nearest_bucket(1080, 1920, buckets)]
    assert wide[0] > wide[1] and tall[1] > tall[0]
    assert abs(wide[0] / wide[1] - 16 / 9) < 0.15


def test_batches_never_mix_buckets_and_are_the_same_for_every_rank():
    buckets = [i % 3 for i in range(50)] + [7] * 3
    a, b = BatchSchedule(buckets, 4, seed=9), BatchSchedule(buckets, 4, seed=9)
    assert a.batches_per_epoch == 12  # 17, 17, 16 samples -> 4 + 4 + 4 batches of 4; bucket 7 has too few
    for epoch in range(3):
        assert a.epoch(epoch) == b.epoch(epoch)
        for batch in a.epoch(epoch):
            assert len({buckets[i] for i in batch}) == 1
    assert a.epoch(0) != a.epoch(1)


@pytest.mark.e2e
def test_aspect_buckets_on_an_int8_base_train_the_same_with_and_without_cp(tmp_path):
    """Aspect buckets, and the frozen base stored in int8 (--base_precision: quantized before LoRA, left out of DDP's
    broadcast): cp=2 gives one process's losses."""
    args = ["--aspect_buckets", "--resolution", "128", "--train_batch_size", "2", "--encodings_dir",
            str(tmp_path / "cache"), "--base_precision", "int8"]  # fmt: skip
    ok(train(1, *_common(tmp_path, "one", 10, *args)))
    cp2 = ok(train(2, *_common(tmp_path, "cp2", 10, "--cp_size", "2", *args)))
    assert "base precision int8: 40 linear layers in 8 bits" in cp2.stderr, cp2.stderr[-2000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "cp2")
    assert max(abs(x - y) / abs(y) for x, y in zip(a, b)) < 1e-5
    sizes = set()
    for p in BUNDLED_DATA.glob("*.png"):
        with Image.open(p) as img:
            sizes.add(round(img.size[0] / img.size[1], 2))
    assert len(sizes) >= 3, "the bundled set should hold several aspect ratios"
    from flux_cp.data.buckets import Geometry, training_buckets

    geometry = Geometry(training_buckets(128, 2, True))
    used = {geometry.bucket_of(Image.open(p).size) for p in BUNDLED_DATA.glob("*.png")}
    assert len(used) >= 2, f"the test should train on more than one bucket: {geometry.buckets}"


@pytest.mark.e2e
def test_validation_images_with_cp_equal_those_without_and_trackers_log(tmp_path):
    val = [
        "--validation_prompt",
        "a red circle",
        "--validation_prompt",
        "a blue square",
        "--num_validation_images",
        "2",
        "--validation_inference_steps",
        "3",
        "--validation_resolution",
        "96",
        "--learning_rate",
        "1e-12",  # (0 is refused: a run that cannot learn); the weights stay as they are, so images compare
        "--encodings_dir",
        str(tmp_path / "cache"),
    ]
    one = ok(train(1, *_common(tmp_path, "one", 1, *val)))
    assert "flux-cp: the demo's settings are off (--max_train_steps given): 1 step, learning rate" in one.stderr
    ok(train(2, *[a if a != "none" else "tensorboard" for a in _common(tmp_path, "cp2", 1, "--cp_size", "2", *val)]))
    one = np.asarray(Image.open(tmp_path / "one" / "validation" / "step-000001.png")).astype(int)
    two = np.asarray(Image.open(tmp_path / "cp2" / "validation" / "step-000001.png")).astype(int)
    assert one.shape == (2 * 96, 2 * 96, 3)
    assert np.abs(one - two).max() <= 1, "CP validation images differ from non-CP ones"
    assert one.std() > 1, "blank images would make the comparison blind"
    # The model card the run ends with shows those images and says how the run was laid out.
    card = (tmp_path / "cp2" / "README.md").read_text()
    assert "validation/step-000001.png" in card and "world 2 = dp 1 x cp 2" in card, card[:2000]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = list((tmp_path / "cp2" / "logs").rglob("events.out.tfevents.*"))
    tags = {"scalars": set(), "images": set()}
    for run in runs:
        acc = EventAccumulator(str(run.parent))
        acc.Reload()
        for kind in tags:
            tags[kind] |= set(acc.Tags().get(kind, []))
    assert {"loss", "lr", "tokens_per_s", "peak_mem_gib"} <= tags["scalars"], tags
    assert "validation" in tags["images"], tags


def test_loss_curve_command_plots_any_metrics_file(tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "loss": 1 / i}) + "\n" for i in range(1, 30)))
    r = subprocess.run(python_cmd("-m", "flux_cp.metrics", str(metrics), str(tmp_path / "c.png")), cwd=ROOT, env=env(),
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    with Image.open(tmp_path / "c.png") as img:
        assert img.size[0] > 300
    assert len(read_metrics(metrics)) == 29


def test_hub_data_sets_are_read_through_datasets(monkeypatch):
    """The hub path (no hub here): datasets.load_dataset is replaced by an in-memory data set of the same
    shape as a hub image/caption set; columns are checked and images come back decoded."""
    import io

    import datasets

    from flux_cp.config.training import DataConfig
    from flux_cp.data.sources import open_source
    from flux_cp.errors import UsageError

    images = []
    for p in sorted(BUNDLED_DATA.glob("*.png"))[:4]:
        buf = io.BytesIO(p.read_bytes())
        images.append({"bytes": buf.getvalue(), "path": None})
    ds = datasets.Dataset.from_dict({"img": images, "caption": [f"shape {i}" for i in range(4)]})
    ds = ds.cast_column("img", datasets.Image())
    calls = []
    monkeypatch.setattr(
        datasets, "load_dataset", lambda name, config, split, cache_dir: calls.append((name, split, cache_dir)) or ds
    )

    def args(**kw):
        base = dict(
            dataset_name="someone/shapes",
            dataset_config_name=None,
            image_column="img",
            caption_column="caption",
            instance_prompt=None,
        )
        return DataConfig(**{**base, **kw})

    source = open_source(args())
    assert calls == [("someone/shapes", "train", None)] and len(source) == 4
    open_source(args(), cache_dir="/downloads")  # --cache_dir: where diffusers' examples download data sets too
    assert calls[-1] == ("someone/shapes", "train", "/downloads")
    assert source.samples[2].caption == "shape 2"
    assert source.load(1).size == Image.open(sorted(BUNDLED_DATA.glob("*.png"))[1]).size
    assert open_source(args(instance_prompt="sks shape")).samples[0].caption == "sks shape"
    with pytest.raises(UsageError, match="--image_column 'image' is not in someone/shapes"):
        open_source(args(image_column="image"))
    with pytest.raises(UsageError, match="--caption_column 'text' is not in"):
        open_source(args(caption_column="text"))
