"""Hub access that fails fast: offline, a hub name resolves from the local cache or ends in one line.

Without this, every hub lookup on a machine with no network retries for about 25 seconds before
giving up. One short TCP probe decides instead. Offline mode is switched on only around the one
load call that needs the Hub (`offline_if_unreachable`) and restored after it: a process-wide
switch would also make `datasets` refuse fsspec URLs (memory://, s3://, https://) loaded later.
"""

import contextlib
import os
import socket
from functools import lru_cache
from urllib.parse import urlparse


def offline_requested() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


@lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 2.0) -> bool:
    if offline_requested():
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname, port), timeout=timeout_s):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def offline_if_unreachable():
    """Inside the block, huggingface_hub, transformers and datasets work from the local cache when the Hub
    is unreachable (yields True then); their offline switches are restored on the way out."""
    if hub_reachable():
        yield False
        return
    import datasets.config
    import huggingface_hub.constants

    saved = huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    huggingface_hub.constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield True
    finally:
        huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved
