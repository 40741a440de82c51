"""What FSDP2 sharded and the collectives it ran, on this rank: the modules `fully_shard` manages (by class), this
rank's share of the parameters (the DTensors' local shards against the whole tensors) and the all-gathers and
reduce-scatters FSDP2 issued, counted at its own communication objects (each call passed on unchanged)."""

from collections import Counter

import torch

from trainscope.measure.memory import local_tensor


class _Counted:
    """One module's FSDP2 all-gather or reduce-scatter, passed on unchanged and counted."""

    def __init__(self, comm, counts: Counter, kind: str):
        self.comm, self.counts, self.kind = comm, counts, kind

    def allocate(self, *args, **kwargs):
        return self.comm.allocate(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self.counts[self.kind] += 1
        return self.comm(*args, **kwargs)


class Sharding:
    """FSDP2's modules of one prepared model, their collectives counted from here on (`attach`)."""

    def __init__(self, model: torch.nn.Module, modules: list):
        self.model, self.modules = model, modules
        self.collectives: Counter | None = Counter(all_gathers=0, reduce_scatters=0)
        for module in modules:
            # FSDP2 keeps each module's communications on its parameter group; they are set through its public
            # set_custom_* and read where it keeps them (no public getter)
            groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None)
            if groups is None:
                self.collectives = None
                return
            if len(groups) != 1:  # a module without parameters of its own has no group (more: per-parameter meshes)
                continue
            module.set_custom_all_gather(_Counted(groups[0]._all_gather_comm, self.collectives, "all_gathers"))
            module.set_custom_reduce_scatter(
                _Counted(groups[0]._reduce_scatter_comm, self.collectives, "reduce_scatters")
            )

    def facts(self) -> dict:
        """This rank's figures: the sharded modules by class, the parameters' elements whole and local, the
        collectives counted."""
        params = list(self.model.parameters())
        return {
            "sharded_modules": dict(Counter(_class_name(module) for module in self.modules)),
            "parameters": sum(p.numel() for p in params),
            "local_parameters": sum(local_tensor(p).numel() for p in params),
            "collectives": dict(self.collectives) if self.collectives is not None else None,
        }


def _class_name(module) -> str:
    """The module's own class, not the FSDP<class> fully_shard made of it."""
    from torch.distributed.fsdp import FSDPModule

    return next(kind for kind in type(module).__mro__ if not issubclass(kind, FSDPModule)).__name__


def attach(model: torch.nn.Module) -> Sharding | None:
    """The model's FSDP2 sharding, its collectives counted from now; None for a model FSDP2 does not manage."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    return Sharding(model, modules) if modules else None
