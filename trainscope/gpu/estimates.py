"""What make gpu-check's estimates rest on: the launch, step and start-up times measured by the gpu-checks on one
H200 (MEASURED_*) and those not measured on GPU (ASSUMED_*); from them a launch of train.py's estimate, what only a
machine's first launches cost, a check's timeout, and the plan's estimated total, its default budget and its parts,
each part one command that fits a session (trainscope.gpu.checks declares the checks, trainscope.gpu.plan lays
them out).
"""

import math
from collections.abc import Callable

# MEASURED_*: the gpu-checks on one NVIDIA H200; ASSUMED_*: not measured on GPU. Where each figure comes from:
# docs/gpu.md#what-the-estimates-rest-on.
MEASURED_LAUNCH_S = 31.0  # one process's launch less its steps, its operators timed before
MEASURED_PROCESS_GROUP_S = 10.0  # what two processes' launch adds
MEASURED_STEP_S = {"fp32": 0.060, "bf16": 0.045, "fp16": 0.047}  # steady steps, batch 32 x 128
MEASURED_SHARED_STEP_S = {"fsdp": 0.70, "ddp": 0.31, "ddp_fp16": 0.31}  # two processes sharing one GPU over gloo
MEASURED_BUCKET_TIMING_S = {"none": 11.0, "bf16": 11.0, "fp16": 19.0}  # DDP's bucket timing after training, by hook
MEASURED_EXTRA_S = {"fsdp": 9.0, "profile": 7.0}  # above a check's launch and steps
MEASURED_COMPILE_S = 104.0  # a compiled bf16 launch less an eager one whose operators were timed before, and its steps
ASSUMED_STEP_S = {"tf32": 0.06}  # not yet run on a GPU
ASSUMED_COMPILE_PROCESSES = 1.5  # two processes compiling at once on one host's cores: 1.5x one compile
# What only a machine's first launches pay: the predictor's calibration (once per machine) and the prediction's
# operators timed in a child process (once per precision and process count)
MEASURED_CALIBRATION_S = 43.0
OP_COSTS_S = {1: 8.0, 2: 17.5}
ASSUMED_SCRIPT_S = 8.0  # a benchmark script's own start: imports, data, CUDA context
ASSUMED_EXTRA_S = {"snapshot": 5.0, "search": 15.0}  # a snapshot's pickle, the batch search's out-of-memory tries
MEASURED_LOADER_PASS_S = 1.0  # loaders_bench: one pass over 4096 samples at batch 512 x 512, with and without workers
ASSUMED_DP_LOOP_S = 2.0  # compare_dp.py: one in-process loop (22 MiniLM steps of 32)
ASSUMED_SCALER_S = 10.0  # the scaler check's process: Python, torch, a CUDA context and 16 tiny steps
TIMEOUT_FACTOR, MIN_TIMEOUT_S = 3.0, 60.0  # a launch is killed past 3x its estimate (at least a minute)
MARGIN = 1.15  # the default budget: the plan's estimate and 15%
COMMAND_S = 600.0  # at most one command's time on a machine that lends its GPU 10 minutes a command
ASSUMED_COMMAND_SETUP_S = 30.0  # the command's own work before the check starts: the carried wheels installed
PART_LIMIT_S = COMMAND_S - ASSUMED_COMMAND_SETUP_S
SESSION_S = 900.0  # the device time one session is lent (15 minutes), the machine's start and transfers included
# What a session spends besides the checks (not measured): the machine's start, `make setup` there, the transfers
ASSUMED_MACHINE_START_S = 120.0
ASSUMED_SETUP_S = 60.0
ASSUMED_TRANSFER_S = 30.0


def step_seconds(precision: str) -> float:
    return MEASURED_STEP_S.get(precision) or ASSUMED_STEP_S[precision]


def train_estimate(
    steps: int, precision: str, processes: int = 1, extra: float = 0.0, shared_step: float | None = None
) -> float:
    """Seconds for one launch of train.py: the fixed cost, the steps at their step time (`shared_step`: the measured
    step of processes sharing one GPU over gloo), and extras."""
    step = step_seconds(precision) if shared_step is None else shared_step
    return MEASURED_LAUNCH_S + (MEASURED_PROCESS_GROUP_S if processes > 1 else 0.0) + steps * step + extra


def timeout_for(estimate: float) -> float:
    return max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * estimate)


def cold_costs(step: dict) -> dict[str, float]:
    """What a training check pays where it is the machine's first of its kind: the calibration (the first of all) and
    its precision's operators timed (the first of each precision and process count; TF32 runs the fp32 ones)."""
    if "config" not in step:
        return {}
    kind = "fp32" if step["precision"] == "tf32" else step["precision"]
    processes = step["processes"]
    return {"calibration": MEASURED_CALIBRATION_S, f"operators {kind} x{processes}": OP_COSTS_S[min(processes, 2)]}


def first_costs(steps: list[dict], paid: set[str] = frozenset()) -> None:
    """Charge each cold cost (cold_costs) to the first check not skipped that needs it and that `paid` (those the
    checks that ran already paid) does not hold, each check's earlier charge replaced: a check skipped at run time
    hands its charge to the next one that needs it. Timeouts grow with the estimates, never shrink."""
    charged = set(paid)
    for step in steps:
        if "config" not in step:
            continue
        step["estimate_s"] -= sum(step.pop("cold", {}).values())
        if step.get("skipped"):
            continue
        cold = {what: seconds for what, seconds in cold_costs(step).items() if what not in charged}
        charged |= set(cold)
        step["estimate_s"] += sum(cold.values())
        step["timeout_s"] = max(step.get("timeout_s", 0.0), timeout_for(step["estimate_s"]))
        step["estimate"] = step["estimate"].split("; cold:")[0] + (
            "; cold: " + ", ".join(f"{what} +{seconds:.0f} s" for what, seconds in cold.items()) if cold else ""
        )
        if cold:
            step["cold"] = cold


def scaled(estimate: float, done: list[dict]) -> float:
    """`estimate` scaled by what the checks that ran to their end took against their estimates (1 before any)."""
    ended = [c for c in done if c.get("exit") == 0 and not c.get("skipped") and c.get("estimate_s")]
    planned = sum(c["estimate_s"] for c in ended)
    return estimate * (sum(c["seconds"] for c in ended) / planned if planned else 1.0)


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
    """The most a part's default budget may be: one command's limit less its set-up, and what a session leaves of its
    device time after the machine's start, set-up and transfers."""
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
