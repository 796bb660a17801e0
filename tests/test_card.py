"""The model card (`README.md` in the output folder): front matter the Hub reads, links to files that exist, the
settings, a diffusers snippet that loads the weights, and a ComfyUI note."""

from __future__ import annotations

import fnmatch
import logging
import re
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from flux_cp.config.parser import parse_config
from flux_cp.families import FLUX1
from flux_cp.outputs.card import reference_names, write_model_card
from flux_cp.shape.build import resolved

TAGS = {"text-to-image", "diffusers-training", "flux", "flux-cp"}


def _resolved(argv: list[str], pairs: bool = False):
    """The flags as the trainer holds them once the model is known (FLUX.1's defaults filled in)."""
    return resolved(parse_config(argv), FLUX1, pairs, None)


def _run_folder(tmp_path: Path, steps=(0, 200), name: str = "dog-lora") -> Path:
    out = tmp_path / name
    (out / "validation").mkdir(parents=True)
    for step in steps:
        (out / "validation" / f"step-{step:06d}.png").write_bytes(b"\x89PNG")
    (out / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 0.5}}\n' for s in range(1, 201)))
    return out


def _parts(path: Path) -> tuple[dict, str]:
    text = path.read_text()
    assert text.startswith("---\n")
    front, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(front), body


def _links(body: str) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", body) if not t.startswith(("http://", "https://"))]


def _code(body: str) -> str:
    (code,) = re.findall(r"```py\n(.*?)```", body, flags=re.S)
    return code


def test_lora_card_for_flux1_dev(tmp_path):
    out = _run_folder(tmp_path)
    cfg = _resolved(["--pretrained_model_name_or_path", "black-forest-labs/FLUX.1-dev", "--output_dir", str(out),
                        "--instance_prompt", "a photo of sks dog", "--validation_prompt", "sks dog in a bucket",
                        "--validation_prompt", "sks dog: on the moon", "--resolution", "2048", "--rank", "32",
                        "--learning_rate", "2e-4", "--cp_size", "2"])  # fmt: skip
    path = write_model_card(out, cfg, layout="dp 1 x cp 2 (2 processes)", cp_mode="ulysses", repo_id="me/dog-lora")
    assert path == out / "README.md"
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # written aside, renamed into place
    front, body = _parts(path)
    assert front["base_model"] == "black-forest-labs/FLUX.1-dev" and front["library_name"] == "diffusers"
    assert (front["license"], front["license_name"]) == ("other", "flux-1-dev-non-commercial-license")
    assert TAGS | {"lora"} <= set(front["tags"]) and front["instance_prompt"] == "a photo of sks dog"
    assert front["widget"] == [
        {"text": "sks dog in a bucket; sks dog: on the moon", "output": {"url": "validation/step-000200.png"}}
    ]
    assert (out / front["widget"][0]["output"]["url"]).is_file()
    links = _links(body)
    assert "validation/step-000000.png" in links and "validation/step-000200.png" in links
    assert all((out / link).is_file() for link in links), links
    settings = (
        "| resolution | 2048 px |",
        "| optimizer steps | 200 |",
        "| learning rate | 0.0002 (constant",
        "LoRA rank 32, alpha 32",
        "| context parallelism | --cp_size 2, mode ulysses; dp 1 x cp 2",
    )
    for setting in settings:
        assert setting in body, setting
    assert "You should use `a photo of sks dog` to trigger the image generation." in body
    code = _code(body)
    compile(code, "snippet", "exec")
    assert "FluxPipeline.from_pretrained('black-forest-labs/FLUX.1-dev', dtype=dtype)" in code
    assert "repo = 'me/dog-lora'  # the trained weights on the Hugging Face Hub" in code
    assert "pipe.load_lora_weights(repo, weight_name='pytorch_lora_weights.safetensors')\n" in code
    call = "pipe(prompt='sks dog in a bucket', height=2048, width=2048, num_inference_steps=28, guidance_scale=3.5)"
    assert call in code
    assert code.endswith("image.save('dog-lora.png')\n")  # named by the repository, not a bare image.png
    assert "`ComfyUI/models/loras/`" in body and "LoraLoaderModelOnly" in body


