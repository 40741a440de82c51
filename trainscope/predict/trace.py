"""The run's training step and evaluation forward traced on fake tensors: every operator with its shapes, and the
memory the step holds, each with its power of the sequence length.

How it works: docs/predict.md#in-the-code-how-the-step-is-traced-trainscopepredicttracepy.
"""

import contextlib
import functools
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from trainscope.core.precision import autocast_dtype

VERSION = 2  # bump when what a trace holds changes (cached traces of another version are traced again)
aten = torch.ops.aten
GEMMS = (aten.mm, aten.addmm)  # plain matrix products: the machine's measured peak applies (trainscope.measure.peak)
OPTIMIZER_PHASES = ("optimizer", "optimizer_first")  # a steady step's, the first step's


@dataclass
class Op:
    """One operator of a phase with its arguments' shapes, and how many identical calls the phase makes."""

    phase: str  # forward, backward, optimizer (the steady step's), optimizer_first, eval
    name: str  # aten overload, e.g. aten.addmm.default
    key: str  # the name and its arguments (shapes, strides, dtypes, scalars): what a cost is cached by
    spec: tuple | None = field(default=None, repr=False)  # the arguments, to make real tensors of (not cached)
    count: int = 1
    flops: int = 0  # from torch.utils.flop_counter (matrix products and attention), else 0
    gemm: tuple | None = None  # (m, n, k) of an mm/addmm: an (m x k) @ (k x n) product
    dtype: str = "float32"  # the first floating-point input's dtype
    work: int = 0  # elements of the op's largest tensor: what a memory-bound op's time grows with
    power: int = 1  # how its work grows with the sequence length: length ** power (0, 1 or 2)


@dataclass
class Trace:
    batch: int
    length: int
    ops: list
    memory: dict  # bytes the step holds throughout, by kind, then by power of the length: {kind: {power: b}}
    saved: dict  # bytes saved for backward by autograd, by top module, then by power: {module: {power: b}}
    peaks: list = field(default_factory=list)  # the forward and backward's candidate peaks: [{kind: {power: b}}]
    dispatches: dict = field(default_factory=dict)  # operators dispatched by phase, views included (each costs the
    # framework's dispatch and Python time whatever its size: what trainscope.predict's calibration charges per call)
    parameters: int = 0  # elements
    trainable: int = 0
    parameter_bytes: int = 0
    trainable_bytes: int = 0

    def memory_at(self, length: float, batch: int | None = None) -> dict:
        """Bytes by kind at the step's peak at another length (and batch: what grows with the length grows with the
        batch too). Which moment of forward and backward is the peak depends on the size (activations or the weights'
        gradients may dominate): every moment that could be is kept, and the largest at this size taken."""
        held = {kind: _scaled(powers, self, length, batch) for kind, powers in self.memory.items()}
        moments = [
            {kind: _scaled(powers, self, length, batch) for kind, powers in moment.items()} for moment in self.peaks
        ] or [{}]
        peak = max(moments, key=lambda moment: sum(moment.values()))
        return {**held, "activations": peak.get("activations", 0.0), "temporary": peak.get("temporary", 0.0)}

    def peak_at(self, length: float, batch: int | None = None) -> float:
        """Bytes at the step's peak at another length and batch: parameters, optimizer state, activations, temporaries."""
        return sum(self.memory_at(length, batch).values())

    def saved_at(self, length: float, batch: int | None = None) -> dict:
        """Bytes saved for backward by module at another length and batch."""
        return {module: _scaled(powers, self, length, batch) for module, powers in self.saved.items()}

    @property
    def saved_bytes(self) -> int:
        return int(sum(self.saved_at(self.length).values()))

    def to_dict(self) -> dict:
        fields = {k: v for k, v in self.__dict__.items() if k != "ops"}
        return {**fields, "ops": [{k: v for k, v in op.__dict__.items() if k != "spec"} for op in self.ops]}

    @classmethod
    def from_dict(cls, data: dict) -> "Trace":
        ops = [Op(**{**op, "gemm": tuple(op["gemm"]) if op["gemm"] else None}) for op in data["ops"]]
        fix = lambda table: {k: {int(p): b for p, b in v.items()} for k, v in table.items()}  # noqa: E731
        return cls(
            **{
                **data,
                "ops": ops,
                "memory": fix(data["memory"]),
                "saved": fix(data["saved"]),
                "peaks": [fix(moment) for moment in data.get("peaks", [])],
            }
        )


def _scaled(powers: dict, traced: Trace, length: float, batch: int | None) -> float:
    """What grows with the length (power 1 or 2) grows with the batch too; what does not (the weights, the optimizer
    state: power 0) does not."""
    batch_ratio = 1.0 if batch is None else batch / traced.batch
    return sum(b * ((length / traced.length) ** p) * (batch_ratio if p else 1.0) for p, b in powers.items())


