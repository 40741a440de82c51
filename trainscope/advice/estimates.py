"""Estimates from the run's own measurement: what another precision, thread count or a doubled batch would make of
this run, read from the record alone.

How it works: docs/tune.md#in-the-code-estimates-from-the-runs-own-model-trainscopeadviceestimatespy."""

import itertools
from dataclasses import dataclass

from trainscope.core.record_view import RunView

# The model timed alone may take more than the micro-batch that ran it (a busier machine after the loop): up to this
# factor it is taken as all of it; beyond it the timing and the run disagree and no estimate is given.
MAX_MODEL_OVER_STEP = 1.5
# How much a whole run's steady time per micro-batch moves between runs of the same command on one machine, at least
# (the as-it-is runs of make bench-advice: docs/tune.md#estimates-against-what-the-change-measures-make-bench-advice).
RUN_NOISE = 0.05
# How much a change's timed ratio moves between runs of the same command, at least (the causal LM's bf16 read 1.12x to
# 1.19x in six runs' timings, and 1.27x in one: docs/tune.md#estimates-against-what-the-change-measures-make-bench-advice).
RATIO_NOISE = 0.05
# The shapes the machine's peak block times for a transformer: Q, K, V and output projections share a shape, one
# feed-forward up, one down (trainscope.measure.peak.TRANSFORMER_WEIGHTS; not imported: peak loads torch).
TRANSFORMER_WEIGHTS = (4, 1, 1)


class Unavailable(Exception):
    """Why the record cannot give an estimate."""


@dataclass
class Estimate:
    gain: float | None  # the whole training step this many times faster (per sample for a batch change)
    low: float | None = None
    high: float | None = None
    assumes: str = ""
    evidence: str = ""
    unavailable: str | None = None  # why there is no estimate
    failed: bool = False  # the estimate raised (a defect, or a record of another shape), rather than lacking data


def unavailable(why: str) -> Estimate:
    return Estimate(None, unavailable=why)


def guarded(compute, *args) -> Estimate:
    """`compute(*args)`, or the estimate unavailable with its reason: a record it cannot read (Unavailable), or a
    failure inside the estimate, shown rather than swallowed."""
    try:
        return compute(*args)
    except Unavailable as why:
        return unavailable(str(why))
    except Exception as error:  # a defect or a record of another shape: said in the advice, never silently dropped
        return Estimate(None, unavailable=f"{type(error).__name__}: {' '.join(str(error).split())[:200]}", failed=True)


# ---------------------------------------------------------------- the run's own model


def timed(view: RunView) -> bool:
    """The record holds its model timed alone (the run asked for it: time_model, --time-model, trainscope tune's advice
    run); else the rules that read the machine's rates at the run's shapes speak, and these estimates say why not."""
    return bool((view.run_operations or {}).get("configurations"))


def _configuration(operations: dict, name: str) -> dict:
    found = next((c for c in operations.get("configurations") or [] if c["name"] == name), None)
    if found is None:
        raise Unavailable(f"the run's model was not timed as {name!r}")
    if not found.get("seconds"):
        raise Unavailable(f"timing the model as {name!r} failed: {found.get('error') or 'no seconds recorded'}")
    return found


def model_of(view: RunView) -> tuple[dict, float, dict, str]:
    """(the operations block, seconds per micro-batch, the run's own configuration's seconds, a note where those
    exceed the micro-batch's): the share's two sides, or Unavailable with the reason."""
    operations = view.run_operations
    if operations is None:
        raise Unavailable("the record holds no timing of the run's own model (records from before issue 60)")
    if not operations.get("configurations"):
        raise Unavailable(operations.get("reason") or "the run's model was not timed")
    micro_batch = view.micro_batch_s
    if not micro_batch:
        raise Unavailable("the record has no training time per micro-batch")
    run = _configuration(operations, "run")["seconds"]
    over = run["median"] / micro_batch
    if over > MAX_MODEL_OVER_STEP:
        raise Unavailable(
            f"the model timed alone took {over:.1f}x a micro-batch's measured time: the machine was busier when it "
            "was timed than in the run"
        )
    note = f" (alone it took {over:.0%} of it: taken as all of it)" if over > 1 else ""
    return operations, micro_batch, run, note


def _model_words(operations: dict, micro_batch: float, run: dict) -> str:
    share = min(1.0, run["median"] / micro_batch)
    return (
        f"the model's forward and backward, timed alone after the loop on its own micro-batch "
        f"({operations.get('precision')}, {operations.get('threads')} thread(s)): {run['median'] * 1e3:.3g} ms of each "
        f"{micro_batch * 1e3:.3g} ms micro-batch ({share:.0%})"
    )


def _busy(operations: dict) -> str:
    others = operations.get("others_cores")
    return f"; other processes kept {others:.1f} cores busy while it was timed" if others and others > 0.25 else ""


def _amdahl(micro_batch: float, old: float, new: float) -> float:
    """The micro-batch's speed-up when the model's part `old` of it (at most all of it) takes `new`."""
    taken = min(old, micro_batch)
    return micro_batch / max(1e-12, micro_batch - taken + new * taken / old)


