"""`--push_to_hub` without a network: the upload call (folder, repository, what stays local), and one clear line,
fast, when the hub refuses the token or cannot be reached."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import filter_repo_objects

from flux_cp import hub
from flux_cp.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


# What a push sends: the run's final outputs, and nothing else a folder of a run holds.
PUBLISHED = {"pytorch_lora_weights.safetensors", "README.md", "metrics.jsonl", "loss_curve.png",
             "validation/step-000000.png", "validation/step-000200.png", "reference-1.png",
             "reference-2.png"}  # fmt: skip


def _run_folder(root: Path) -> Path:
    """An output folder as a LoRA run leaves it, after a branch resume, with the user's own files (files empty:
    only their names matter here)."""
    out = root / "dog-lora"
    for rel in (*PUBLISHED, "run_config.json", "checkpoint-100/meta.json", "checkpoint-100/data.json",
                "checkpoint-200/state/__0_0.distcp", "checkpoint-200/train.pt", ".checkpoint-300.partial/meta.json",
                ".flux_cp.lock", ".flux_cp_manifest.json", ".pytorch_lora_weights.safetensors.partial/x.safetensors",
                ".run_config.json.ab12.tmp", "logs/flux-cp/events.out.tfevents.1", "tb/events.out.tfevents.2",
                "profile/rank0.json", "wandb/run-1/files/config.yaml",
                "abandoned-20250101-120000/checkpoint-300/meta.json",
                "abandoned-20250101-120000/checkpoint-300/data.json",
                "abandoned-20250101-120000/pytorch_lora_weights.safetensors",
                "abandoned-20250101-120000/validation/step-000300.png", "abandoned-20250101-120000/metrics.jsonl",
                "README.flux-cp.md", "notes.txt", "validation/my_notes.txt", "cache/latents/0.safetensors",
                "transformer.bak/config.json", "reference-old.png", "reference.jpg", "checkpoint-200/reference.png",
                "checkpoint-200/pytorch_lora_weights.safetensors"):  # fmt: skip
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(b"")
    return out


class _Hub:
    """HfApi's network methods, recorded instead of sent."""

    def __init__(self, monkeypatch, whoami_error: Exception | None = None):
        self.calls: list[tuple[str, dict]] = []

        def whoami(api, *a, **kw):
            self.calls.append(("whoami", {"token": api.token}))
            if whoami_error is not None:
                raise whoami_error
            return {"name": "me"}

        def create_repo(api, repo_id, **kw):
            self.calls.append(("create_repo", {"repo_id": repo_id, **kw}))
            return type("RepoUrl", (), {"repo_id": repo_id if "/" in repo_id else f"me/{repo_id}"})()

        def upload_folder(api, **kw):
            self.calls.append(("upload_folder", kw))

        for name, fn in (("whoami", whoami), ("create_repo", create_repo), ("upload_folder", upload_folder)):
            monkeypatch.setattr(HfApi, name, fn)

    def call(self, name: str) -> dict:
        (kw,) = [kw for n, kw in self.calls if n == name]
        return kw


def _uploaded(folder: Path, allow: list[str]) -> set[str]:
    """The files huggingface_hub's upload_folder sends with these allow patterns (its own filter)."""
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    return set(filter_repo_objects(files, allow_patterns=allow))


def test_push_uploads_the_run_s_final_outputs_only(tmp_path, monkeypatch):
    """An allow-list: the weights, the card, the validation images, the metrics and loss curve. Never checkpoints
    (weights, optimizer state, data.json listing every file name and caption), abandoned branches, the manifest,
    the lock, partial writes, logs, profiles, run_config.json (local paths), the encoding cache or the user's
    files."""
    out = _run_folder(tmp_path)
    fake = _Hub(monkeypatch)
    url = hub.push_to_hub(str(out), "me/dog-lora", "hf_token", private=True)
    assert url == "https://huggingface.co/me/dog-lora"
    assert [n for n, _ in fake.calls] == ["whoami", "create_repo", "upload_folder"]
    assert fake.call("whoami")["token"] == "hf_token"
    assert fake.call("create_repo") == {"repo_id": "me/dog-lora", "private": True, "exist_ok": True}
    upload = fake.call("upload_folder")
    assert upload["repo_id"] == "me/dog-lora" and upload["folder_path"] == str(out)
    assert "ignore_patterns" not in upload
    assert _uploaded(out, upload["allow_patterns"]) == PUBLISHED


def test_a_full_fine_tune_uploads_its_transformer_folder(tmp_path, monkeypatch):
    out = tmp_path / "full"
    model = ["transformer/config.json", "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
             "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
             "transformer/diffusion_pytorch_model.safetensors.index.json"]  # fmt: skip
    for rel in (*model, "README.md", "transformer/notes.txt", "abandoned-20250101-120000/transformer/config.json"):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(b"")
    fake = _Hub(monkeypatch)
    hub.push_to_hub(str(out), "me/full", "hf_token")
    assert _uploaded(out, fake.call("upload_folder")["allow_patterns"]) == {*model, "README.md"}


def test_the_repository_defaults_to_the_folder_name(tmp_path, monkeypatch):
    out = _run_folder(tmp_path)
    fake = _Hub(monkeypatch)
    named = []
    hub.push_to_hub(str(out), None, None, on_repo=lambda repo_id: named.append((repo_id, [n for n, _ in fake.calls])))
    assert fake.call("create_repo")["repo_id"] == "dog-lora"  # in the token owner's namespace, as diffusers does
    assert fake.call("upload_folder")["repo_id"] == "me/dog-lora"
    assert named == [("me/dog-lora", ["whoami", "create_repo"])]  # the full id, before the upload (the card)