def length_power(shape, batch: int, length: int, avoid: set) -> int:
    """How a tensor grows with the sequence length: its dims equal to the length, and one more for a dim of batch x
    length (a flattened batch), 0 to 2. The traced length is chosen apart from every other size (`avoid`)."""
    flat = batch * length
    power = sum(1 for dim in shape if dim == length)
    if flat != length and flat not in avoid and flat in shape:
        power += 1
    return min(power, 2)


def _spec(value):
    """A tensor as ('tensor', shape, stride, offset, dtype, device type); anything else as itself. The device matters:
    a CPU scalar tensor beside CUDA ones (an operator's host-side argument) is read by the host, and made on the GPU it
    would be a device pointer the host dereferences."""
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            tuple(value.shape),
            tuple(value.stride()),
            int(value.storage_offset()),
            str(value.dtype).removeprefix("torch."),
            value.device.type,
        )
    return value


def is_tensor_spec(value) -> bool:
    return isinstance(value, tuple) and len(value) == 6 and value[0] == "tensor"


# Outputs that hold a random generator's state (SDPA's fused kernels return the philox seed and offset their dropout
# drew, for backward to draw the same mask) and the inputs that take it back. Fake tensors put them on the device
# where the real kernels keep them on the host outside CUDA graphs (torch._subclasses.fake_utils.is_sdpa_error), and
# their values are the generator's, not data: an operator taking them is timed with the state a real call of the
# operator that made it returns (trainscope.predict.op_costs).
RNG_STATE_NAMES = frozenset({"philox_seed", "philox_offset", "rng_state"})


@functools.lru_cache(maxsize=None)
def rng_outputs(func) -> tuple[int, ...]:
    """Positions of `func`'s outputs that hold random-generator state (by the schema's return names; flash attention
    returns its offset as `unused`, after `rng_state`)."""
    names = [r.name for r in func._schema.returns]
    found = [i for i, name in enumerate(names) if name in RNG_STATE_NAMES]
    if "rng_state" in names and "unused" in names:
        found.append(names.index("unused"))
    return tuple(sorted(found))


def rng_inputs(func) -> set[str]:
    """Names of `func`'s arguments that take random-generator state."""
    return {a.name for a in func._schema.arguments if a.name in RNG_STATE_NAMES}


def is_rng_spec(value) -> bool:
    """('rng', producer operator, the producer's (args, kwargs) spec, output index): a generator state, made by a real
    call of its producer when timed."""
    return isinstance(value, tuple) and len(value) == 4 and value[0] == "rng"


def is_leaf_spec(value) -> bool:
    return is_tensor_spec(value) or is_rng_spec(value)


def _gemm_shape(func, args) -> tuple | None:
    if func.overloadpacket not in GEMMS:
        return None
    a, b = (args[0], args[1]) if func.overloadpacket is aten.mm else (args[1], args[2])
    return (int(a.shape[0]), int(b.shape[1]), int(a.shape[1]))


