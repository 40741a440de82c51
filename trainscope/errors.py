"""One kind of error for bad input: a one-line message that names the fix."""

import os
import sys


class UserError(Exception):
    """Bad input or an impossible setting. The message is one line and says what to do."""


def exit_with(error: BaseException, code: int = 2) -> None:
    """Print `error: <message>` once (from the first process of a launch) and exit with `code`.

    Every process of a multi-process launch reaches the same validation, so every process exits;
    only one prints, so the user reads the message once.
    """
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
        message = " ".join(str(error).split())  # keep it one line
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)
