"""Errors the user reads: one line, once, from whichever rank failed, with secrets redacted (`exit_with`,
`redacted_output`; `UserError` and `Fault` are trainscope.core.faults'). How: docs/endings.md#errors-in-one-line,
docs/trust.md#secrets-never-appear.
"""

import contextlib
import hashlib
import io
import os
import sys
import tempfile
import traceback
from pathlib import Path

from trainscope.core import liveness
from trainscope.core.faults import Fault, UserError, one_line  # noqa: F401 (raised through this module by every script)
from trainscope.core.records import redact, secret_values


def _launch_id(environ) -> str | None:
    """Identifies one multi-process launch on this machine (the same on all its local ranks), or None for a single
    process. torchrun's run id is "none" and its port 29500 in every launch of a static rendezvous (what
    `accelerate launch` starts), so the launcher process that started the ranks (their parent, with its start
    time) tells one launch from the next."""
    if int(environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    parts = [
        environ.get(name, "")
        for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")
    ]
    return ":".join([*parts, _launcher_process()])


def _launcher_process() -> str:
    """This process's parent (torchrun's agent, mpirun's orted, slurmstepd) and when it started."""
    parent = os.getppid()
    try:
        started = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]  # field 22: start time
    except (OSError, IndexError):
        started = ""
    return f"{parent}@{started}"


def first_to_report(message: str, environ=None) -> bool:
    """True for the first rank of this launch to report `message`, False for the others."""
    environ = os.environ if environ is None else environ
    launch = _launch_id(environ)
    if launch is None:
        return True
    folder = Path(tempfile.gettempdir()) / "trainscope-errors" / hashlib.sha256(launch.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / hashlib.sha256(message.encode()).hexdigest()[:16]
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def exit_with(error: BaseException, code: int = 2, environ=None) -> None:
    """Print `error: <message>` (once per distinct message across a launch's ranks) and exit with `code`."""
    report(error, environ)
    sys.exit(code)


def report(error: BaseException, environ=None) -> None:
    """`exit_with` without the exit: the line, said once, and told to the peers."""
    environ = os.environ if environ is None else environ
    message = redact(one_line(error))
    tell_peers(message, getattr(error, "caused_by", None))
    if first_to_report(message, environ):
        origin = getattr(error, "rank", None)
        origin = environ.get("RANK") if origin is None else origin
        rank = f"(rank {origin}) " if int(environ.get("WORLD_SIZE", "1") or 1) > 1 else ""
        print(f"error: {rank}{message}", file=sys.stderr, flush=True)


def tell_peers(message: str, caused_by: int | None = None) -> None:
    """This rank's one line, for the other ranks of a multi-process run to name (trainscope.core.liveness)."""
    liveness.publish_error(message, caused_by)


class _RedactingStream(io.TextIOBase):
    """A text stream that redacts what it writes and forwards everything else to the wrapped stream."""

    def __init__(self, stream):
        self._stream = stream
        self._secrets = secret_values()

    def write(self, text):
        self._stream.write(redact(text, self._secrets))
        return len(text)

    def flush(self):
        self._stream.flush()

    def isatty(self):
        return self._stream.isatty()

    def fileno(self):
        return self._stream.fileno()

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def redacted_output():
    """Redact sys.stdout and sys.stderr inside the block, warnings included. An exception that escapes
    the block is printed here, redacted, and ends the process with status 1 as Python's own handler
    would (which would print it after the streams are restored, unredacted)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _RedactingStream(sys.stdout), _RedactingStream(sys.stderr)
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:
        tell_peers(one_line(error))
        traceback.print_exc()
        sys.stderr.flush()
        raise SystemExit(1) from None
    finally:
        sys.stdout, sys.stderr = saved
