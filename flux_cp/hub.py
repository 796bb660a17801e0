"""The Hugging Face Hub: its offline mode and tokens; a model's config read from the local HF cache or in one short
attempt from the Hub (`read_cached_json`, `read_json`: what --plan reads of a hub id without downloading the model);
and uploading a run's final outputs (`--push_to_hub`), as diffusers' training examples do: create the model
repository (or reuse it) and upload the output folder's published files (`PUBLISHED`). Failures the user can fix (no
token, a refused token, no network, offline mode) are one UsageError line; the calls that tell first (`whoami`,
`create_repo`) make one attempt, so an unreachable hub fails in well under a second instead of after
huggingface_hub's retries.

Only huggingface_hub is imported here (no torch), so a push can also run on its own:
`python -c "from flux_cp.hub import push_to_hub; push_to_hub('OUTPUT_DIR', 'me/my-lora', None)"`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flux_cp.errors import UsageError

# What a push uploads, relative to the output folder (fnmatch patterns, as huggingface_hub's upload_folder takes
# them): an allow-list of the run's final outputs, what a user publishes - the trained weights (LoRA file, or a full
# fine-tune's transformer/ files), the model card, the reference images its lines edit (a pair run's, by the names
# flux_cp.outputs.card.reference_names gives them), the validation images, the metrics and the loss curve. Anything
# else a run's folder holds stays local, whatever its name: checkpoints (weights, optimizer state, and data.json
# listing every training file's name and caption), branches set aside (abandoned-*), the manifest, the lock, partial
# writes, tracker logs, profiles, run_config.json (the run's local paths), and the user's own files.
PUBLISHED = (
    "pytorch_lora_weights.safetensors",
    "README.md",
    "transformer/config.json",
    "transformer/diffusion_pytorch_model*.safetensors",
    "transformer/diffusion_pytorch_model.safetensors.index.json",
    "validation/step-*.png",
    "metrics.jsonl",
    "loss_curve.png",
    "reference.png",
    "reference-[0-9].png",
    "reference-[0-9][0-9].png",
)

LOGIN_HINT = "log in with `hf auth login` (or set HF_TOKEN)"


def token(hub_token: str | None) -> str | None:
    """The token a push would use: `--hub_token`, else huggingface_hub's (HF_TOKEN, then the stored login)."""
    if hub_token:
        return hub_token
    from huggingface_hub import get_token

    return get_token()


def check_token(hub_token: str | None) -> None:
    """At start: a UsageError when `--push_to_hub` could not get any token (nothing is sent anywhere)."""
    if token(hub_token) is None:
        raise UsageError(f"--push_to_hub needs a Hugging Face token: {LOGIN_HINT}, or pass --hub_token")


def offline() -> bool:
    """Whether huggingface_hub runs offline (HF_HUB_OFFLINE, read when it was imported or set since)."""
    import os

    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def read_cached_json(
    repo_id: str, filename: str, revision: str | None = None, cache_dir: str | None = None
) -> dict | None:
    """A hub repository's JSON file from the local HF cache (`cache_dir`: --cache_dir's, else the default), None when
    it is not there; a ValueError when `repo_id` is no hub id."""
    import json

    import huggingface_hub  # the hub client at first use
    from huggingface_hub.errors import HFValidationError

    try:
        cached = huggingface_hub.try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir, revision=revision)
    except HFValidationError as e:
        raise ValueError(str(e)) from None
    if not isinstance(cached, str):
        return None
    with open(cached) as f:
        return json.load(f)


def read_json(repo_id: str, filename: str, revision: str | None = None, cache_dir: str | None = None) -> dict:
    """A hub repository's JSON file from the Hub in one attempt with a short timeout (hf_hub_download alone retries for
    ~30 s when the hub is unreachable), kept in the download cache; an OSError saying why on one line when it cannot be
    read."""
    import json

    import httpx  # the hub client's transport, at first use
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    try:
        url = huggingface_hub.hf_hub_url(repo_id, filename, revision=revision)
        huggingface_hub.get_hf_file_metadata(url, timeout=10)
        local = huggingface_hub.hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir)
    except (HfHubHTTPError, httpx.HTTPError, OSError, ValueError) as e:
        raise OSError(" ".join(str(e).split())[:200] or type(e).__name__) from None
    with open(local) as f:
        return json.load(f)


