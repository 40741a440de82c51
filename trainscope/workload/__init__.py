"""train.py's workload, the text classifier: its settings (its flags), data names and paths to DataLoaders, the model
(LoRA, dropout, the layers FSDP shards), the padding-free layers of --unpad and their dropout draws, and the offline
defaults. It stands on the instrument (trainscope/run, trainscope/measure), which knows none of it.
"""

__all__ = ["settings", "data", "embedded", "hub", "modeling", "step", "unpad", "dropout_draws"]
