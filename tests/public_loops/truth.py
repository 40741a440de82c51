"""What a loop did, counted by the loop itself and by torch, never by trainscope: optimizer steps by torch's global
step hook (each optimizer's apart), the samples and real tokens it fed, each input shape's training FLOPs by
FlopCounterMode on a copy of the model as trained with SDPA on its math backend (whose matmuls FlopCounterMode counts,
whatever kernel the loop's attention ran), the wall clock around its `with run:` block, and any FlopCounterMode found
still open when a training forward began."""

import collections
import copy
import json
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.optim import optimizer as torch_optimizer
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode


class Truth:
    def __init__(self, path):
        self.path = path
        self.steps = 0
        self.by_optimizer = collections.Counter()  # id of each torch optimizer -> its steps
        self.samples = self.tokens = 0
        self.shapes = collections.Counter()
        self.examples = {}
        self.open_counters = []  # per training forward: FlopCounterModes active when it began (after the first)
        self.started = self.wall_s = None
        self._hook = torch_optimizer.register_optimizer_step_post_hook(self._stepped)

    def _stepped(self, optimizer, args, kwargs):
        self.steps += 1
        self.by_optimizer[id(optimizer)] += 1

    def steps_of(self, optimizer) -> int:
        """One optimizer's steps (a prepared one's: the torch optimizer inside)."""
        return self.by_optimizer[id(getattr(optimizer, "optimizer", optimizer))]

    def watch_forwards(self, model) -> None:
        """After trainscope.Run hooked the model: at each training forward, the FlopCounterModes left open."""

        def seen(module, args, kwargs):
            if torch.is_grad_enabled() and module.training:
                modes = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, FlopCounterMode)]
                self.open_counters.append(len(modes))

        model.register_forward_pre_hook(seen, with_kwargs=True)

    def fed(self, batch, key: tuple, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        self.shapes[key] += 1
        self.examples.setdefault(key, copy.deepcopy(batch))

    def start(self) -> None:
        self.started = time.perf_counter()

    def stop(self) -> None:
        self.wall_s = time.perf_counter() - self.started

    def count_flops(self, model, loss_of) -> dict:
        """Each fed shape's forward and backward counted by FlopCounterMode on a copy of `model` (what trains kept)."""
        twin = copy.deepcopy(model)
        twin.train()
        for module in twin.modules():  # the copy's forwards are the count's, not the loop's
            module._forward_pre_hooks.clear()
        per_shape = {}
        for key, batch in self.examples.items():
            with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
                loss_of(twin, copy.deepcopy(batch)).backward()
            twin.zero_grad(set_to_none=True)
            per_shape[key] = counter.get_total_flops()
        return per_shape

    def write(self, model=None, loss_of=None, **extra) -> None:
        self._hook.remove()
        flops = self.count_flops(model, loss_of) if model is not None else {}
        total = sum(flops[key] * count for key, count in self.shapes.items()) if flops else None
        with open(self.path, "w") as file:
            json.dump(
                {
                    "optimizer_steps": self.steps,
                    "samples": self.samples,
                    "tokens": self.tokens,
                    "shapes": {"x".join(map(str, key)): count for key, count in self.shapes.items()},
                    "flops": total,
                    "flops_per_shape": {"x".join(map(str, key)): value for key, value in flops.items()},
                    "open_counters": self.open_counters,
                    "wall_s": self.wall_s,
                    **extra,
                },
                file,
            )