def test_kontext_and_full_fine_tuning_cards(tmp_path):
    out = _run_folder(tmp_path, steps=(50,), name="edit")
    kontext = _resolved(pairs=True, argv=["--pretrained_model_name_or_path", "black-forest-labs/FLUX.1-Kontext-dev",
                            "--validation_prompt", "make it red", "--lora_format", "kohya"])  # fmt: skip
    front, body = _parts(write_model_card(out, kontext, pairs=True))
    assert front["base_model"] == "black-forest-labs/FLUX.1-Kontext-dev" and "flux-kontext" in front["tags"]
    assert front["license_link"] == "https://huggingface.co/black-forest-labs/FLUX.1-Kontext-dev/blob/main/LICENSE.md"
    code = _code(body)
    compile(code, "snippet", "exec")
    assert "FluxKontextPipeline.from_pretrained" in code and 'reference = load_image(f"{folder}/reference.png")' in code
    call = "image = pipe(image=reference, prompt='make it red', height=1024, width=1024, num_inference_steps=28, "
    assert call + "guidance_scale=3.5, max_area=1048576, _auto_resize=False)" in code
    # no repository: the output folder, by its absolute path, with the image written into it
    assert f"folder = {str(out.resolve())!r}  # the run's output folder" in code
    assert "load_lora_weights(folder, " in code and code.endswith('image.save(f"{folder}/image.png")\n')
    assert "kohya's / BFL's key names" in body and "FLUX.1-Kontext-dev model" in body

    full = _resolved(["--pretrained_model_name_or_path", "black-forest-labs/FLUX.1-schnell", "--full_finetune"])
    front, body = _parts(write_model_card(out, full, steps=7))
    assert front["license"] == "apache-2.0" and "lora" not in front["tags"] and TAGS <= set(front["tags"])
    code = _code(body)
    compile(code, "snippet", "exec")
    assert 'FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer"' in code
    assert "transformer=transformer" in code and "load_lora_weights" not in code
    assert "| optimizer steps | 7 |" in body and "merge the shards" in body


@pytest.mark.parametrize("base", [None, "local"])
def test_a_base_model_that_is_not_on_the_hub_is_not_named_as_one(tmp_path, base):
    out = _run_folder(tmp_path, steps=())
    argv = [] if base is None else ["--pretrained_model_name_or_path", str(tmp_path)]
    front, body = _parts(write_model_card(out, _resolved(argv)))
    assert "base_model" not in front and "license" not in front and "widget" not in front
    assert "## Validation images" not in body and "## License" not in body
    compile(_code(body), "snippet", "exec")


