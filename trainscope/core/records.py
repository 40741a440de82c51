"""Run records and every file trainscope writes: the one place that redacts secrets (the environment's credentials;
user:password@, query strings and fragments of every URL), writes atomically and checks schemas. Every writer goes
through `write_json_atomic` / `write_text_atomic` / `RunRecord`; only the main process writes. The layout of
runs/<run-name>/ (record.json, steps.jsonl, checkpoints/) and the schema: docs/RECORD.md."""

import json
import os
import re
import sys
import threading
import uuid
from datetime import datetime, timezone
from pathlib import Path

SCHEMA_VERSION = 6
READABLE_SCHEMAS = (1, 2, 3, 4, 5, 6)
RECORD_FILE = "record.json"
STEPS_FILE = "steps.jsonl"
# What a complete record must hold for the readers (report, advisor, tune) to use it.
REQUIRED_COMPLETE = ("run_name", "settings", "environment", "summary")
REQUIRED_SUMMARY = ("world_size", "timing", "throughput", "memory", "test")
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL|AUTH", re.I)
_SECRET_VALUE_MIN_LENGTH = 8
# scheme://[userinfo@]rest[?query][#fragment]; rest stops at white space and quotes
_URL = re.compile(
    r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<userinfo>[^\s/@'\"<>]*@)?"
    r"(?P<rest>[^\s?#'\"<>]*)(?P<query>\?[^\s#'\"<>]*)?(?P<fragment>#[^\s'\"<>]*)?"
)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def secret_values(environ=None) -> list[str]:
    """Values of environment variables that name credentials (HF_TOKEN, WANDB_API_KEY, ...)."""
    environ = os.environ if environ is None else environ
    values = {v for k, v in environ.items() if _SECRET_NAME.search(k) and len(v) >= _SECRET_VALUE_MIN_LENGTH}
    return sorted(values, key=len, reverse=True)


def redact(text: str, secrets: list[str] | None = None) -> str:
    """`text` without credential values and without URL credentials, query strings or fragments."""
    if "://" in text:
        text = _URL.sub(lambda m: m["scheme"] + m["rest"], text)
    for secret in secret_values() if secrets is None else secrets:
        text = text.replace(secret, "***")
    return text


def scrub(value, secrets: list[str] | None = None):
    """A copy of `value` (nested dicts, lists, strings) with every string redacted."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, dict):
        return {scrub(k, secrets): scrub(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v, secrets) for v in value]
    return value


def _write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Opened with 0666 so the umask decides the permissions, as for any written file (mkstemp would give 0600).
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_prepared(path: str, data: bytes) -> None:
    """Replace the file `path` with `data` rendered earlier, with system calls only: no Python file object,
    lock or allocation the interrupted code might be in the middle of, so a signal handler may call it. The
    interrupted code's own unfinished temporary copies of the file are removed."""
    folder, name = os.path.split(path)
    temporary = os.path.join(folder, f".{name}.{os.getpid()}.prepared")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    for leftover in os.listdir(folder or "."):
        if leftover.startswith(f".{name}.{os.getpid()}."):
            try:
                os.unlink(os.path.join(folder, leftover))
            except OSError:
                pass


def write_json_atomic(path: Path, data) -> None:
    _write_atomic(path, json.dumps(scrub(data), indent=2, sort_keys=False, default=str) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    _write_atomic(path, redact(text))


class RunRecord:
    """The main process's writer for one run directory."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.data: dict = {"schema_version": SCHEMA_VERSION}
        self._secrets = secret_values()
        self._json_secrets = [json.dumps(secret)[1:-1] for secret in self._secrets]  # as they read inside JSON text
        self.lock = threading.RLock()  # the heartbeat thread may write a failure while the training thread writes
        self._steps_fd = None  # steps.jsonl, open from the first step line to the run's end

    @property
    def path(self) -> Path:
        return self.directory / RECORD_FILE

    @property
    def steps_path(self) -> Path:
        return self.directory / STEPS_FILE

    def update(self, **fields) -> None:
        with self.lock:
            self.data.update(fields)
            write_json_atomic(self.path, self.data)

    def render(self, **fields) -> bytes:
        """The record as it would be written with `fields`, without writing it (for `write_prepared`)."""
        with self.lock:
            return (json.dumps(scrub({**self.data, **fields}, self._secrets), indent=2, default=str) + "\n").encode()

    def append_step(self, line: dict) -> None:
        """One write call per line on an append-only descriptor kept open (`close_steps`): a kill loses at most this
        line. Redacted as written (a step line is numbers: a walk of it would cost more than the line's text)."""
        if self._steps_fd is None:
            self._steps_fd = os.open(self.steps_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self._steps_fd, (redact(json.dumps(line, default=str), self._json_secrets) + "\n").encode())

    def close_steps(self) -> None:
        if self._steps_fd is not None:
            os.close(self._steps_fd)
            self._steps_fd = None

    def truncate_steps(self, after_step: int) -> None:
        """Drop step lines past `after_step` (written after the checkpoint a resumed run restarts from)."""
        self.close_steps()
        if not self.steps_path.exists():
            return
        kept = [line for line in read_steps(self.directory) if line["step"] <= after_step]
        _write_atomic(self.steps_path, "".join(json.dumps(line) + "\n" for line in kept))


def check_schema(record, path: Path) -> dict:
    """The record itself if it is one of ours in a schema this trainscope reads; else ValueError, one line."""
    if not isinstance(record, dict) or "schema_version" not in record:
        raise ValueError(f"{path}: not a trainscope run record (no schema_version)")
    version = record["schema_version"]
    if isinstance(version, bool) or version not in READABLE_SCHEMAS:
        raise ValueError(
            f"{path}: schema_version {version!r} is not one this trainscope reads "
            f"({', '.join(map(str, READABLE_SCHEMAS))})"
        )
    if record.get("status") == "complete":
        missing = [k for k in REQUIRED_COMPLETE if k not in record]
        summary = record.get("summary")
        if not missing and isinstance(summary, dict):
            missing = [f"summary.{k}" for k in REQUIRED_SUMMARY if k not in summary]
        elif not missing:
            missing = ["summary (not an object)"]
        if missing:
            raise ValueError(f"{path}: marked complete but lacks {', '.join(missing)}")
    return record


def read_record(directory: Path) -> dict:
    """Load and check a run record; raises ValueError naming the file when it is not one we can read."""
    path = Path(directory) / RECORD_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable run record ({' '.join(str(error).split())})") from None
    return check_schema(record, path)


def read_steps(directory: Path, problems: list | None = None) -> list[dict]:
    """Step lines; a line that is not JSON (the one a killed run was writing) is skipped with a warning,
    appended to `problems` when given, else printed."""
    path = Path(directory) / STEPS_FILE
    if not path.exists():
        return []
    lines = []
    for number, text in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
            if not isinstance(line, dict) or "step" not in line:
                raise ValueError("no step")
        except ValueError:
            message = f"skipped {path}:{number}: not a complete step line (a run killed while writing it?)"
            if problems is None:
                print(f"warning: {message}", file=sys.stderr)
            else:
                problems.append(message)
            continue
        lines.append(line)
    return lines
