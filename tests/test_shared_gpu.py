"""Two processes sharing one GPU (make gpu-check's multi-process checks on a machine with one GPU): Accelerate's and
torch's own code, run after trainscope's start-up opened the process group as it does in a launch, with the machine
stood in: its CUDA devices (torch.cuda patched), this process local rank 1 of 2 over torch's fake process group, whose
barrier is recorded instead of allocating its tensor on the device. With a GPU per process nothing changes."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainscope.run import startup
from trainscope.workload.settings import parse_settings


class GPUs:
    """torch.cuda of a machine with `count` GPUs: the current device is the one last set, and setting one initializes
    CUDA (torch.cuda.set_device's C++ side lazily initializes it, THCPModule_setDevice_wrap)."""

    def __init__(self, count: int):
        self.count, self.current = count, None

    def ordinal(self, device) -> int:
        index = device if isinstance(device, int) else torch.device(device).index
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal (cuda:{index} on a machine with {self.count} GPU)")
        return index

    def set_device(self, device) -> None:
        self.current = self.ordinal(device)

    def current_device(self) -> int:
        return 0 if self.current is None else self.current

    def is_initialized(self) -> bool:
        return self.current is not None


@pytest.fixture(params=[1, 2], ids=["one GPU shared", "a GPU per process"])
def rank_one(request, monkeypatch):
    """This process as the second of a 2-process launch over gloo on a machine with one GPU (shared) or two, after
    trainscope's start-up (`startup.open_process_group`, as train.py's `start` calls it); yields the state, the
    devices its barriers named and the record's process-group facts."""
    gpu = GPUs(request.param)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpu.count)
    monkeypatch.setattr(torch.cuda, "set_device", gpu.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", gpu.current_device)
    monkeypatch.setattr(torch.cuda, "is_initialized", gpu.is_initialized)
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    barriers = []

    def barrier(group, opts=None):  # the process group allocates its one-element tensor on opts.device
        if opts.device.type == "cuda":
            gpu.ordinal(opts.device)
        barriers.append(opts.device)

    monkeypatch.setattr(dist.ProcessGroup, "barrier", barrier)
    for name in ("ACCELERATE_USE_CPU", "ACCELERATE_TORCH_DEVICE", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(name, raising=False)
    launch = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1"}
    for name, value in {**launch, startup.BACKEND_ENV: "gloo"}.items():
        monkeypatch.setenv(name, value)
    # the group a 2-process launch opens, seen from rank 1 (torch's fake backend: no peer to wait for)
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        (settings,) = parse_settings(argv=["--report-to", "none"])
        state, facts = startup.open_process_group(settings, cpu=False)
        assert state.distributed_type == DistributedType.MULTI_GPU and state.backend == "gloo"
        assert state.device == torch.device("cuda", 1 % gpu.count) and state.process_index == 1
        yield state, barriers, facts
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        dist.destroy_process_group()


def test_accelerates_barriers_on_a_shared_gpu_use_the_gpu_both_ranks_run_on(rank_one):
    """PartialState.wait_for_everyone calls torch.distributed.barrier(device_ids=[local_process_index]) for every
    distributed type: local rank 1 on a one-GPU machine asked for cuda:1 (invalid device ordinal), at the first
    barrier of every launch (main_process_first in data loading)."""
    state, barriers, _ = rank_one
    PartialState().wait_for_everyone()
    with PartialState().main_process_first():
        pass
    with state.local_main_process_first():
        pass
    assert barriers and set(barriers) == {state.device}


class DDPConstructor:
    """What Accelerate hands DistributedDataParallel (a CUDA module cannot be wrapped on this CPU)."""

    seen: list = []

    def __init__(self, module, device_ids=None, output_device=None, **kwargs):
        DDPConstructor.seen.append({"device_ids": device_ids, "output_device": output_device, **kwargs})
        self.module = module


def test_accelerates_ddp_on_a_shared_gpu_is_given_the_gpu_both_ranks_run_on(rank_one, monkeypatch, tmp_path):
    """Accelerator.prepare_model passes device_ids=[local_process_index] under MULTI_GPU: DDP built with device_ids=[1]
    on a one-GPU machine copies every input to cuda:1, and torch's _get_stream for that copy indexes a one-entry list
    of streams (IndexError) before the first forward."""
    from torch.nn.parallel import _functions

    state, _, _ = rank_one
    (settings,) = parse_settings(argv=["--report-to", "none"])
    started = startup.Startup(state, settings, threads={}, run_dir=tmp_path)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # start-up enforces --tf32
    try:
        accelerator = startup.build_accelerator(settings, started)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert accelerator.distributed_type == DistributedType.MULTI_GPU and accelerator.device == state.device
    DDPConstructor.seen = []
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", DDPConstructor)
    accelerator.prepare_model(torch.nn.Linear(4, 2), device_placement=False)  # the model would be moved to cuda:0
    ((built,),) = [DDPConstructor.seen]
    # DDP copies its inputs to cuda:<device_ids[0]> (its _pre_forward) on a side stream from torch's _get_stream
    target = torch.device("cuda", built["device_ids"][0]) if built["device_ids"] else accelerator.device
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", torch.cuda.device_count)
    monkeypatch.setattr(torch, "Stream", lambda index: ("stream", index))
    monkeypatch.setattr(_functions, "_streams", None)
    assert _functions._get_stream(target) == ("stream", accelerator.device.index)
    assert target == accelerator.device and built["output_device"] in (None, accelerator.device.index)


def test_fsdp2s_mesh_on_a_shared_gpu_is_the_gpu_both_ranks_run_on(rank_one):
    """fully_shard without a mesh (Accelerate's FSDP2 prepare passes none) builds torch's default mesh over the world
    and takes its device from the current CUDA device: the one Accelerate set, cuda:0."""
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    mesh = _fsdp_init._init_default_fully_shard_mesh()
    assert mesh.device_type == "cuda" and mesh.size() == 2
    assert _fsdp_init._get_device_from_mesh(mesh) == rank_one[0].device


def test_the_record_says_which_processes_share_a_gpu(rank_one):
    state, _, facts = rank_one
    shared = {"local_rank": 1, "device": "cuda:0"} if state.device.index == 0 else None
    assert facts["shared_device"] == shared and state.local_process_index == state.device.index


@pytest.mark.parametrize("gpus, local_rank", [(1, 1), (2, 1), (2, 3)])
def test_nccl_binds_the_gpu_accelerate_puts_the_process_on(monkeypatch, gpus, local_rank):
    """NCCL's device_id is the GPU Accelerate's PartialState.set_device places the process on (its local rank modulo
    the GPUs it sees): a launch that shows each process only its own GPU (one visible, LOCAL_RANK 1) was given
    cuda:1, "device_id out of range"."""
    gpu = GPUs(gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpu.count)
    monkeypatch.setattr(torch.cuda, "set_device", gpu.set_device)
    (settings,) = parse_settings(argv=["--report-to", "none"])
    options = startup.process_group_options(
        settings, cpu=False, environ={"WORLD_SIZE": "2", "LOCAL_RANK": str(local_rank)}
    )
    placed = SimpleNamespace(device=None, distributed_type=DistributedType.MULTI_GPU, local_process_index=local_rank)
    PartialState.set_device(placed)  # Accelerate's own placement, on the stood-in machine
    assert options["device_id"] == placed.device and gpu.ordinal(options["device_id"]) == local_rank % gpus