def test_the_demo_card_s_snippet_renders_with_the_trained_lora_at_the_trained_size_on_the_cpu(tmp_path, monkeypatch):
    """The snippet of the embedded default's card, run as it is on this CPU machine: the base it names loads, the LoRA
    file written by the trainer's save_lora goes into it, and the image has the size the model was trained at."""
    from flux_cp.families.flux1.tiny import tiny_transformer
    from flux_cp.model.lora import add_lora, lora_origin, save_lora

    out = _run_folder(tmp_path, steps=())
    cfg = _resolved(["--rank", "4", "--output_dir", str(out), "--validation_inference_steps", "2"])
    model = tiny_transformer()
    add_lora(model, cfg.lora, seed=0)
    state = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    save_lora(model, state, str(out), cfg.lora, FLUX1, lora_origin(cfg, pairs=False))
    code = _code(_parts(write_model_card(out, cfg))[1])
    assert "height=64, width=64" in code and 'device = "cuda" if torch.cuda.is_available() else "cpu"' in code
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated diffusers API (torch_dtype) in the snippet
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in a process of its own on a machine the test workers share
        try:
            exec(code, scope)  # noqa: S102 - our own snippet
        finally:
            torch.set_num_threads(threads)
            logging.disable(logging.NOTSET)  # the snippet's, for its own process
    assert any("lora_A" in n for n, _ in scope["pipe"].transformer.named_parameters())
    assert scope["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert scope["image"].size == (64, 64) and (out / "image.png").is_file()  # into the output folder
    assert not (tmp_path / "image.png").exists()


HOSTILE = 'q", weight_name="x") if 0 else None; import os; os.system("touch PWNED"); dict(x="'


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_folder_and_model_names_cannot_add_code_or_markup_to_the_card(tmp_path, full):
    """An output folder, base model folder, prompt or repository name made to break out of a string literal stays a
    literal: the card's and the summary's snippets parse to exactly the intended calls with those values, and the
    card's prose shows them as text."""
    import ast

    from flux_cp.outputs.summary import summary

    out = tmp_path / f"output{HOSTILE}`<b>"
    base = tmp_path / f"model'{HOSTILE}\\"
    (out / "validation").mkdir(parents=True)
    (out / "validation" / "step-000001.png").write_bytes(b"\x89PNG")  # the card then lists the prompts
    prompt = f"a *dog* | [link](x) <img src=x> `{HOSTILE}"
    argv = ["--output_dir", str(out), "--pretrained_model_name_or_path", str(base), "--validation_prompt", prompt,
            "--instance_prompt", prompt, "--dataset_name", str(tmp_path),
            *(["--full_finetune"] if full else [])]  # fmt: skip
    cfg = _resolved(argv)
    front, body = _parts(write_model_card(out, cfg))
    text = summary(cfg, steps=1, pairs=False)
    for code in (_code(body), textwrap.dedent(text.split("with diffusers:\n", 1)[1])):
        tree = ast.parse(code)
        found = [c for c in ast.walk(tree) if isinstance(c, ast.Call)]
        calls = [
            (ast.unparse(c.func), [ast.unparse(a) for a in c.args], {k.arg: ast.unparse(k.value) for k in c.keywords})
            for c in found
        ]
        names = sorted(name for name, _, _ in calls)
        expected = ["logging.disable", "FluxPipeline.from_pretrained", "pipe", "pipe.to", "torch.cuda.is_available"]
        expected += ["image.save", "FluxTransformer2DModel.from_pretrained" if full else "pipe.load_lora_weights"]
        assert names == sorted(expected), names
        args = {name: (a, k) for name, a, k in calls}
        assert args["FluxPipeline.from_pretrained"][0] == [repr(str(base))]
        keywords = {"prompt": repr(prompt), "height": "1024", "width": "1024", "guidance_scale": "3.5"}
        assert args["pipe"] == ([], {**keywords, "num_inference_steps": "28"})
        loads = args["FluxTransformer2DModel.from_pretrained" if full else "pipe.load_lora_weights"][0]
        assert loads == ["folder"]
        constants = [n for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)]
        assigned = {t.id: ast.literal_eval(n.value) for n in constants for t in n.targets}
        assert assigned["folder"] == str(out)
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and
                    any(a.name == "os" for a in n.names)]  # fmt: skip
    assert front["instance_prompt"] == prompt  # YAML quotes it
    prose = body.replace(_code(body), "")
    span = r"(?<![`\\])(`+)(?!`)(.+?)(?<!`)\1(?!`)"  # a code span (not a backslash-escaped backtick): shown as it is
    assert ("``", prompt) in re.findall(span, prose), re.findall(span, prose)
    prose = re.sub(span, "", prose)
    for raw in ("<b>", "<img", "*dog*", "[link](x)", "| [", HOSTILE):
        assert not re.search(r"(?<!\\)" + re.escape(raw), prose), raw  # elsewhere escaped: text, never markup
    assert r"a \*dog\* \| \[link\](x) \<img src=x\>" in prose


def test_the_comfyui_note_of_a_flux2_card(tmp_path):
    """A FLUX.2 card's ComfyUI note: the diffusers-keyed LoRA goes in as for FLUX.1, the layers ComfyUI maps no name
    for are named when the run trained LoRAs on them, and a full fine-tune is not said to convert."""
    from flux_cp.families import FLUX2

    out = _run_folder(tmp_path, steps=())

    def note(argv: list[str]) -> str:
        cfg = resolved(parse_config(["--output_dir", str(out), *argv]), FLUX2, False, None)
        body = _parts(write_model_card(out, cfg, family=FLUX2))[1]
        return body.split("## Use it in ComfyUI", 1)[1].split("##", 1)[0]

    default = note([])
    assert "LoraLoaderModelOnly" in default and "which ComfyUI maps for Flux (FLUX.2 included)." in default
    assert "lora key not loaded" not in default
    modulation = note(["--lora_layers", "to_q,double_stream_modulation_img.linear"])
    assert (
        'no diffusers name for double_stream_modulation_img.linear: it leaves their LoRAs out ("lora key' in modulation
    )
    full = note(["--full_finetune"])
    assert "for FLUX.1 only: convert the transformer to BFL's layout for FLUX.2 first" in full
    flux1 = _parts(write_model_card(out, _resolved(["--output_dir", str(out)])))[1]
    assert "FLUX.2" not in flux1.split("## Use it in ComfyUI", 1)[1]


