"""Run records: the contract every other script reads. See docs/RECORD.md for the schema.

runs/<run-name>/
  record.json    settings, environment, data, model, status, summary (rewritten atomically)
  steps.jsonl    one JSON line per logged optimizer step
  checkpoints/   Accelerate save_state folders (with --save-every)
Only the main process writes. Secrets never land here: values of the environment's credentials
are scrubbed from everything written, and URLs lose their user:password@ and query strings.
"""

import json
import os
import re
import tempfile
from datetime import datetime, timezone
from pathlib import Path

SCHEMA_VERSION = 1
RECORD_FILE = "record.json"
STEPS_FILE = "steps.jsonl"
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL|AUTH", re.I)
_SECRET_VALUE_MIN_LENGTH = 8


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def secret_values(environ=None) -> list[str]:
    """Values of environment variables that name credentials (HF_TOKEN, WANDB_API_KEY, ...)."""
    environ = os.environ if environ is None else environ
    values = {v for k, v in environ.items() if _SECRET_NAME.search(k) and len(v) >= _SECRET_VALUE_MIN_LENGTH}
    return sorted(values, key=len, reverse=True)


def scrub(value, secrets: list[str] | None = None):
    """A copy of `value` (nested dicts, lists, strings) with every secret replaced by '***'."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, "***")
        return value
    if isinstance(value, dict):
        return {scrub(k, secrets): scrub(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v, secrets) for v in value]
    return value


def write_json_atomic(path: Path, data) -> None:
    """Write JSON to a temporary file beside `path`, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(scrub(data), handle, indent=2, sort_keys=False, default=str)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


class RunRecord:
    """The main process's writer for one run directory."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.data: dict = {"schema_version": SCHEMA_VERSION}
        self._secrets = secret_values()

    @property
    def path(self) -> Path:
        return self.directory / RECORD_FILE

    @property
    def steps_path(self) -> Path:
        return self.directory / STEPS_FILE

    def update(self, **fields) -> None:
        self.data.update(fields)
        write_json_atomic(self.path, self.data)

    def append_step(self, line: dict) -> None:
        with open(self.steps_path, "a") as handle:
            handle.write(json.dumps(scrub(line, self._secrets), default=str) + "\n")

    def truncate_steps(self, after_step: int) -> None:
        """Drop step lines past `after_step` (written after the checkpoint a resumed run restarts from)."""
        if not self.steps_path.exists():
            return
        kept = [line for line in read_steps(self.directory) if line["step"] <= after_step]
        temporary = self.steps_path.with_suffix(".tmp")
        temporary.write_text("".join(json.dumps(line) + "\n" for line in kept))
        os.replace(temporary, self.steps_path)


def read_record(directory: Path) -> dict:
    """Load and check a run record; raises ValueError naming the file when it is not one of ours."""
    path = Path(directory) / RECORD_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable run record ({error})") from None
    if not isinstance(record, dict) or "schema_version" not in record:
        raise ValueError(f"{path}: not a trainscope run record (no schema_version)")
    if record["schema_version"] > SCHEMA_VERSION:
        raise ValueError(f"{path}: schema_version {record['schema_version']} is newer than this trainscope reads")
    return record


def read_steps(directory: Path) -> list[dict]:
    path = Path(directory) / STEPS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
