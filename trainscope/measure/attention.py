"""Attention as the model really runs it: the kernel torch picks for each `F.scaled_dot_product_attention` call, and
its FLOPs counted as SDPA's math path does the work whatever kernel runs it (why: docs/instrument.md#attention).
"""

import torch

FUSED = ("flash_attention_for_cpu", "flash_attention", "efficient_attention", "cudnn_attention")  # aten's, as named
# what a run's FLOPs count of attention, by the first word of where they come from (instrument.flops_basis)
COUNTED = {
    "formula:": "the formula's: attention's matmuls as SDPA's math path runs them, whatever kernel ran it",
    "FlopCounterMode": "FlopCounterMode's, each fused attention kernel counted as SDPA's math path (torch's forward "
    "formula, twice it backward: trainscope.measure.attention), whatever kernel ran it",
    "given": "the user's figure",
}


def flop_formulas() -> dict:
    """FlopCounterMode's `custom_mapping`: each fused attention kernel's forward and backward as SDPA's math."""
    from torch.utils.flop_counter import sdpa_flop_count  # deferred: it loads torch's module tracker

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
        heads = query[:2]  # grouped-query keys and values as the query's heads (torch 2.11's formula has no GQA)
        return sdpa_flop_count(query, (*heads, *key[2:]), (*heads, *value[2:]))

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return 2 * forward(query, key, value)

    ops = {(getattr(torch.ops.aten, f"_scaled_dot_product_{name}{end}", None), formula)
           for name in FUSED for end, formula in (("", forward), ("_backward", backward))}  # fmt: skip
    return {op: formula for op, formula in ops if op is not None}


class KernelWatch(torch.overrides.TorchFunctionMode):
    """Which kernel torch picks for each SDPA call of the model's first training and first evaluation forward
    (docs/instrument.md#attention); the mode is on for those two forwards only."""

    def __init__(self, model):
        super().__init__()
        self.seen: dict[str, list | None] = {"training": None, "evaluation": None}
        self.attention_dropout, self._phase = None, None
        self._handles = [
            model.register_forward_pre_hook(self._forward),
            model.register_forward_hook(self._forwarded, always_call=True),
        ]

    def _forward(self, module, args):
        phase = "training" if torch.is_grad_enabled() and module.training else "evaluation"
        if self._phase is None and self.seen[phase] is None:
            self._phase, self.seen[phase] = phase, []
            self.__enter__()

    def _forwarded(self, module, args, output):
        if self._phase is not None:
            self.__exit__(None, None, None)
            self._phase = None
            if None not in self.seen.values():
                self.close()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and self._phase is not None:
            self._choice(*args, **kwargs)
        return func(*args, **kwargs)

    def _choice(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **more):
        from torch.nn.attention import SDPBackend

        try:
            kernel = SDPBackend(torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal,
                                                        scale=scale, **more)).name  # fmt: skip
        except (RuntimeError, TypeError, ValueError):
            kernel = "unknown"
        if kernel not in self.seen[self._phase]:
            self.seen[self._phase].append(kernel)
        if self._phase == "training":
            self.attention_dropout = dropout_p

    def block(self, flops_basis: str | None) -> dict:
        """The record's `environment.sdpa_kernels` (docs/instrument.md#attention)."""
        return {
            **{phase: None if kernels is None else "+".join(kernels) or "none" for phase, kernels in self.seen.items()},
            "attention_dropout": self.attention_dropout,
            "seen": "torch._fused_sdp_choice for each F.scaled_dot_product_attention call of the model's first "
            "training and evaluation forwards",
            "flops": next((said for word, said in COUNTED.items() if (flops_basis or "").startswith(word)), None),
        }

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._phase is not None:
            self.__exit__(None, None, None)
            self._phase = None