def test_a_flux2_card_names_its_family_and_loads_its_transformer_class(tmp_path):
    """A FLUX.2 card is not a FLUX.1 card: its title, recipe, tags and a full fine-tune's loading class are FLUX.2's."""
    from flux_cp.families import FLUX2

    out = _run_folder(tmp_path, steps=())
    lora = resolved(parse_config(["--output_dir", str(out)]), FLUX2, False, None)
    front, body = _parts(write_model_card(out, lora, family=FLUX2))
    assert body.lstrip().startswith("# FLUX.2 [dev] LoRA - ") and "diffusers' FLUX.2 [dev] training recipe" in body
    assert "flux2" in front["tags"] and "flux-kontext" not in front["tags"] and "FLUX.1" not in body
    full = resolved(parse_config(["--output_dir", str(out), "--full_finetune"]), FLUX2, False, None)
    code = _code(_parts(write_model_card(out, full, family=FLUX2))[1])
    assert "Flux2Transformer2DModel.from_pretrained(" in code and "FluxTransformer2DModel" not in code
    pairs = _parts(write_model_card(out, lora, pairs=True, family=FLUX2))[1]
    assert pairs.lstrip().startswith("# FLUX.2 [dev] LoRA") and "(FLUX.2 [dev] pairs)" in pairs
    code = _code(pairs)
    compile(code, "snippet", "exec")
    # Flux2Pipeline's first parameter is `image`: the prompt goes by name
    assert 'reference = load_image(f"{folder}/reference.png")' in code and "pipe(image=reference, prompt=" in code


def test_a_lora_of_a_random_initialised_base_is_not_published_as_one_for_the_pretrained_model(tmp_path):
    """--transformer_init random on a model that has weights: the card (as pushed: loading from the repository) names
    no base_model, says the base was random-initialised from the config, gives no ComfyUI note for the pretrained
    model, and its snippet - like the summary's - rebuilds that random base before loading the LoRA; the run's start
    and run_config.json say the same."""
    from flux_cp.model.lora import lora_origin
    from flux_cp.outputs.summary import summary
    from flux_cp.run.output_phase import base_weights
    from flux_cp.run.trainer import recipe_lines

    out = _run_folder(tmp_path)
    dev = ["--pretrained_model_name_or_path", "black-forest-labs/FLUX.1-dev", "--output_dir", str(out)]
    cfg = _resolved([*dev, "--transformer_init", "random", "--seed", "7"])
    front, body = _parts(write_model_card(out, cfg, repo_id="me/random-lora"))
    assert "base_model" not in front
    assert "LoRA weights (rank 16, alpha 16) for a random-initialised transformer with the config of" in body
    assert "the model's pretrained weights were not used, so the LoRA belongs to that random base" in body
    assert "| base weights | random-initialised from its config (--transformer_init random, seed 7) |" in body
    assert "## Use it in ComfyUI" not in body
    text = summary(cfg, steps=200, pairs=False, repo_id="me/random-lora")
    assert "so the LoRA belongs to that random base, not to the pretrained model" in text
    for code in (_code(body), textwrap.dedent(text.split("with diffusers", 1)[1].split(":\n", 1)[1])):
        compile(code, "snippet", "exec")
        assert (
            'transformer = build_random(FluxTransformer2DModel, config, dtype, torch.device(device), name_seed("'
            'transformer", 7))' in code
        )
        assert "FluxPipeline.from_pretrained(base, transformer=transformer, dtype=dtype)" in code
    assert any(
        line.startswith("--transformer_init random: the transformer is built from the config of")
        and "not its pretrained weights" in line
        for line in recipe_lines(cfg)
    )
    assert base_weights(cfg).startswith("random-initialised from the config (seed 7)")
    # the LoRA file's metadata names no base model either (diffusers' base_model, kohya's ss_sd_model_name)
    assert lora_origin(cfg, pairs=False).base_model is None
    pretrained = _resolved(dev)
    assert base_weights(pretrained) == "pretrained" and not recipe_lines(pretrained)
    assert lora_origin(pretrained, pairs=False).base_model == "black-forest-labs/FLUX.1-dev"
    assert "| base weights | pretrained |" in _parts(write_model_card(out, pretrained))[1]