class _Recorder(TorchDispatchMode):
    """Every operator dispatched, by phase, folded into (phase, operator, arguments) with a count; and the bytes of
    the storages the operators create while they live (a weak reference tells when one is freed), by the phase that
    created them and their power of the length. Views and metadata operators are free (they move no data); their
    Python cost is the framework's, measured apart (trainscope.predict)."""

    def __init__(self, batch: int, length: int, avoid: set):
        super().__init__()
        self.batch, self.length, self.avoid = batch, length, avoid
        self.phase = "forward"
        self.ops: dict[tuple, Op] = {}
        self.dispatches: dict[str, int] = {}  # every operator dispatched, views included, by phase
        self.live: dict[int, tuple] = {}  # storage -> (bytes, kind, power, weak reference)
        self.totals = [0] * 6  # live bytes by (kind, power): activations 0, 1, 2, temporary 0, 1, 2
        self.moments: list[tuple] = []  # the totals at each local maximum while watching
        self.rising = False
        self.watching = False  # peaks are taken over the forward and backward only
        self.rng_made = WeakIdKeyDictionary()  # tensor -> its rng spec, for the outputs that hold generator state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._track(out)
        self.dispatches[self.phase] = self.dispatches.get(self.phase, 0) + 1
        if func.namespace != "aten" or func.is_view or func.overloadpacket in (aten._local_scalar_dense, aten.item):
            return out
        spec = self._spec_of(func, args, kwargs)
        for index in rng_outputs(func):
            if isinstance(out[index], torch.Tensor):
                self.rng_made[out[index]] = ("rng", str(func), spec, index)
        key = f"{func} {spec!r}"
        found = self.ops.get((self.phase, key))
        if found is not None:
            found.count += 1
            return out
        tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        floats = [t.dtype for t in tensors if t.dtype.is_floating_point]
        flops = (
            flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
            if func.overloadpacket in flop_registry
            else 0
        )
        power = max((length_power(t.shape, self.batch, self.length, self.avoid) for t in tensors), default=0)
        self.ops[(self.phase, key)] = Op(
            self.phase,
            str(func),
            key,
            spec,
            1,
            int(flops),
            _gemm_shape(func, args),
            str(floats[0]).removeprefix("torch.") if floats else "float32",
            max((t.numel() for t in tensors), default=0),
            power,
        )
        return out

    def _spec_of(self, func, args, kwargs) -> tuple:
        """(args, kwargs) as specs; a tensor of generator state as the rng spec of the call that made it."""

        def spec(value):
            if isinstance(value, torch.Tensor) and value in self.rng_made:
                return self.rng_made[value]
            return _spec(value)

        return pytree.tree_map(spec, (args, kwargs))

    def _track(self, out) -> None:
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            handle = storage._cdata
            if handle in self.live:
                continue
            size = storage.nbytes()
            power = length_power(tensor.shape, self.batch, self.length, self.avoid)
            slot = (0 if self.phase == "forward" else 3) + power  # what the forward made: activations; else temporary
            self.live[handle] = (size, slot, weakref.ref(storage, functools.partial(self._freed, handle)))
            self.totals[slot] += size
            self.rising = self.watching

    def _freed(self, handle, _reference) -> None:
        entry = self.live.pop(handle, None)
        if entry is None:
            return
        if self.rising:  # a local maximum of what lives: a candidate for the peak at some size
            self.moments.append(tuple(self.totals))
            self.rising = False
        self.totals[entry[1]] -= entry[0]

    def peaks(self) -> list[dict]:
        """The candidate peaks none of which another outgrows at every size (by kind and power)."""
        kept = []
        for moment in sorted(set(self.moments), key=sum, reverse=True):
            if not any(all(k >= m for k, m in zip(other, moment)) for other in kept):
                kept.append(moment)
        return [
            {
                "activations": {p: m[p] for p in range(3) if m[p]},
                "temporary": {p: m[3 + p] for p in range(3) if m[3 + p]},
            }
            for m in kept
        ]


class _SavedTensors:
    """Bytes autograd saves for backward, each storage once, parameters left out (they are the weights), by the
    top module running when it is saved (`embeddings`, `layer 3`, `classifier`) and by power of the length."""

    def __init__(self, parameters, batch: int, length: int, avoid: set):
        from torch.distributed._tools.mod_tracker import ModTracker

        self.tracker = ModTracker()
        self.batch, self.length, self.avoid = batch, length, avoid
        self.parameters = {p.untyped_storage()._cdata for p in parameters}
        self.seen: set = set()
        self.by_module: dict[str, dict] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in self.parameters and storage._cdata not in self.seen:
            self.seen.add(storage._cdata)
            powers = self.by_module.setdefault(_layer_of(self.tracker.parents), {})
            whole = tensor._base if tensor._base is not None else tensor  # a view's storage is its base's
            power = length_power(whole.shape, self.batch, self.length, self.avoid)
            powers[power] = powers.get(power, 0) + storage.nbytes()
        return tensor

    @contextlib.contextmanager
    def recording(self):
        with self.tracker, self.hooks:
            yield


def _layer_of(parents: set) -> str:
    """The numbered block running ('bert.encoder.layer.3' -> 'layer 3'), else the module below the model and its
    wrappers ('bert.embeddings' -> 'embeddings', 'classifier'), else 'model' (the loss)."""
    wrappers = {"base_model", "model", "module"}
    # ModTracker names modules by their path under the root, the root by its class name
    paths = [[part for part in name.split(".")[1:] if part not in wrappers] for name in parents if name != "Global"]
    numbered = [path for path in paths if any(part.isdigit() for part in path)]
    if numbered:
        path = max(numbered, key=len)
        return f"layer {[part for part in path if part.isdigit()][-1]}"
    path = max(paths, key=len, default=[])
    return path[1] if len(path) > 1 else path[0] if path else "model"


def _fake_parameters(model, fake_mode, device: torch.device) -> None:
    """Replace the meta parameters and buffers of `model` with fake tensors on `device` (shared ones stay shared)."""
    made = {}
    with fake_mode:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    if id(param) not in made:
                        made[id(param)] = torch.nn.Parameter(
                            torch.empty(param.shape, dtype=param.dtype, device=device),
                            requires_grad=param.requires_grad,
                        )
                    module._parameters[name] = made[id(param)]
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)


