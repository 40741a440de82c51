"""How a training script ends when something goes wrong: one line and an exit status, no traceback (train.py and
any loop instrumented with trainscope.Run use it). Light: a script's --help passes through it before torch loads."""

import contextlib
import sys

from trainscope.core import liveness
from trainscope.core.errors import Fault, UserError, exit_with, redacted_output
from trainscope.core.faults import NonFiniteLoss


class Ending:
    """What the guard knows of the run: its --distributed-timeout, once parsed (it words a lost peer's line)."""

    distributed_timeout: int = 600


@contextlib.contextmanager
def one_line_endings(distributed_timeout: int = 600):
    """Bad input ends with status 2, a fault (a lost peer, a full disk, out of memory, a non-finite loss) with 1, a Ctrl-C before the run was recorded with 130; each in one line. Secrets in the output
    are redacted. Anything else is a bug and keeps its traceback."""
    ending = Ending()
    ending.distributed_timeout = distributed_timeout
    with redacted_output():
        try:
            yield ending
        except UserError as error:
            exit_with(error, code=2)
        except (NonFiniteLoss, Fault) as error:
            exit_with(error, code=1)
        except KeyboardInterrupt:  # before the run could handle it: nothing was recorded yet
            exit_with(UserError("interrupted while starting: no run was recorded"), code=130)
        except Exception as error:  # before the loop: a peer that failed or vanished, named through the store
            torch = sys.modules.get("torch")  # loaded by whatever could run out of memory; --help loads none
            if torch is not None and isinstance(error, torch.OutOfMemoryError):
                exit_with(error, code=1)
            fault = liveness.explain(error, ending.distributed_timeout)
            if fault is None:
                raise
            exit_with(fault, code=1)
