"""What make gpu-check's estimates rest on: the launch, step and compile times measured by the gpu-checks on one
H200 (MEASURED_*) and those not measured on GPU (ASSUMED_*); from them a launch of train.py's estimate, what only a
first launch costs, a check's timeout, and the plan's estimated total, its default budget and its parts, each part
one command that fits a session (trainscope.gpu.plan lays out the checks).
"""

import math
from collections.abc import Callable

# ---- what the estimates rest on. MEASURED_*: the make gpu-checks on a GPU (one NVIDIA H200;
# benchmarks/gpu/nvidia-h200.*; the runs each figure comes from: docs/benchmarks.md#the-gpu-plans-estimates-trainscopegpuestimatespy).
# ASSUMED_*: not measured on GPU.
MEASURED_LAUNCH_S = 23.0  # one single-GPU launch of train.py less its steps, its operators already timed
MEASURED_FIRST_LAUNCH_S = 45.0  # the first launch's extra. The matmul peak and the layer probes are cached per
#                                  process count (trainscope.measure.peak.machine_key): the first launch of each
#                                  process count pays it
MEASURED_STEP_S = {"fp32": 0.060, "bf16": 0.040, "fp16": 0.047}  # steady steps, batch 32 x 128
MEASURED_COMPILE_S = 104.0  # a compiled bf16 launch less an eager one whose operators were timed before, and its steps
ASSUMED_STEP_S = {"tf32": 0.06}  # not yet run on a GPU (run 2's budget ended before it)
ASSUMED_PROCESS_GROUP_S = 5.0  # a 2-process launch: the second process and the process group
ASSUMED_COMPILE_PROCESSES = 1.5  # two processes compiling at once on one host's cores: 1.5x one compile
ASSUMED_OP_COSTS_S = 8.0  # a launch whose precision and process count this machine has not predicted before times
#                           the prediction's operators in a child process (Python, torch, a CUDA context)
ASSUMED_SCRIPT_S = 8.0  # a benchmark script's own start: imports, data, CUDA context
ASSUMED_EXTRA_S = {"snapshot": 5.0, "profile": 10.0, "search": 15.0}  # a snapshot's pickle (Python frames only),
#                                                 the trace and CUPTI, the batch search's out-of-memory tries
MEASURED_LOADER_PASS_S = 1.0  # loaders_bench: one pass over 4096 samples at batch 512 x 512, with and without workers
ASSUMED_DP_LOOP_S = 2.0  # compare_dp.py: one in-process loop (22 MiniLM steps of 32)
ASSUMED_SCALER_S = 10.0  # the scaler check's process: Python, torch, a CUDA context and 16 tiny steps
# Two processes sharing one GPU over gloo: each step's compute twice over on the one GPU, and the gradients through
# host memory at the bus bandwidth make ddp-cost measured over gloo, their copies to and from the GPU besides (the
# arithmetic: docs/benchmarks.md#the-gpu-plans-estimates-trainscopegpuestimatespy)
ASSUMED_SHARED_STEP_FACTOR = 2.0
ASSUMED_GLOO_STEP_S = 0.45
TIMEOUT_FACTOR, MIN_TIMEOUT_S = 3.0, 60.0  # a launch is killed past 3x its estimate (at least a minute)
MARGIN = 1.15  # the default budget: the plan's estimate and 15%
PART_LIMIT_S = 600.0  # at most one command's time on a machine that lends its GPU 10 minutes a command
SESSION_S = 900.0  # the device time one session is lent (15 minutes), the machine's start and transfers included
# What a session spends besides the checks, not measured (the H200 sessions kept no timing of it): the machine's start
# (a minute or more, 1-2 minutes a kind tried: the device tool's notes), `make setup` there (the venv over the
# machine's torch, the requirements from carried wheels) and each command's transfers (the working tree there, the
# results back)
ASSUMED_MACHINE_START_S = 120.0
ASSUMED_SETUP_S = 60.0
ASSUMED_TRANSFER_S = 30.0


def step_seconds(precision: str) -> float:
    return MEASURED_STEP_S.get(precision) or ASSUMED_STEP_S[precision]


