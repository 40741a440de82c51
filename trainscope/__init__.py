"""trainscope: where training time and memory go, measured on HuggingFace Accelerate."""

__version__ = "0.4.0"  # the one version: pyproject.toml reads it (tool.setuptools.dynamic)
