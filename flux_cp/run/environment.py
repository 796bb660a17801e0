"""The environment a run starts in: every `FLUX_CP_*` variable of the trainer checked, and the credentials of the
trackers asked for, before any model loads, each problem as one line naming the variable.

Checked: FLUX_CP_HOME (a folder, or a path one can be made at), FLUX_CP_DISK_BYTES (a whole number of bytes),
FLUX_CP_FAULT (rank=R,step=S,kind=K); FLUX_CP_DEBUG takes any value. The switches of the CP kernels and exchanges
are read (and refused when wrong) where they apply.

`--report_to wandb` (and `all` with wandb installed) needs a login unless wandb runs offline or disabled: wandb
reads the API key from WANDB_API_KEY (or an identity token file), else from the netrc file (`wandb login` writes
`~/.netrc`, or the file NETRC names) for the host of WANDB_BASE_URL; `wandb offline` sets the mode in its settings
file. Without one the run would stop only after the
models loaded and the data was encoded; here it is one line at start. No network call is made.
"""

from __future__ import annotations

import configparser
import importlib.util
import netrc
import os
from pathlib import Path
from urllib.parse import urlsplit

from flux_cp.errors import UsageError
from flux_cp.plan import diskspace
from flux_cp.run import faults

WANDB_HOST = "https://api.wandb.ai"


def check_environment(report_to: str = "none") -> None:
    """Refuse a bad FLUX_CP_* value, or wandb tracking without a login, with one line (before anything loads)."""
    home = os.environ.get("FLUX_CP_HOME")
    if home:
        path = Path(home).expanduser()
        existing = path
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        if not existing.is_dir():
            what = "names a file" if existing == path else f"is under the file {existing}"
            raise UsageError(
                f"FLUX_CP_HOME={home} {what}, not a folder: point it at a folder (the tiny default model is built "
                "there), or unset it for ~/.cache/flux_cp"
            )
    diskspace.pretend_bytes()
    if os.environ.get("FLUX_CP_FAULT"):
        faults.parse(os.environ["FLUX_CP_FAULT"])
    if report_to == "wandb" or (report_to == "all" and importlib.util.find_spec("wandb") is not None):
        check_wandb_login()


def _netrc_path() -> Path:
    """The netrc file wandb reads: NETRC, else ~/.netrc (else ~/_netrc when only that exists)."""
    if os.environ.get("NETRC"):
        return Path(os.environ["NETRC"]).expanduser()
    home = Path.home()
    if not (home / ".netrc").exists() and (home / "_netrc").exists():
        return home / "_netrc"
    return home / ".netrc"


def _wandb_settings() -> dict[str, str]:
    """`mode` and `base_url` from wandb's settings files (`wandb offline` / `wandb login --host` write them): the
    global one (WANDB_CONFIG_DIR or ~/.config/wandb), then the workspace's (WANDB_DIR or ./, under wandb/)."""
    folder = os.environ.get("WANDB_CONFIG_DIR") or os.path.join(Path.home(), ".config", "wandb")
    paths = [Path(folder) / "settings", Path(os.environ.get("WANDB_DIR") or ".") / "wandb" / "settings"]
    parser = configparser.ConfigParser()
    for path in paths:
        try:
            parser.read(path)
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue
    return dict(parser["default"]) if parser.has_section("default") else {}


def _wandb_host(settings: dict[str, str]) -> str:
    return urlsplit(os.environ.get("WANDB_BASE_URL") or settings.get("base_url") or WANDB_HOST).netloc


def wandb_logged_in() -> bool:
    """Whether wandb will find credentials or needs none (offline or disabled), without contacting it."""
    settings = _wandb_settings()
    mode = (os.environ.get("WANDB_MODE") or settings.get("mode") or "").strip().lower()
    if mode in ("offline", "dryrun", "disabled") or os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1"):
        return True
    if os.environ.get("WANDB_API_KEY", "").strip() or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        entry = netrc.netrc(str(_netrc_path())).authenticators(_wandb_host(settings))
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def check_wandb_login() -> None:
    if not wandb_logged_in():
        raise UsageError(
            f"--report_to wandb: no wandb login found (no WANDB_API_KEY, no entry for {_wandb_host(_wandb_settings())} "
            f"in {_netrc_path()}): run `wandb login`, set WANDB_MODE=offline to log to local files, or choose "
            "--report_to tensorboard"
        )