def repo_name(hub_model_id: str | None, output_dir: str) -> str:
    """The repository a push goes to as given: --hub_model_id, else the output folder's name (diffusers' examples)."""
    return hub_model_id or Path(output_dir).resolve().name


def check_start(hub_model_id: str | None, hub_token: str | None, output_dir: str) -> None:
    """At start, for `--push_to_hub`: what would make the upload at the end fail whatever the training does, as one
    UsageError line (nothing is sent anywhere): offline mode, no token, a repository name the Hub refuses."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if offline():
        raise UsageError(
            "--push_to_hub with HF_HUB_OFFLINE set: the upload at the end could not reach the Hub. Unset "
            "HF_HUB_OFFLINE, or drop --push_to_hub and upload the output folder later with `hf upload`"
        )
    check_token(hub_token)
    name = repo_name(hub_model_id, output_dir)
    try:
        validate_repo_id(name)
    except HFValidationError:
        given = f"--hub_model_id {name!r}" if hub_model_id else f"the repository name {name!r} (--output_dir's folder)"
        raise UsageError(
            f"--push_to_hub: {given} is not a Hub repository name: use name or owner/name of letters, digits, '-', "
            "'_' and '.' (not starting or ending with '-' or '.', no '--' or '..', at most 96 characters)"
            + ("" if hub_model_id else ", or pass --hub_model_id")
        ) from None


def _network_errors() -> tuple[type[BaseException], ...]:
    """Exceptions meaning the hub could not be reached: huggingface_hub's offline mode, httpx's transport errors
    (huggingface_hub's HTTP client), requests' and the OS's connection errors."""
    import httpx
    from huggingface_hub.errors import OfflineModeIsEnabled

    errors: list[type[BaseException]] = [OfflineModeIsEnabled, httpx.TransportError, ConnectionError, TimeoutError]
    try:
        import requests

        errors.append(requests.exceptions.RequestException)
    except ImportError:  # pragma: no cover - requests comes with the other libraries
        pass
    return tuple(errors)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] if text else type(e).__name__


def push_to_hub(
    output_dir: str,
    hub_model_id: str | None,
    token: str | None,
    private: bool = False,
    commit_message: str = "End of training",
    on_repo: Callable[[str], None] | None = None,
) -> str:
    """Upload `output_dir` to the model repository `hub_model_id` (`name` or `owner/name`; None: the output folder's
    name, in the token owner's namespace, as diffusers' examples do), creating it when missing. `token`: None uses
    huggingface_hub's own (HF_TOKEN, the stored login). Only the files `PUBLISHED` names are sent.
    `on_repo(repo_id)`: called with the repository's full id (`owner/name`) once it exists, before the upload (to
    write the model card naming it: flux_cp.outputs.card). Call it on one process. Returns the repository's URL. A hub
    that cannot be reached or refuses the token is a one-line UsageError."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    folder = Path(output_dir)
    if not folder.is_dir():
        raise UsageError(f"--push_to_hub: {folder} is not a folder")
    repo_id = repo_name(hub_model_id, str(folder))
    api = HfApi(token=token)
    step = "reach the Hugging Face Hub"
    try:
        api.whoami()  # one request: says at once whether the hub answers and takes the token
        step = f"create or find the model repository {repo_id}"
        repo = api.create_repo(repo_id, private=private, exist_ok=True)
        if on_repo is not None:
            on_repo(repo.repo_id)
        step = f"upload {folder} to {repo.repo_id}"
        api.upload_folder(
            repo_id=repo.repo_id,
            folder_path=str(folder),
            commit_message=commit_message,
            allow_patterns=list(PUBLISHED),
        )
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        if status == 401:
            raise UsageError(f"--push_to_hub: the Hugging Face Hub refused the token (401): {LOGIN_HINT}") from None
        if status == 403:
            raise UsageError(
                f"--push_to_hub: the token may not write to {repo_id} (403): use a token with write access, or "
                "--hub_model_id in a namespace it may write to"
            ) from None
        raise UsageError(f"--push_to_hub: could not {step}: {_one_line(e)}") from None
    except _network_errors() as e:
        raise UsageError(
            f"--push_to_hub: could not {step} ({_one_line(e)}); the outputs are in {folder}: upload them later "
            "with `hf upload`"
        ) from None
    return f"{api.endpoint}/{repo.repo_id}"
