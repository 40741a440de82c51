"""Trackers through Accelerate (W&B, TensorBoard). The run record stays the source of truth.

W&B never blocks or fails a run: without an API key, or without a route to its server, it runs
offline and writes under the run directory (`wandb sync` uploads it later).
"""

import netrc
import os
import socket
from urllib.parse import urlparse

from trainscope.core.records import scrub

WANDB_DEFAULT_HOST = "https://api.wandb.ai"


def wandb_has_key(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_API_KEY"):
        return True
    try:
        host = urlparse(environ.get("WANDB_BASE_URL", WANDB_DEFAULT_HOST)).hostname
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_reachable(timeout_s: float = 2.0, environ=None) -> bool:
    environ = os.environ if environ is None else environ
    url = urlparse(environ.get("WANDB_BASE_URL", WANDB_DEFAULT_HOST))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def wandb_mode(environ=None) -> str:
    """WANDB_MODE when set; else online only with a key and a route to the server."""
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    if environ.get("WANDB_DISABLED", "").lower() in ("1", "true"):
        return "disabled"
    return "online" if wandb_has_key(environ) and wandb_reachable(environ=environ) else "offline"


def trackers_for(report_to: str) -> list[str]:
    return {"none": [], "wandb": ["wandb"], "tensorboard": ["tensorboard"], "all": ["wandb", "tensorboard"]}[report_to]


def init_kwargs(trackers: list[str], run_name: str, run_dir, group: str | None = None) -> tuple[dict, dict]:
    """Per-tracker init kwargs for `accelerator.init_trackers`, and what to record about them."""
    kwargs, facts = {}, {}
    if "wandb" in trackers:
        import wandb

        mode = wandb_mode()
        kwargs["wandb"] = {
            "name": run_name,
            "dir": str(run_dir),
            "mode": mode,
            "group": group,
            # no command line, git remote or code snapshot: they can carry tokens
            "settings": wandb.Settings(x_disable_meta=True, disable_git=True, save_code=False, silent=True),
        }
        facts["wandb"] = {"mode": mode, "group": group}
    if "tensorboard" in trackers:
        facts["tensorboard"] = {"logdir": str(run_dir / "tensorboard")}
    return kwargs, facts


def flat_config(settings: dict) -> dict:
    """Tracker configs take scalars: lists become comma-joined strings, None becomes 'none'; redacted
    like everything trainscope writes."""
    flat = {}
    for key, value in scrub(settings).items():
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        flat[key] = "none" if value is None else value
    return flat