def test_the_random_base_snippet_rebuilds_the_transformer_the_lora_trained_on(tmp_path, monkeypatch):
    """The snippet of a --transformer_init random card, run as it is on the tiny model (which has weights): its
    transformer is the one the trainer built (flux_cp.model.loading.load_transformer), not the model's pretrained
    weights, and the LoRA goes into it."""
    from flux_cp.families.flux1.tiny import ensure_tiny_pipeline, tiny_transformer
    from flux_cp.model.loading import load_transformer
    from flux_cp.model.lora import add_lora, lora_origin, save_lora

    out = _run_folder(tmp_path, steps=())
    flags = "--rank 4 --validation_inference_steps 2 --transformer_init random --seed 3".split()
    cfg = _resolved(["--output_dir", str(out), *flags])
    model = tiny_transformer()
    add_lora(model, cfg.lora, seed=0)
    lora = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    save_lora(model, lora, str(out), cfg.lora, FLUX1, lora_origin(cfg, pairs=False))
    code = _code(_parts(write_model_card(out, cfg))[1])
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a process of its own on a machine the test workers share
    try:
        exec(code, scope)  # noqa: S102 - our own snippet
    finally:
        torch.set_num_threads(threads)
        logging.disable(logging.NOTSET)  # the snippet's, for its own process
    path = ensure_tiny_pipeline()
    trained_on = load_transformer(cfg.model, path, type(model), torch.float32, torch.device("cpu"), 3)
    rebuilt = scope["pipe"].transformer
    assert torch.equal(rebuilt.x_embedder.weight, trained_on.x_embedder.weight)
    assert not torch.equal(rebuilt.x_embedder.weight, tiny_transformer().x_embedder.weight)  # not the pretrained one
    assert any("lora_A" in n for n, _ in rebuilt.named_parameters())
    assert scope["image"].size == (64, 64)


# flags (as typed) -> rows the card must hold, and the sentence the card and the summary both say (None: none)
NOTES = {
    "plain": ("", ["| base weights | pretrained |", "| base precision | bf16 (as loaded) |"], None),
    "int8": (
        "--base_precision int8",
        ["| base precision | int8: int8 (torchao, one byte per weight) |"],
        "The frozen base was stored in int8 (torchao, one byte per weight) while the LoRA trained",
    ),
    "nf4": (
        "--base_precision nf4",
        ["| base precision | nf4: 4-bit NormalFloat (bitsandbytes, as QLoRA) |"],
        "The frozen base was stored in 4-bit NormalFloat",
    ),
    "ema": (
        "--use_ema --ema_decay 0.99 --ema_update_interval 2",
        ["| EMA | the output (decay up to 0.99, every 2 steps) |"],
        "The LoRA is the exponential moving average of the trained weights (--use_ema: decay up to 0.99, updated "
        "every 2 steps)",
    ),
    "text-encoder": (
        "--train_text_encoder",
        [
            "| text encoder | CLIP LoRA, learning rate 5e-06 |",
            "of the CLIP text encoder (LoraLoaderModelOnly applies the transformer's)",
        ],
        "A LoRA of the CLIP text encoder trained beside the transformer's",
    ),
    "other": (
        "--weighting_scheme logit_normal --guidance_scale 1 --max_grad_norm 0.5 --random_flip --gradient_checkpointing "
        "all --lora_alpha 8 --encodings_dir /somewhere/private",
        [
            "| other settings | --random_flip, --gradient_checkpointing all, --max_grad_norm 0.5, --weighting_scheme "
            "logit_normal, --guidance_scale 1.0 |"
        ],
        None,
    ),
}


@pytest.mark.parametrize("case", list(NOTES))
def test_the_card_and_the_summary_say_what_the_weights_rest_on_and_every_setting_changed(tmp_path, case):
    """What differs from the plain case (a pretrained bf16 base, the raw weights) is said in the card and the
    summary alike: a quantized base, the EMA as the output, a text encoder's LoRA; every other flag that is not at its
    default is listed in the card (local paths aside: the card is published). The LoRA alpha shows in its own row."""
    from flux_cp.outputs.summary import summary

    typed, card, note = NOTES[case]
    flags = typed.split()
    out = _run_folder(tmp_path)
    if "nf4" in flags:
        pytest.importorskip("bitsandbytes")
    cfg = _resolved(["--output_dir", str(out), *flags])
    body = _parts(write_model_card(out, cfg))[1]
    plain = body.replace("\\", "")  # markdown's escapes (--max\_grad\_norm) aside
    for row in card:
        assert row in plain, plain
    text = summary(cfg, steps=200, pairs=False)
    if note is None:
        assert "other settings" not in plain or flags
        assert "/somewhere/private" not in body
    else:
        assert note in plain and note in text
    assert ("alpha 8" in plain) == ("--lora_alpha" in flags)


