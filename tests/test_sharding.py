"""What each rank holds (trainscope.measure.sharding): FSDP2's collectives counted where each torch keeps them, or
said why not, and the state a rank ends training with. The real FSDP2 path over gloo: tests/test_launches.py."""

from types import SimpleNamespace

import pytest
import torch

from trainscope.measure import sharding


class Comm:
    """A parameter group's all-gather or reduce-scatter as FSDP2 holds it: allocate, then call."""

    def __init__(self):
        self.calls = []

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output, input, group, *args, **kwargs):
        self.calls.append((output, input, group, args, kwargs))


def param_group() -> SimpleNamespace:
    """An FSDPParamGroup's communication objects (both torch versions keep them under these names)."""
    return SimpleNamespace(_all_gather_comm=Comm(), _reduce_scatter_comm=Comm())


class FSDPModule(torch.nn.Linear):
    """A module fully_shard managed, whose FSDP state is `state`."""

    def __init__(self, state):
        super().__init__(4, 4)
        self.state = state

    def _get_fsdp_state(self):
        return self.state


# torch 2.11's FSDPState keeps one group (None for a module without parameters of its own); 2.13's a list of them
STATES = {
    "2.11": lambda groups: SimpleNamespace(_fsdp_param_group=groups[0] if groups else None),
    "2.13": lambda groups: SimpleNamespace(_fsdp_param_groups=groups),
}


@pytest.mark.parametrize("version", STATES)
def test_fsdp2s_collectives_are_counted_where_each_torch_keeps_its_parameter_groups(version):
    """The H200's torch 2.11 keeps one `_fsdp_param_group` where 2.13 keeps `_fsdp_param_groups`: reading only the
    latter, the FSDP2 check counted nothing there (collectives null on both ranks), without a word."""
    layer, root = param_group(), param_group()
    modules = [
        FSDPModule(STATES[version]([layer])),
        FSDPModule(STATES[version]([root])),
        FSDPModule(STATES[version]([])),
    ]
    counted = sharding.Sharding(torch.nn.Sequential(*modules), modules)
    tensor = torch.zeros(2)
    for group in (layer, root, layer):  # FSDP2 calls each group's objects as it unshards and reduces
        group._all_gather_comm(tensor, tensor, "mesh group", async_op=True)
    root._reduce_scatter_comm(tensor, tensor, "mesh group", "avg")
    assert root._all_gather_comm.allocate((3,), dtype=torch.float16, device="cpu").dtype == torch.float16
    facts = counted.facts()
    assert facts["collectives"] == {"all_gathers": 3, "reduce_scatters": 1} and "collectives_not_counted" not in facts
    # each call passed on unchanged to the object FSDP2 held
    assert len(layer._all_gather_comm.comm.calls) == 2 and root._reduce_scatter_comm.comm.calls[0][3] == ("avg",)


def test_a_torch_that_keeps_the_groups_elsewhere_records_why_its_collectives_are_not_counted():
    modules = [FSDPModule(SimpleNamespace(_param_groups_of_a_later_torch=[param_group()]))]
    facts = sharding.Sharding(torch.nn.Sequential(*modules), modules).facts()
    assert facts["collectives"] is None
    assert f"torch {torch.__version__}'s FSDP2 state" in facts["collectives_not_counted"]
    assert "_fsdp_param_groups" in facts["collectives_not_counted"]


def test_a_ranks_end_state_tells_its_parameters_and_its_scaler_apart():
    """DDP's ranks end every step with the same parameters and scaler: the checksum tells a changed or swapped
    parameter apart, and the scaler's state is its own state_dict's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    same = sharding.end_state(model)
    assert same == sharding.end_state(model) and same["loss_scale"] is None
    with torch.no_grad():
        first, last = model[0].bias.clone(), model[1].bias.clone()
        model[0].bias.copy_(last)
        model[1].bias.copy_(first)
    assert sharding.end_state(model)["parameter_checksum"] != same["parameter_checksum"]  # swapped
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert sharding.end_state(model, scaler)["loss_scale"] == 1024.0
    assert sharding.end_state(None) == {"parameter_checksum": None, "loss_scale": None, "scaler_growth": None}