def train_estimate(steps: int, precision: str, processes: int = 1, extra: float = 0.0, shared: bool = False) -> float:
    """Seconds for one launch of train.py: the fixed cost, the steps at their step time, and extras; on a GPU
    `shared` by its processes over gloo, each step's compute twice over and the gradients through host memory."""
    step = step_seconds(precision) * (ASSUMED_SHARED_STEP_FACTOR if shared else 1.0) + (
        ASSUMED_GLOO_STEP_S if shared else 0.0
    )
    return MEASURED_LAUNCH_S + (ASSUMED_PROCESS_GROUP_S if processes > 1 else 0.0) + steps * step + extra


def timeout_for(estimate: float) -> float:
    return max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * estimate)


def first_costs(steps: list[dict]) -> None:
    """Add to the estimates what only a first launch costs: the first launch of each process count (the machine's
    matmul peak and layer probes, cached per process count, and on the first of all the predictor's calibration:
    MEASURED_FIRST_LAUNCH_S) and the first of each precision and process count (its operators timed in a child
    process, ASSUMED_OP_COSTS_S). TF32 runs the fp32 operators (timed by fp32's launch)."""
    cold, timed = set(), set()
    for step in steps:
        if step.get("skipped") or "config" not in step:
            continue
        extra, notes = 0.0, []
        if step["processes"] not in cold:
            cold.add(step["processes"])
            extra += MEASURED_FIRST_LAUNCH_S
            notes.append(f"first launch of {step['processes']} process(es) +{MEASURED_FIRST_LAUNCH_S:.0f} s")
        kind = ("fp32" if step["precision"] == "tf32" else step["precision"], step["processes"])
        if kind not in timed:
            timed.add(kind)
            extra += ASSUMED_OP_COSTS_S
            notes.append(f"operator costs +{ASSUMED_OP_COSTS_S:.0f} s")
        if extra:
            step["estimate_s"] += extra
            step["timeout_s"] = timeout_for(step["estimate_s"])
            step["estimate"] += "; " + ", ".join(notes)


def planned_seconds(steps: list[dict]) -> float:
    """The plan's estimated total: every check that is not skipped."""
    return sum(step["estimate_s"] for step in steps if not step.get("skipped"))


def default_budget(steps: list[dict]) -> float:
    """The plan's estimate and MARGIN, rounded up to 10 s."""
    return 10.0 * math.ceil(planned_seconds(steps) * MARGIN / 10.0)


def session_overhead_s() -> float:
    """What a session lent for one part spends besides its checks: the machine's start, set-up and transfers."""
    return ASSUMED_MACHINE_START_S + ASSUMED_SETUP_S + ASSUMED_TRANSFER_S


def part_limit_s() -> float:
    """The most a part's default budget may be: one command's limit, and what a session leaves of its device time
    after the machine's start, set-up and transfers."""
    return min(PART_LIMIT_S, SESSION_S - session_overhead_s())


def cut(steps: list[dict], charge: Callable[[list[dict]], list[dict]], limit_s: float | None = None) -> None:
    """Number the checks, in order, into parts (`part`) whose default budgets fit `limit_s` (default
    `part_limit_s()`), each check's estimate as `charge` makes it in its part alone (charged copies of a part's
    checks: a part's first launches pay their cold start), so a part's estimate is that of its checks planned alone.
    A skipped check rides along with the part before it, at no cost."""
    limit_s = part_limit_s() if limit_s is None else limit_s
    numbered: list[list[dict]] = [[]]
    for step in steps:
        fits = default_budget(charge([*numbered[-1], step])) <= limit_s
        if not step.get("skipped") and any(not s.get("skipped") for s in numbered[-1]) and not fits:
            numbered.append([])
        numbered[-1].append(step)
    for number, part in enumerate(numbered, 1):
        for step, charged in zip(part, charge(part), strict=True):
            step.clear()
            step.update(charged, part=number)


def parts(steps: list[dict]) -> list[list[dict]]:
    """The plan's checks grouped by their `part`, in order."""
    grouped: dict[int, list[dict]] = {}
    for step in steps:
        grouped.setdefault(step.get("part", 1), []).append(step)
    return [grouped[number] for number in sorted(grouped)]
