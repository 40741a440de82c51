"""trainscope: where training time and memory go, measured on HuggingFace Accelerate.

The public names (docs/instrument.md): `Run` instruments any Accelerate training loop, the one driver API of every
front door, `TrainscopeCallback` a `transformers.Trainer` through it; `one_line_endings` ends a script on bad input or
a fault with one line (raise `UserError` for bad input); `parse_settings` parses train.py's flags (argparse alone: a
script's --help answers before torch loads); `fsdp_wrap_rule` names the layers an FSDP config shards; `classifier`
holds the pieces of train.py's own workload and its driver of `Run`, `embedded` the offline model and corpus.
Those that load torch or transformers load on first use, so `import trainscope` stays light.
"""

__version__ = "0.4.0"  # the one version: pyproject.toml reads it (tool.setuptools.dynamic)

from trainscope.core.errors import UserError
from trainscope.workload import embedded

__all__ = ["Run", "TrainscopeCallback", "UserError", "classifier", "embedded", "fsdp_wrap_rule",
           "one_line_endings", "parse_settings", "__version__"]  # fmt: skip


def __getattr__(name: str):
    if name == "fsdp_wrap_rule":
        from trainscope.workload.modeling import fsdp_wrap_rule  # deferred: it loads transformers

        return fsdp_wrap_rule
    if name == "Run":
        from trainscope.instrument import Run  # deferred: it loads torch and accelerate

        return Run
    if name == "TrainscopeCallback":
        from trainscope.trainer import TrainscopeCallback  # deferred: it loads transformers' Trainer

        return TrainscopeCallback
    if name == "parse_settings":
        from trainscope.workload.settings import parse_settings  # deferred: argparse only, but few scripts parse

        return parse_settings
    if name == "one_line_endings":
        from trainscope.run.endings import one_line_endings  # deferred: `import trainscope` loads no run module

        return one_line_endings
    if name == "classifier":
        import trainscope.classifier  # deferred: it loads transformers

        return trainscope.classifier
    raise AttributeError(f"module 'trainscope' has no attribute {name!r}")