def _sides(micro_batch: float, run: dict) -> dict:
    """The micro-batch's seconds with the spread the model's own timed calls had (the machine's noise while it was
    timed), at least RUN_NOISE either way: the record keeps the steady phase's total, not each step's."""
    low, high = run["low"] / run["median"], run["high"] / run["median"]
    return {
        "median": micro_batch,
        "low": micro_batch * min(low, 1 - RUN_NOISE),
        "high": micro_batch * max(high, 1 + RUN_NOISE),
    }


def _ratio(config: dict, run: dict) -> dict:
    """A configuration's seconds over the run's: each round's pair where the record has them (interleaved rounds),
    else the two's spreads against each other; at least RATIO_NOISE either way."""
    found = config.get("ratio") or {
        "median": config["seconds"]["median"] / run["median"],
        "low": config["seconds"]["low"] / run["high"],
        "high": config["seconds"]["high"] / run["low"],
    }
    middle = found["median"]
    return {
        "median": middle,
        "low": min(found["low"], middle * (1 - RATIO_NOISE)),
        "high": max(found["high"], middle * (1 + RATIO_NOISE)),
    }


def _ranged(compute, *sides: dict) -> tuple[float, float, float]:
    """(the estimate at every side's median, its least and its greatest over every side's low, median and high)."""
    point = compute(*(side["median"] for side in sides))
    corners = [compute(*values) for values in itertools.product(*((s["low"], s["median"], s["high"]) for s in sides))]
    return point, min(corners + [point]), max(corners + [point])


NOISE = (
    "the interval: every combination of the model's timed seconds (10th to 90th percentile), their ratio to the "
    f"change's in the same rounds (at least {RATIO_NOISE:.0%} either way) and the micro-batch's time (as wide as the "
    f"calls, at least {RUN_NOISE:.0%} either way: whole runs vary so much)"
)


def precision(view: RunView, target: str) -> Estimate:
    """Training in `target` (autocast from fp32 weights, the outputs converted to fp32) instead of the run's
    precision: the model's share of each micro-batch at the ratio it was timed at; the rest unchanged."""
    if view.run_operations is None:
        return _precision_from_peak(view, target)
    operations, micro_batch, run, note = model_of(view)
    config = _configuration(operations, f"precision {target}")
    ratio = _ratio(config, run)
    gain, low, high = _ranged(
        lambda whole, old, times: _amdahl(whole, old, old * times), _sides(micro_batch, run), run, ratio
    )
    rest = max(0.0, 1 - run["median"] / micro_batch)
    return Estimate(
        gain,
        low,
        high,
        assumes=f"the rest of each micro-batch ({rest:.0%}: the optimizer, the data, a loss outside the model, the "
        "loop) unchanged in time; the model as timed alone, autocast's casts and the outputs' conversion to fp32 "
        f"included; {NOISE}",
        evidence=f"{_model_words(operations, micro_batch, run)}{note}; in {target} autocast "
        f"{config['seconds']['median'] * 1e3:.3g} ms ({1 / ratio['median']:.2f}x in the same rounds)"
        + _busy(operations),
    )


def threads(view: RunView, count: int) -> Estimate:
    """The run at `count` intra-op threads: the model as timed at them; the rest between unchanged and changed as
    much (the estimate the two's geometric mean)."""
    operations, micro_batch, run, note = model_of(view)
    config = _configuration(operations, f"threads {count}")
    ratio = _ratio(config, run)
    sides = (_sides(micro_batch, run), run, ratio)
    unchanged = _ranged(lambda whole, old, times: _amdahl(whole, old, old * times), *sides)
    alike = _ranged(lambda whole, old, times: 1 / times, *sides)  # the rest gains what the model gains
    return Estimate(
        (unchanged[0] * alike[0]) ** 0.5,
        min(unchanged[1], alike[1]),
        max(unchanged[2], alike[2]),
        assumes="the rest of each micro-batch (the optimizer, the data, the loop) between unchanged and changed as "
        f"much as the model, the estimate halfway (geometric mean); {NOISE}",
        evidence=f"{_model_words(operations, micro_batch, run)}{note}; at {count} thread(s) "
        f"{config['seconds']['median'] * 1e3:.3g} ms ({1 / ratio['median']:.2f}x in the same rounds)"
        + _busy(operations),
    )