def _inputs(names, batch: int, length: int, device) -> dict:
    """A batch as the collator makes it: token ids, a mask, token types (values do not matter: fake tensors)."""
    return {name: torch.zeros(batch, length, dtype=torch.long, device=device) for name in names}


def _autocast(device: torch.device, precision: str):
    dtype = autocast_dtype(precision)
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def trace_training(
    build_model,
    input_names,
    batch: int,
    length: int,
    precision: str,
    device: torch.device,
    settings,
    avoid: set = frozenset(),
) -> Trace:
    """A training step of `build_model()` (a model on the meta device) on a fake (batch x length) batch, its optimizer
    the run's (trainscope.workload.modeling.build_optimizer: --optimizer-implementation, --weight-decay) and its
    clipping `settings.max_grad_norm`. `avoid`: every size of the model and batch besides the length (so each tensor's
    power of the length can be read)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainscope.workload.modeling import build_optimizer, classification_loss  # deferred: it loads transformers

    model = build_model()
    fake_mode = FakeTensorMode()
    _fake_parameters(model, fake_mode, device)
    model.train()
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    recorder, saved = _Recorder(batch, length, avoid), _SavedTensors(params, batch, length, avoid)
    with fake_mode:
        optimizer = build_optimizer(model, settings, device)
        batch_inputs = _inputs(input_names, batch, length, device)
        labels = torch.zeros(batch, dtype=torch.long, device=device)
        with recorder:
            # One forward and backward; the optimizer state, which a steady step holds throughout, is added to their
            # peak below (it is created by the first optimizer step, traced apart from a steady one).
            recorder.watching = True
            with saved.recording():
                with _autocast(device, precision):
                    logits = model(**batch_inputs).logits
                recorder.phase = "backward"  # the loss is timed with backward, as train_step times it
                loss = classification_loss(logits, labels)
            loss.backward()
            del logits, loss
            if recorder.rising:  # the backward ended on a maximum
                recorder.moments.append(tuple(recorder.totals))
            recorder.watching = recorder.rising = False
            _trace_optimizer_steps(optimizer, trainable, recorder, settings.max_grad_norm)
        optimizer_bytes = _optimizer_state_bytes(optimizer)
    return _training_trace(batch, length, recorder, saved, params, trainable, optimizer_bytes)


def _trace_optimizer_steps(optimizer, trainable: list, recorder: _Recorder, max_grad_norm: float | None) -> None:
    """Clipping, the optimizer's step and zero_grad, as the first step runs them (it creates the optimizer state),
    then as a steady one; the gradients they read are made in a `setup` phase, which is no part of the step."""
    for phase in OPTIMIZER_PHASES[::-1]:
        recorder.phase = "setup"
        for p in trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        recorder.phase = phase
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _optimizer_state_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors, each storage once."""
    state = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    }
    return sum(state.values())


def _training_trace(
    batch: int, length: int, recorder: _Recorder, saved: _SavedTensors, params: list, trainable: list, optimizer_bytes
) -> Trace:
    """The step's operators (the setup phase's left out), the memory it holds throughout (parameters, optimizer
    state), what it saves for backward, its candidate peaks and its parameters' sizes."""
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    memory = {"parameters": {0: param_bytes}, "optimizer": {0: optimizer_bytes}}
    ops = [op for op in recorder.ops.values() if op.phase != "setup"]
    return Trace(
        batch,
        length,
        ops,
        memory,
        saved.by_module,
        peaks=recorder.peaks(),
        dispatches=recorder.dispatches,
        parameters=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in trainable),
        parameter_bytes=param_bytes,
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
    )


def trace_evaluation(
    build_model, input_names, batch: int, length: int, precision: str, device: torch.device, avoid: set = frozenset()
) -> Trace:
    """One evaluation batch as trainscope.workload.step.evaluate_split runs it: forward without gradients in eval mode, the
    per-sample loss and the argmax."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = build_model()
    fake_mode = FakeTensorMode()
    _fake_parameters(model, fake_mode, device)
    model.eval()
    recorder = _Recorder(batch, length, avoid)
    recorder.phase = "eval"
    with fake_mode, torch.no_grad():
        batch_inputs = _inputs(input_names, batch, length, device)
        labels = torch.zeros(batch, dtype=torch.long, device=device)
        with recorder:
            with _autocast(device, precision):
                logits = model(**batch_inputs).logits
            F.cross_entropy(logits.float(), labels, reduction="none")
            logits.argmax(-1)
    return Trace(batch, length, list(recorder.ops.values()), {}, {}, dispatches=recorder.dispatches)
