"""A model's repeated blocks (its transformer layers): what FSDP shards one by one (trainscope.workload.modeling) and whose
matmul weights the FLOPs count reads (trainscope.measure.flops)."""

import torch


def transformer_layer_classes(model) -> list[str]:
    """Class names of the model's repeated blocks (what FSDP shards one by one): the model's `_no_split_modules`,
    else the class of the items of its longest ModuleList (DistilBERT declares nothing)."""
    declared = [name for name in (getattr(model, "_no_split_modules", None) or []) if "Embedding" not in name]
    if declared:
        return sorted(declared)
    longest = longest_module_list(model)
    return [type(longest[0]).__name__] if longest is not None else []


def longest_module_list(model) -> torch.nn.ModuleList | None:
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    return max(lists, key=len) if lists else None


def forced_input_grads(model) -> bool:
    """transformers' enable_input_require_grads (which peft calls with gradient checkpointing) hooks the embeddings
    so their output needs a gradient although they are frozen."""
    return any(
        getattr(m, hook, None) for m in model.modules() for hook in ("_require_grads_hooks", "_require_grads_hook")
    )
