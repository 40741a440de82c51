"""A model's repeated blocks (its transformer layers): what FSDP shards one by one (trainscope.workload.modeling) and whose
matmul weights the FLOPs count reads (trainscope.measure.flops)."""

import torch


def transformer_layer_classes(model) -> list[str]:
    """Class names of the model's repeated blocks: what FSDP shards one by one.

    The model's own `_no_split_modules` where it declares them; otherwise the class of the items of
    its longest ModuleList (DistilBERT's TransformerBlock declares nothing).
    """
    declared = [name for name in (getattr(model, "_no_split_modules", None) or []) if "Embedding" not in name]
    if declared:
        return sorted(declared)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return []
    return [type(max(lists, key=len)[0]).__name__]