def test_the_snippet_of_several_references_pushed_to_the_hub_loads_them_from_the_repository(tmp_path):
    """A [klein] edit of two references, pushed: the card's lines load both reference images of the run from its
    repository (where the upload put them) in order, and name the image after the repository."""
    from flux_cp.families import FLUX2_KLEIN
    from flux_cp.hub import PUBLISHED

    out = _run_folder(tmp_path, steps=())
    cfg = resolved(
        parse_config(["--output_dir", str(out), "--validation_prompt", "make it red"]), FLUX2_KLEIN, True, None
    )
    names = reference_names(2)
    assert names == ("reference-1.png", "reference-2.png") and reference_names(1) == ("reference.png",)
    assert all(any(fnmatch.fnmatch(n, p) for p in PUBLISHED) for n in (*names, "reference.png", "reference-99.png"))
    card = write_model_card(out, cfg, pairs=True, family=FLUX2_KLEIN, repo_id="me/edits", references=names)
    code = _code(_parts(card)[1])
    compile(code, "snippet", "exec")
    assert "from huggingface_hub import hf_hub_download" in code and "repo = 'me/edits'" in code
    loads = ", ".join(f"load_image(hf_hub_download(repo, {n!r}))" for n in names)
    assert f"reference = [{loads}]" in code
    assert "image = pipe(image=reference, prompt='make it red', height=" in code
    assert code.endswith("image.save('edits.png')\n")


def test_folders_given_relative_are_named_by_their_absolute_paths(tmp_path, monkeypatch):
    """A run launched with relative folders (as the README's FLUX.2 demo gives them): the card's lines name the base
    model folder, the output folder and the download cache by absolute paths, so that they run from the output
    folder as from where the run was launched."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "base").mkdir(parents=True)
    out = _run_folder(tmp_path, steps=(), name="out")
    cfg = _resolved(["--pretrained_model_name_or_path", "models/base", "--output_dir", "out"])
    code = _code(_parts(write_model_card("out", cfg))[1])
    assert f"FluxPipeline.from_pretrained({str(tmp_path / 'models' / 'base')!r}, dtype=dtype)" in code
    assert f"folder = {str(out)!r}  # the run's output folder" in code
    hub = _resolved(["--pretrained_model_name_or_path", "someone/flux", "--cache_dir", "hf", "--revision", "v2"])
    code = _code(_parts(write_model_card("out", hub))[1])
    assert f"from_pretrained('someone/flux', revision='v2', cache_dir={str(tmp_path / 'hf')!r}, dtype=dtype)" in code


def test_control_characters_of_prompts_and_names_are_escaped_in_the_card_and_its_snippet_keeps_the_prompt(tmp_path):
    """`cat README.md` (and the Hub page) runs no terminal escape from a prompt, folder or data set name: every
    control character of the card is written as its escape, while the snippet's literals stay valid Python equal to
    the prompt, and the front matter's YAML reads back the prompt itself."""
    import ast

    evil = "a \x1b[2J\x1b[31mred\x07 dog\r\u202e"
    out = tmp_path / f"out{evil}"
    (tmp_path / f"data{evil}").mkdir()
    (out / "validation").mkdir(parents=True)
    (out / "validation" / "step-000001.png").write_bytes(b"\x89PNG")
    cfg = _resolved(
        [
            "--output_dir",
            str(out),
            "--validation_prompt",
            evil,
            "--instance_prompt",
            evil,
            "--dataset_name",
            str(tmp_path / f"data{evil}"),
            "--with_prior_preservation",
            "--class_data_dir",
            str(tmp_path / "class"),
            "--class_prompt",
            evil,
        ]
    )
    for name in ("README.md", "README.flux-cp.md"):
        path = write_model_card(out, cfg, filename=name)
        text = path.read_text()
        assert all(c.isprintable() or c == "\n" for c in text), [c for c in text if not c.isprintable() and c != "\n"]
        front, body = _parts(path)
        assert front["instance_prompt"] == evil and front["widget"][0]["text"] == evil
        calls = {ast.unparse(c.func): c for c in ast.walk(ast.parse(_code(body))) if isinstance(c, ast.Call)}
        prompt = next(k.value for k in calls["pipe"].keywords if k.arg == "prompt")  # by name: FLUX.2's first is image
        assert ast.literal_eval(prompt) == evil
        # the prose shows the prompt with its escapes written out (Markdown-escaped: a backslash is doubled)
        assert "1. a \\\\x1b\\[2J\\\\x1b\\[31mred\\\\x07 dog" in body, body
