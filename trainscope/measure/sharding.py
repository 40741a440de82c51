"""What each rank holds under FSDP2 (the modules `fully_shard` manages, its parameters' local share, the collectives
FSDP2 issued) and, after training, its parameters' checksum and loss scaler (docs/RECORD.md `fsdp`, `end_state`)."""

from collections import Counter

import torch

from trainscope.measure.memory import local_tensor


class _Counted:
    """One parameter group's FSDP2 all-gather or reduce-scatter, passed on unchanged and counted."""

    def __init__(self, comm, counts: Counter, kind: str):
        self.comm, self.counts, self.kind = comm, counts, kind

    def allocate(self, *args, **kwargs):
        return self.comm.allocate(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self.counts[self.kind] += 1
        return self.comm(*args, **kwargs)


def param_groups(state) -> list | None:
    """An FSDP2 module's parameter groups where its state keeps them: torch 2.13 a list (`_fsdp_param_groups`, a group
    per mesh), torch 2.11 one group or None (`_fsdp_param_group`); None where it keeps neither."""
    if hasattr(state, "_fsdp_param_groups"):  # checked first: 2.13's `_fsdp_param_group` is a property over it
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):
        return [] if state._fsdp_param_group is None else [state._fsdp_param_group]
    return None


COMMS = {"_all_gather_comm": "all_gathers", "_reduce_scatter_comm": "reduce_scatters"}


class Sharding:
    """FSDP2's modules of one prepared model, their collectives counted from here on (`attach`), or the reason they
    cannot be (`not_counted`)."""

    def __init__(self, model: torch.nn.Module, modules: list):
        self.model, self.modules = model, modules
        self.collectives: Counter | None = Counter(all_gathers=0, reduce_scatters=0)
        self.not_counted: str | None = None
        # FSDP2 keeps each group's communications on the group (set_custom_* writes them there; torch 2.13's refuses
        # a module of several groups) and has no getter: each is wrapped where it is kept
        found = [param_groups(module._get_fsdp_state()) for module in modules]
        groups = [group for module_groups in found if module_groups for group in module_groups]
        if None in found or not all(hasattr(group, comm) for group in groups for comm in COMMS):
            self.collectives = None
            self.not_counted = (
                f"torch {torch.__version__}'s FSDP2 state keeps its parameter groups' communications neither where "
                "torch 2.13 (_fsdp_param_groups) nor where 2.11 (_fsdp_param_group) does"
            )
            return
        for group in groups:
            for comm, kind in COMMS.items():
                setattr(group, comm, _Counted(getattr(group, comm), self.collectives, kind))

    def facts(self) -> dict:
        """This rank's figures: the sharded modules by class, the parameters' elements whole and local, the
        collectives counted (None, with why, where they cannot be)."""
        params = list(self.model.parameters())
        return {
            "sharded_modules": dict(Counter(_class_name(module) for module in self.modules)),
            "parameters": sum(p.numel() for p in params),
            "local_parameters": sum(local_tensor(p).numel() for p in params),
            "collectives": dict(self.collectives) if self.collectives is not None else None,
            **({"collectives_not_counted": self.not_counted} if self.not_counted else {}),
        }


def end_state(model: torch.nn.Module | None, scaler=None) -> dict:
    """This rank's state after training: its parameters' checksum (float64: each parameter's sum of elements, its
    local shard's under FSDP2, weighted by its place in the model so that a swap shows) and its loss scaler's state
    (GradScaler's own state_dict: the scale and its growth tracker), None where there is none."""
    checksum = None
    parameters = list(model.parameters()) if model is not None else []
    if parameters:
        with torch.no_grad():
            sums = [local_tensor(p).double().sum() * place for place, p in enumerate(parameters, 1)]
            checksum = torch.stack(sums).sum().item()  # a sync point, once at the run's end
    state = scaler.state_dict() if scaler is not None else {}
    return {
        "parameter_checksum": checksum,
        "loss_scale": state.get("scale"),
        "scaler_growth": state.get("_growth_tracker"),
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
