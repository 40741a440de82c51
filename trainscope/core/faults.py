"""The two kinds of error a user reads, and their one line: the bottom of the error path, so that both the reporting
(trainscope.core.errors) and the peers' watch (trainscope.core.liveness) raise and read them without importing each other.
"""


class UserError(Exception):
    """Bad input or an impossible setting. The message is one line and says what to do (exit status 2)."""


class Fault(Exception):
    """A fault of the run's surroundings (a lost peer, a full disk, a collective that timed out). The message is
    one line and says what to do (exit status 1, never a traceback). `rank`: the rank whose line it is, when another rank raised it; `caused_by`:
    the peer whose failure or disappearance this rank's failure follows."""

    def __init__(self, message: str, rank: int | None = None, caused_by: int | None = None):
        super().__init__(message)
        self.rank, self.caused_by = rank, caused_by


class NonFiniteLoss(RuntimeError):
    """The loss became inf or NaN (trainscope.run.metrics reads it at log steps): the run cannot go on; one line,
    exit status 1."""


def one_line(error: BaseException) -> str:
    """The error's message, or its note when one was added (`add_note`), folded to one line."""
    notes = getattr(error, "__notes__", None)
    text = notes[-1] if notes else (str(error) or type(error).__name__)
    return " ".join(text.split())