def _http_error(status: int) -> HfHubHTTPError:
    response = httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/whoami-v2"))
    return HfHubHTTPError(f"{status} Client Error", response=response)


@pytest.mark.parametrize(
    "error, message",
    [
        (_http_error(401), "--push_to_hub: the Hugging Face Hub refused the token (401): log in with `hf auth login`"),
        (_http_error(403), "--push_to_hub: the token may not write to me/dog (403)"),
        (httpx.ConnectError("[Errno 111] Connection refused"),
         "--push_to_hub: could not reach the Hugging Face Hub ([Errno 111] Connection refused); the outputs are in"),
    ],
)  # fmt: skip
def test_a_refused_token_or_an_unreachable_hub_is_one_line(tmp_path, monkeypatch, error, message):
    _Hub(monkeypatch, whoami_error=error)
    with pytest.raises(UsageError) as e:
        hub.push_to_hub(str(_run_folder(tmp_path)), "me/dog", "hf_bad")
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


# As the trainer's runner reports a UsageError (flux_cp.run.runner), without importing torch for it.
_PUSH = """
import sys, time
from flux_cp.errors import UsageError
from flux_cp.hub import push_to_hub
start = time.monotonic()
try:
    push_to_hub(sys.argv[1], "me/dog", "hf_fake")
    code = 0
except UsageError as e:
    print(f"error: {e}", file=sys.stderr)
    code = 2
print(f"{time.monotonic() - start:.2f}")
sys.exit(code)
"""


OFFLINE, DOWN = {"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}


@pytest.mark.parametrize("env", [OFFLINE, DOWN], ids=["offline", "down"])
def test_the_real_client_fails_fast_with_one_line_when_the_hub_cannot_be_reached(tmp_path, env):
    """huggingface_hub itself (no fakes), in a process of its own (it reads these variables at import): one line,
    in well under a second of calls (no retries; the time includes importing huggingface_hub)."""
    out = _run_folder(tmp_path)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    r = subprocess.run([sys.executable, "-c", _PUSH, str(out)], capture_output=True, text=True, cwd=ROOT,
                       env={**clean, **env}, timeout=120)  # fmt: skip
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: --push_to_hub: could not reach the Hugging Face Hub ("), lines[0]
    assert "Traceback" not in r.stderr
    assert float(r.stdout.strip()) < 5.0, f"took {r.stdout.strip()} s"


def test_token_comes_from_the_flag_then_huggingface_hub(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "none"))
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert hub.token("hf_flag") == "hf_flag" and hub.token(None) == "hf_env"
    monkeypatch.delenv("HF_TOKEN")
    assert hub.token(None) is None
    with pytest.raises(UsageError, match="needs a Hugging Face token"):
        hub.check_token(None)


@pytest.mark.e2e
def test_a_run_given_hub_token_writes_it_nowhere(tmp_path):
    """run_config.json, checkpoints' meta.json, metrics and the tensorboard logs of a run with --hub_token hold no
    trace of it (the flag is secret: Config.flat() leaves it out)."""
    from tests.launch import ok, run_args, train

    secret = "hf_do_not_write_me_0123456789"
    args = run_args(tmp_path, "run", 2, "--hub_token", secret, "--checkpointing_steps", "1", "--report_to",
                    "tensorboard")  # fmt: skip
    r = ok(train(1, *args))
    assert "warning: --hub_token has no effect without --push_to_hub" in r.stderr
    out = tmp_path / "run"
    written = [p for p in out.rglob("*") if p.is_file()]
    names = {p.relative_to(out).as_posix() for p in written}
    assert {"run_config.json", "checkpoint-1/meta.json", "metrics.jsonl"} <= names
    assert any(n.startswith("logs/") for n in names), names
    assert not [p for p in written if secret.encode() in p.read_bytes()]
    assert secret not in r.stdout + r.stderr


def test_what_would_fail_the_upload_is_refused_at_start(monkeypatch, tmp_path):
    """--push_to_hub in offline mode, without a token, or to a repository name the Hub refuses: one line at start,
    before any training (they failed only after the run, with no model card and no summary)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_TOKEN", "x")
    with pytest.raises(UsageError, match=r"^--push_to_hub with HF_HUB_OFFLINE set: the upload at the end could not "):
        hub.check_start(None, None, str(tmp_path / "out"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub.check_start("me/dog-lora", None, str(tmp_path / "out"))
    hub.check_start(None, None, str(tmp_path / "dog_lora.v2"))
    for bad in ("me/dog lora", "a/b/c", "me/dog--x", "-dog", "x" * 97):
        with pytest.raises(UsageError, match=rf"^--push_to_hub: --hub_model_id '{bad}' is not a Hub repository name"):
            hub.check_start(bad, None, str(tmp_path / "out"))
    with pytest.raises(UsageError, match=r"^--push_to_hub: the repository name 'my run' \(--output_dir's folder\) is "
                       r"not a Hub repository name: .*, or pass --hub_model_id$"):  # fmt: skip
        hub.check_start(None, None, str(tmp_path / "my run"))
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "none"))
    with pytest.raises(UsageError, match="^--push_to_hub needs a Hugging Face token"):
        hub.check_start("me/dog", None, str(tmp_path / "out"))
