"""trainscope: where training time and memory go, measured on HuggingFace Accelerate."""

__version__ = "0.1.0"
