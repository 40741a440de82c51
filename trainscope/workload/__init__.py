"""train.py's workload, the text classifier: data names and paths to DataLoaders, the model (LoRA, dropout, the
layers FSDP shards), the padding-free layers of --unpad and their dropout draws, and the offline defaults.
"""

__all__ = ["data", "embedded", "hub", "modeling", "layers", "shapes", "unpad", "dropout_draws"]