def batch(view: RunView) -> Estimate:
    """Twice the rows per micro-batch, per sample: the model as timed on twice the rows; the optimizer stage, paid
    once per step, half as often for the same samples; the rest of the micro-batch (the data stage included) between
    fixed and doubled (the estimate halfway)."""
    operations, micro_batch, run, note = model_of(view)
    config = _configuration(operations, "rows x2")
    per_step = operations.get("micro_batches_per_step") or 1.0
    stages = view.stage_seconds_per_step()
    optimizer, data = stages.get("optimizer", 0.0) / per_step, stages.get("data", 0.0) / per_step

    def per_sample(grows: float):
        def compute(whole: float, old: float, times: float) -> float:
            taken = min(old, whole)
            rest = max(0.0, whole - taken - optimizer)
            # a micro-batch of twice the rows: the optimizer once, the rest (data included) x `grows`
            return 2 * whole / (optimizer + grows * rest + times * taken)

        return compute

    ratio = _ratio(config, run)
    sides = (_sides(micro_batch, run), run, ratio)
    gain = _ranged(per_sample(1.5), *sides)[0]
    low, high = _ranged(per_sample(2.0), *sides)[1], _ranged(per_sample(1.0), *sides)[2]
    rest = max(0.0, micro_batch - min(run["median"], micro_batch) - optimizer)
    memory = view.peak_memory
    return Estimate(
        gain,
        min(low, gain),
        max(high, gain),
        assumes=f"the optimizer stage ({optimizer * 1e3:.3g} ms a micro-batch) once per step; the rest "
        f"({rest * 1e3:.3g} ms: the data stage's {data * 1e3:.3g} ms, a loss outside the model, the loop) between "
        "fixed and doubled (a DataLoader's batch costs per batch and per sample), the estimate halfway; twice the rows "
        "ran when timed" + (f" (the run's {memory[1]} {memory[0]:.2g} GiB)" if memory[0] else "") + f"; {NOISE}",
        evidence=f"{_model_words(operations, micro_batch, run)}{note}; on twice the rows "
        f"{config['seconds']['median'] * 1e3:.3g} ms ({2 / ratio['median']:.2f}x per row, in the same rounds)"
        + _busy(operations),
    )


def thread_counts(view: RunView) -> list[int]:
    """The thread counts the record's model was timed at, other than the run's."""
    operations = view.run_operations or {}
    return [c["threads"] for c in operations.get("configurations") or [] if c["name"].startswith("threads ")]


def precisions(view: RunView) -> list[str]:
    """The precisions the record's model was timed in, other than the run's; for older records, those of the
    machine's peak block."""
    operations = view.run_operations
    if operations is not None and operations.get("configurations"):
        return [c["precision"] for c in operations["configurations"] if c["name"].startswith("precision ")]
    names = ((view.machine_peak or {}).get("precisions") or {}).keys()
    return [name for name in names if name != view.precision]


# ---------------------------------------------------------------- older records: the matmul rates at the model's shapes


def _shape_rate(block: dict, precision_name: str, which: str) -> float:
    """The FLOP-weighted rate of a precision's recorded transformer shapes (the peak block's shapes other than its
    square: Q/K/V/output, feed-forward up, down)."""
    rates = ((block.get("precisions") or {}).get(precision_name) or {}).get("rates") or []
    shaped = [r for r in rates if len(set(r["shape"])) > 1][:3]
    if len(shaped) != 3:
        raise Unavailable(
            f"the record has neither its model timed nor rates at the model's GEMM shapes in {precision_name}"
        )
    flops = [w * 2 * r["shape"][0] * r["shape"][1] * r["shape"][2] for r, w in zip(shaped, TRANSFORMER_WEIGHTS)]
    seconds = [f / r[which] for f, r in zip(flops, shaped)]
    return sum(flops) / sum(seconds)


def _precision_from_peak(view: RunView, target: str) -> Estimate:
    """A record without its model timed: the model FLOPs at the fp32 rate recorded at the model's GEMM shapes, as the
    matmuls' share of the steady training time; that share at the target's recorded rate."""
    block, measured = view.machine_peak or {}, view.measured_peak or {}
    estimate = measured.get("gap_estimate") or {}
    train_s, floor_s, peak = estimate.get("train_s"), estimate.get("floor_s"), measured.get("peak_tflops")
    if not (train_s and floor_s and peak):
        raise Unavailable("the record has neither its model timed nor the model FLOPs against its recorded peak")
    source = view.precision or "fp32"
    rates = {
        (name, which): _shape_rate(block, name, which)
        for name in (source, target)
        for which in ("tflops", "low", "high")
    }
    shares = {which: min(1.0, floor_s * peak / rates[(source, which)] / train_s) for which in ("tflops", "low", "high")}

    def gain(share: float, old: float, new: float) -> float:
        return 1.0 / (1.0 - share + share * old / new)

    point = gain(shares["tflops"], rates[(source, "tflops")], rates[(target, "tflops")])
    low = gain(shares["high"], rates[(source, "high")], rates[(target, "low")])
    high = gain(shares["low"], rates[(source, "low")], rates[(target, "high")])
    return Estimate(
        point,
        min(low, point),
        max(high, point),
        assumes="every model FLOP a matmul at the rate recorded at the model's GEMM shapes (casts not counted); the "
        "rest of the step unchanged",
        evidence=f"the model's matmuls at {rates[(source, 'tflops')] * 1e3:.0f} GFLOP/s (recorded at its GEMM shapes "
        f"in {source}) are {shares['tflops']:.0%} of the steady training time; in {target} "
        f"{rates[(target, 'tflops')] * 1e3:.0f} GFLOP/s ({rates[(target, 'tflops')] / rates[(source, 'tflops')]:.2f}x)",
    )
