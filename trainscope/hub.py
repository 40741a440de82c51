"""Hub access that fails fast: offline, a hub name resolves from the local cache or ends in one line.

Without this, every hub lookup on a machine with no network retries for about 25 seconds before
giving up. One short TCP probe decides instead; when the Hub is unreachable the libraries are put
in their own offline mode (HF_HUB_OFFLINE), so cached models and datasets still load.
"""

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


def use_offline_mode_if_unreachable() -> bool:
    """Switch huggingface_hub, datasets and transformers to offline mode when the Hub is unreachable.

    Returns True when working offline. Child processes (DataLoader workers) inherit the variable.
    """
    if hub_reachable():
        return False
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets.config
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    return True
