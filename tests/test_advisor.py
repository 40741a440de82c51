"""The advisor's rules on planted records (trainscope tune's closed loop: tests/test_tune_runs.py)."""

import json
import random
from types import SimpleNamespace

import pytest
from conftest import ROOT, plant

import report
from trainscope.advice import advisor, changes
from trainscope.core.record_view import RunView
from trainscope.measure import flops

STAGES = ("data", "forward", "backward", "optimizer", "eval", "other")
SHAPE = {"layers": 6, "hidden": 384, "intermediate": 1536}  # MiniLM-L6


def record(shares=None, run_shares=None, **changes) -> dict:
    """A complete record with a healthy CPU run; `changes` plant symptoms (dotted paths as a__b)."""
    shares = {
        "data": 0.005,
        "forward": 0.35,
        "backward": 0.5,
        "optimizer": 0.1,
        "eval": 0.0,
        "other": 0.045,
        **(shares or {}),
    }
    run_shares = {**shares, "eval": 0.02, **(run_shares or {})}
    table = lambda values: {"wall_s": {"median": 10.0}, "shares": {s: {"median": values[s]} for s in STAGES}}  # noqa: E731
    planted = {
        "run_name": "planted",
        "warnings": [],
        "settings": {
            "num_workers": 0,
            "pin_memory": None,
            "epochs": 1,
            "group_by_length": False,
            "pad_to_max_length": False,
            "per_device_batch_size": 32,
            "eval_batch_size": None,
            "gradient_accumulation_steps": 1,
            "ddp_comm_hook": "none",
        },
        "environment": {
            "device": "cpu",
            "device_name": "AMD EPYC",
            "effective_precision": "fp32",
            "backend": None,
            "cpu_native_bf16": False,
            "cpu_capability": "AVX2, no native bf16",
            "threads": {
                "torch_threads": 2,
                "thread_budget": 2,
                "usable_cores": 2,
                "local_processes": 1,
                "threads_source": "auto",
            },
            "device_memory_gib": None,
        },
        "model": {"optimizer": {"name": "AdamW", "fused": True}, "shape": SHAPE},
        "summary": {
            "timing": {"across_ranks": {"steady": table(shares), "run": table(run_shares)}},
            "throughput": {"tokens": 1000, "padded_tokens": 1010, "samples": 32, "padded_squares": 32000},
            "memory": {},
            "mfu": None,
        },
    }
    return plant(planted, **changes)


def rules(found) -> list[str]:
    return [s.rule for s in found]


def test_a_healthy_record_gets_no_suggestion():
    assert advisor.advise(record()) == []
    assert advisor.lines([]) == ["No suggestion: no measured share leaves 2% to gain."]


def test_a_data_bound_loop_gets_workers_with_an_amdahl_bound():
    found = advisor.advise(record(shares={"data": 0.4, "forward": 0.2, "backward": 0.3}))
    (data,) = [s for s in found if s.rule == "data_loading"]
    assert data.flags == ["--num-workers", "1"]  # 2 usable cores: one for the compute, one for a worker
    assert data.gain == pytest.approx(1 / 0.6) and data.gain_kind == "bound" and data.confidence == "low"
    assert data.gain_text() == "at most 1.67x faster"
    assert "data 40.0% of the steady step, 0 workers, 2 usable cores" in data.evidence


def test_threads_below_the_budget_are_an_estimate_with_its_factor():
    found = advisor.advise(
        record(
            environment__threads={
                "torch_threads": 1,
                "thread_budget": 4,
                "usable_cores": 4,
                "local_processes": 1,
                "threads_source": "launcher",
            }
        )
    )
    (threads,) = [s for s in found if s.rule == "threads"]
    assert threads.flags == ["--threads", "auto"] and threads.gain == pytest.approx(1 / (1 - 0.95 + 0.95 / 4))
    assert threads.gain_kind == "estimate" and "linear scaling" in threads.gain_text()


def test_the_padding_bound_counts_the_flops_spent_on_padding_positions():
    planted = record(
        summary__throughput={"tokens": 600, "padded_tokens": 1000, "samples": 10, "padded_squares": 100_000},
        summary__evaluation_tokens={"tokens": 600, "padded_tokens": 1000, "samples": 10, "padded_squares": 100_000},
    )
    (padding,) = [s for s in advisor.advise(planted) if s.rule == "padding"]
    n, attention = flops.matmul_parameters(6, 384, 1536), 6 * 384
    train = 1 - (6 * n * 600 + 12 * attention * 600**2 / 10) / (6 * n * 1000 + 12 * attention * 100_000)
    evaluation = 1 - (2 * n * 600 + 4 * attention * 600**2 / 10) / (2 * n * 1000 + 4 * attention * 100_000)
    assert padding.gain == pytest.approx(1 / (1 - 0.85 * train - 0.02 * evaluation))
    # no measured time share says what padding costs: the FLOPs share taken as time is an estimate, said so
    assert padding.gain_kind == "estimate" and padding.flags == ["--group-by-length"]
    assert padding.gain_text().startswith(
        f"estimate {padding.gain:.2f}x faster (forward, backward and evaluation time "
        "taken as proportional to their matmul FLOPs"
    )
    assert "40% of the training token positions" in padding.evidence
    assert advisor.advise(plant(planted, settings__group_by_length=True)) == []
    # without the evaluation's own counts its padding is assumed to be training's: said as an estimate
    (guess,) = [
        s
        for s in advisor.advise(
            record(summary__throughput={"tokens": 600, "padded_tokens": 1000, "samples": 10, "padded_squares": 100_000})
        )
        if s.rule == "padding"
    ]
    assert guess.gain_kind == "estimate" and "not recorded" in guess.factor


def test_padding_also_gets_the_exact_changes_that_skip_it_each_with_its_kind():
    """Beside --group-by-length (a training change: the order), the exact changes that leave what is learned alone:
    padding-free layers (the token-wise matmuls' padded FLOPs: 6N per position; attention stays padded) and
    evaluation in length order (its own padding). Both are available: make tune launches them."""
    planted = record(
        run_shares={"eval": 0.3},
        summary__throughput={"tokens": 600, "padded_tokens": 1000, "samples": 10, "padded_squares": 100_000},
        summary__evaluation_tokens={"tokens": 600, "padded_tokens": 1000, "samples": 10, "padded_squares": 100_000},
    )
    found = {s.rule: s for s in advisor.advise(planted)}
    n, attention = flops.matmul_parameters(6, 384, 1536), 6 * 384
    tokenwise = 6 * n * 400 / (6 * n * 1000 + 12 * attention * 100_000)
    assert found["unpad"].flags == ["--unpad"] and found["unpad"].gain == pytest.approx(1 / (1 - 0.85 * tokenwise))
    evaluation = 1 - (2 * n * 600 + 4 * attention * 600**2 / 10) / (2 * n * 1000 + 4 * attention * 100_000)
    assert found["eval_order"].flags == ["--eval-order", "length"]
    assert found["eval_order"].gain == pytest.approx(1 / (1 - 0.3 * evaluation))
    assert found["unpad"].kind == found["eval_order"].kind == "exact" and found["padding"].kind == "training"
    assert found["unpad"].unavailable is None and found["padding"].unavailable is None
    listed = "\n".join(advisor.lines(list(found.values())))
    assert "(`--unpad`; exact)" in listed
    assert "(`--group-by-length`; training)" in listed
    # a run that used them already is not told to: what padding is left there is no flag's to remove
    used = {s.rule for s in advisor.advise(plant(planted, settings__unpad=True, settings__eval_order="length"))}
    assert "padding" in used and not used & {"unpad", "eval_order"}


def test_every_suggestion_carries_the_kind_the_catalogue_gives_its_flags():
    found = advisor.advise(record(shares={"data": 0.4, "forward": 0.2, "backward": 0.3}))
    (data,) = [s for s in found if s.rule == "data_loading"]
    assert data.kind == "exact" and data.unavailable is None  # loader settings: the same batches

    assert changes.kind_of(["--hidden-dropout", "0"]) == "training" and changes.kind_of([], "bf16") == "numeric"
    assert changes.kind_of(["--num-workers", "2", "--tf32"]) == "numeric"  # the strictest part decides
    assert changes.kind_of(["--made-up-flag"]) == "training"  # not in the catalogue: may change what is learned
    assert changes.unavailable(["--made-up-flag"]) == "not available in this build (train.py has no --made-up-flag)"
    assert changes.unavailable(["--eval-order", "length"]) is None
    assert changes.unavailable(["--eval-order", "length"], settings={"compile"}) == (
        "not available in this build (train.py has no --eval-order)"
    )  # a build whose settings lack the flag
    # compile draws eager's random numbers (inductor's fallback_random): exact, up to rounding
    assert changes.kind_of(["--compile"]) == "exact" and changes.kind_of(["--compile", "--unpad"]) == "exact"


@pytest.mark.parametrize(
    "plan,words",
    [
        (
            {"optimizer_steps": 30, "steps_per_epoch": 125},
            "different samples -- the run is shorter than an epoch (30 of 125",
        ),
        (
            {"optimizer_steps": 200, "steps_per_epoch": 125},
            "different samples -- the run is not a whole number of epochs",
        ),
        ({"optimizer_steps": 250, "steps_per_epoch": 125}, "the same samples, another order"),
        ({}, "the same samples, another order"),
    ],
)
def test_grouping_by_length_says_different_samples_when_the_run_stops_inside_an_epoch(plan, words):
    planted = record(
        summary__throughput={"tokens": 600, "padded_tokens": 1000, "samples": 10, "padded_squares": 100_000}
    )
    (padding,) = [s for s in advisor.advise({**planted, "plan": plan}) if s.rule == "padding"]
    assert padding.changes_result.startswith(f"training batches grouped by length: {words}")


@pytest.mark.parametrize("seed", range(5))
def test_the_padding_bound_is_never_below_what_removing_the_padding_saves(seed):
    """Real FLOPs of unpadded sequences (the PaLM formula per sequence) against the padded batches: the saved
    share is at most the bound, attention's quadratic term included."""
    rng = random.Random(seed)
    config = SimpleNamespace(num_hidden_layers=6, hidden_size=384, intermediate_size=1536)
    batches = [[rng.randint(4, 128) for _ in range(32)] for _ in range(8)]
    padded = sum(flops.training_flops(config, len(b), max(b)) for b in batches)
    real = sum(flops.training_flops(config, 1, length) for b in batches for length in b)
    lengths = [length for b in batches for length in b]
    bound = flops.padding_flops_share(
        SHAPE, sum(lengths), sum(32 * max(b) for b in batches), len(lengths), sum(32 * max(b) ** 2 for b in batches)
    )
    assert 0 < 1 - real / padded <= bound + 1e-12


def test_the_evaluation_rule_argues_from_kernel_launches_only_on_a_gpu_and_the_fused_optimizer_on_both():
    evaluation_heavy = dict(run_shares={"eval": 0.4})
    unfused = dict(
        shares={"optimizer": 0.3, "backward": 0.3},
        model={"optimizer": {"name": "AdamW", "fused": False, "foreach": True}, "shape": SHAPE},
    )
    assert advisor.advise(record(**evaluation_heavy)) == []
    gpu = {"environment__device": "cuda:0", "environment__device_name": "NVIDIA H100 80GB HBM3"}
    (evaluation,) = [s for s in advisor.advise(record(**evaluation_heavy, **gpu)) if s.rule == "evaluation"]
    assert evaluation.flags == ["--eval-batch-size", "128"] and evaluation.gain_kind == "estimate"
    assert "x1.25" in evaluation.factor
    for where in ({}, gpu):  # torch has a fused AdamW kernel for the CPU too
        (optimizer,) = [s for s in advisor.advise(record(**unfused, **where)) if s.rule == "optimizer"]
        assert optimizer.gain_kind == "estimate" and "x3" in optimizer.factor and "foreach" in optimizer.evidence
        assert optimizer.flags == ["--optimizer-implementation", "fused"]


def test_gpu_rules_precision_batch_and_memory_are_estimates():
    gpu = {
        "environment__device": "cuda:0",
        "environment__device_name": "NVIDIA H100 80GB HBM3",
        "environment__device_memory_gib": 80.0,
    }
    found = advisor.advise(record(summary__mfu=0.12, summary__memory={"max_allocated_gib": {"max": 20.0}}, **gpu))
    precision = next(s for s in found if s.rule == "precision")
    assert precision.config == "bf16" and precision.gain > 1.5 and precision.gain_kind == "estimate"
    batch = next(s for s in found if s.rule == "batch")
    assert batch.flags == ["--per-device-batch-size", "64"] and batch.changes_result == "the effective batch doubles"
    assert batch.gain_kind == "estimate"
    full = advisor.advise(record(summary__mfu=0.45, summary__memory={"max_allocated_gib": {"max": 75.0}}, **gpu))
    assert "memory" in rules(full) and "batch" not in rules(full)


def test_a_cpu_with_native_bf16_gets_bf16_from_the_runs_own_timing_never_the_peak_ratio_on_every_stage():
    """The bf16 estimate is Amdahl's law on the share of the micro-batch the model's own forward and backward took,
    at the ratio they were timed at in bf16 after the loop (issue 60: the 2048^3 peak ratio on every stage promised
    4.5x where 1.2x was measured). A schema 3 record (a 1024^2 matmul timed at start-up) has no such timing: its
    item says the estimate is unavailable, and why."""
    native = {
        "environment__cpu_native_bf16": True,
        "environment__cpu_capability": "AVX512 + avx512_bf16",
        "environment__cpu_bf16_matmul": {"size": 1024, "threads": 2, "fp32_s": 0.017, "bf16_s": 0.010, "speedup": 1.7},
    }
    (bf16,) = [s for s in advisor.advise(record(**native)) if s.rule == "cpu_precision"]
    assert bf16.config == "bf16" and bf16.gain is None
    assert bf16.gain_text().startswith("estimate unavailable: the record has neither its model timed")
    assert "cpu_precision" not in rules(advisor.advise(record()))  # emulated bf16: nothing to say
    timed = plant(record(**native), **model_timed(run=0.006, bf16=0.002, micro_batch=0.01))
    (bf16,) = [s for s in advisor.advise(timed) if s.rule == "cpu_precision"]
    assert bf16.gain == pytest.approx(0.01 / (0.01 - 0.006 + 0.002))  # 60% of the micro-batch, 3x faster
    assert bf16.gain_kind == "estimate" and bf16.interval[0] <= bf16.gain <= bf16.interval[1]
    assert "assumes the rest of each micro-batch (40%" in bf16.gain_text()
    slow = plant(timed, **model_timed(run=0.006, bf16=0.0059, micro_batch=0.01))
    assert "cpu_precision" not in rules(advisor.advise(slow))  # 1.01x: below MIN_GAIN


def model_timed(run: float, bf16: float | None = None, micro_batch: float = 0.01, **others) -> dict:
    """Plant the record's timing of its own model (trainscope.measure.operations): seconds per micro-batch of each
    configuration (median; low and high 5% around it), and a steady phase of 100 micro-batches of `micro_batch`."""

    def config(name, seconds, **where):
        spread = {"median": seconds, "low": seconds * 0.95, "high": seconds * 1.05}
        return {"name": name, "precision": "fp32", "threads": 2, "rows": 1, **where, "seconds": spread, "calls": 5}

    configurations = [config("run", run)]
    if bf16 is not None:
        configurations.append(config("precision bf16", bf16, precision="bf16"))
    for name, seconds in others.items():
        configurations.append(config(name.replace("_", " "), seconds))
    counts = {"samples": 3200, "micro_batches": 100, "optimizer_steps": 100, "tokens": 0}
    return {
        "summary__measured_peak": {
            "run_shapes": {
                "operations": {
                    "configurations": configurations,
                    "precision": "fp32",
                    "threads": 2,
                    "micro_batches_per_step": 1.0,
                    "others_cores": 0.0,
                }
            }
        },
        "summary__throughput__train_wall_s": 100 * micro_batch,
        "summary__timing__per_rank": [{"counts": {"steady": counts, "warmup": counts}}],
    }


def test_exposed_communication_rules_follow_the_backend():
    block = {
        "measured": True,
        "method": "direct",
        "exposed_s": 0.05,
        "exposed_interval": [0.045, 0.056],
        "exposed_resolved": True,
        "exposed_share": 0.2,
        "transfer_s": 0.1,
    }
    nccl = advisor.advise(record(summary__communication=block, environment__backend="nccl"))
    assert {"ddp_buckets", "ddp_compression", "ddp_accumulation"} <= set(rules(nccl))
    assert next(s for s in nccl if s.rule == "ddp_buckets").gain == pytest.approx(1.25)
    gloo = advisor.advise(record(summary__communication=block, environment__backend="gloo"))
    assert rules(gloo) == ["ddp_accumulation"]  # no NCCL argument on gloo


def test_an_unresolved_exposed_time_bounds_no_gain():
    """An interval that includes 0 (or spans more than the time) is no share of anything, whatever its median."""
    unresolved = {
        "measured": True,
        "method": "direct",
        "exposed_s": 0.05,
        "exposed_interval": [0.0, 0.3],
        "exposed_resolved": False,
        "exposed_share": 0.2,
        "transfer_s": 0.1,
    }
    assert not {"ddp_buckets", "ddp_accumulation"} & set(
        rules(advisor.advise(record(summary__communication=unresolved, environment__backend="nccl")))
    )
    # a schema 3 two-pass estimate whose calibration spread crossed zero, as the committed ddp_cost runs' did
    old = {
        "measured": True,
        "exposed_s": 0.3,
        "exposed_share": 0.2,
        "total_allreduce_s": 0.4,
        "exposed_spread": {"median": 0.3, "min": -0.160, "max": 0.5, "n": 10},
    }
    timed = {"tokens": 1000, "padded_tokens": 1010, "samples": 32, "padded_squares": 32000, "step_s": 1.5}
    assert "ddp_accumulation" not in rules(
        advisor.advise(record(summary__communication=old, summary__throughput=timed))
    )
    resolved_old = {**old, "exposed_spread": {"median": 0.3, "min": 0.25, "max": 0.35, "n": 10}}
    assert "ddp_accumulation" in rules(
        advisor.advise(record(summary__communication=resolved_old, summary__throughput=timed))
    )


def test_a_warning_whose_fix_is_a_rule_is_one_item_ranked_first():
    planted = record(
        environment__threads={
            "torch_threads": 1,
            "thread_budget": 2,
            "usable_cores": 2,
            "local_processes": 1,
            "threads_source": "user",
        },
        warnings=[{"code": "threads_below_budget", "message": "1 torch threads, budget 2"}],
    )
    (only,) = advisor.advise(planted)
    assert only.rule == "threads" and only.fix_first and only.gain > 1 and "budget 2" in only.evidence


def test_warnings_come_first_with_the_fix_their_registry_entry_offers():
    planted = record(
        shares={"data": 0.5, "forward": 0.2, "backward": 0.2},
        warnings=[{"code": "profiler_on", "message": "the profiler was on"}],
    )
    found = advisor.advise(planted)
    assert found[0].fix_first and found[0].rule == "warning:profiler_on" and found[1].rule == "data_loading"
    assert found[0].change == "time without --profile (profile in a separate run)"


def test_advise_prints_a_ranked_list_and_refuses_bad_input(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    planted = record(
        summary__throughput={"tokens": 600, "padded_tokens": 1000, "samples": 10, "padded_squares": 100_000}
    )
    planted.update(schema_version=2, status="complete")
    planted["summary"].update(world_size=1, test={})
    (tmp_path / "run" / "record.json").write_text(json.dumps(planted))
    report.main(["--advise", str(tmp_path / "run")])
    assert "1. batch sequences of similar length" in capsys.readouterr().out
    for bad in (tmp_path / "missing", tmp_path / "future"):
        if bad.name == "future":
            bad.mkdir()
            (bad / "record.json").write_text('{"schema_version": 7}')
        with pytest.raises(SystemExit) as exit_info:
            report.main(["--advise", str(bad)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and "record.json" in err[0]


# ---------------------------------------------------------------- the gap to the measured peak (trainscope.measure.gap)

MATH_ATTENTION = {"training": "MATH", "evaluation": "FLASH_ATTENTION", "attention_dropout": 0.1}


def categories(**seconds) -> dict:
    return {**{c: 0.0 for c in gap_categories()}, **{k.replace("_", " "): v for k, v in seconds.items()}}


def gap_categories():
    from trainscope.measure.gap import CATEGORIES

    return CATEGORIES


def profiled(**changes) -> dict:
    """A record whose profile put 10% of the traced steps in hidden dropout, 20% inside attention (2% its
    dropout) and 30% in elementwise categories overall, under the math attention path."""
    breakdown = {
        "window_s": 1.0,
        "basis": "self CPU time, main thread",
        "matmul_flops": 1e11,
        "matmul_s": 0.4,
        "categories": categories(
            matmul=0.4,
            attention=0.1,
            dropout=0.12,
            layer_norm=0.04,
            activation=0.02,
            copies_and_casts=0.02,
            other_operators=0.3,
        ),
        "attention_total_s": 0.2,
        "attention_dropout_s": 0.02,
    }
    return record(
        **{
            "environment__sdpa_kernels": MATH_ATTENTION,
            "summary__profile": {"breakdown": breakdown},
            "model": {"optimizer": {"fused": True}, "shape": SHAPE, "dropout": {"hidden": 0.1, "attention": 0.1}},
            **changes,
        }
    )


def test_gap_rules_fire_on_the_profiles_measured_shares_with_amdahl_bounds():
    found = {s.rule: s for s in advisor.advise(profiled())}
    training = 0.98  # the planted run spends 2% evaluating
    attention, dropout = found["attention_kernel"], found["dropout"]
    assert attention.flags == ["--attention-dropout", "0"] and attention.gain_kind == "bound"
    assert attention.gain == pytest.approx(1 / (1 - 0.2 * training)) and "MATH" in attention.evidence
    assert dropout.flags == ["--hidden-dropout", "0"] and dropout.gain_kind == "bound"
    assert dropout.gain == pytest.approx(1 / (1 - 0.10 * training))  # attention's own dropout is not counted twice
    assert "regularization" in attention.changes_result and "regularization" in dropout.changes_result
    assert "compile" not in found  # 30 s of assumed compile time against a 10 s run: no gain left


def test_the_compile_rule_counts_its_compile_time_against_a_long_runs_fusion():
    long = profiled(summary__wall_s=600.0)
    (fusion,) = [s for s in advisor.advise(long) if s.rule == "compile"]
    elementwise = (0.1 + 0.12 + 0.04 + 0.02 + 0.02) * 0.98
    assert fusion.gain == pytest.approx(1 / (1 - elementwise / 2 + 30 / 600)) and fusion.gain_kind == "estimate"
    assert "compile time 30 s (assumed)" in fusion.factor and "dynamic shapes" in fusion.evidence
    # compile draws eager's random numbers (inductor's fallback_random): the same dropout masks, exact
    assert fusion.kind == "exact" and "eager's random numbers" in fusion.changes_result


def test_the_fused_kernel_rule_needs_dropout_to_be_what_keeps_it_out():
    assert "attention_kernel" not in rules(
        advisor.advise(
            profiled(
                environment__sdpa_kernels={
                    "training": "FLASH_ATTENTION",
                    "evaluation": "FLASH_ATTENTION",
                    "attention_dropout": 0.0,
                }
            )
        )
    )
    assert "attention_kernel" not in rules(
        advisor.advise(
            profiled(environment__sdpa_kernels={"training": "MATH", "evaluation": "MATH", "attention_dropout": 0.1})
        )
    )  # math either way: not dropout's doing
    assert not {"attention_kernel", "dropout", "compile"} & set(
        rules(advisor.advise(record(environment__sdpa_kernels=MATH_ATTENTION)))
    )  # no gap measured at all: no gap rule


def test_without_a_profile_the_gap_rules_are_estimates_from_one_layer_profiled_apart():
    layer = {
        "window_s": 0.05,
        "batch": 32,
        "length": 64,
        "precision": "fp32",
        "attention_total_s": 0.01,
        "attention_dropout_s": 0.001,
        "categories": categories(matmul=0.025, attention=0.004, dropout=0.006),
    }
    estimated = record(
        environment__sdpa_kernels=MATH_ATTENTION,
        summary__measured_peak={"peak_tflops": 0.2, "run_shapes": {"layer": layer}},
    )
    found = {s.rule: s for s in advisor.advise(estimated)}
    compute = 0.35 + 0.5  # forward + backward of the planted run
    assert found["attention_kernel"].gain_kind == "estimate"
    assert found["attention_kernel"].gain == pytest.approx(1 / (1 - 0.2 * compute))
    assert found["dropout"].gain == pytest.approx(1 / (1 - 0.1 * compute))
    assert "one encoder layer profiled apart at batch 32 x length 64" in found["dropout"].factor


@pytest.mark.parametrize(
    "rate,doubled,spread,optimizer,resolved",
    [
        (0.05, 0.08, 0.1, 0.0, True),  # the matmuls alone
        (0.05, 0.08, 0.3, 0.0, False),  # their spreads overlap: not resolved, and nothing else to gain
        (0.05, 0.051, 0.0, 0.2, False),  # the optimizer's share alone: a fifth of the run, half as often
        (0.05, 0.08, 0.1, 0.2, True),  # both
    ],
)
def test_a_bigger_batch_counts_faster_matmuls_at_twice_the_tokens_and_half_the_optimizer_steps(
    rate, doubled, spread, optimizer, resolved
):
    measured = {
        "peak_tflops": 0.1,
        "gap_estimate": {"floor_s": 4.0, "train_s": 9.8},
        "run_shapes": {
            "tokens": 2048,
            "batch": 32,
            "length": 64,
            "tflops": rate,
            "tflops_doubled": doubled,
            "tflops_high": rate * (1 + spread),
            "tflops_doubled_low": doubled * (1 - spread),
            "layer": None,
        },
    }
    planted = record(run_shares={"optimizer": optimizer}, summary__measured_peak=measured, summary__wall_s=10.0)
    found = [s for s in advisor.advise(planted) if s.rule == "batch_at_peak"]
    matmul_share = 4.0 * 0.1 / rate / 9.8 * 0.98  # the model's matmuls at the run's rate, of the run
    saved = (matmul_share * (1 - rate / doubled) if resolved else 0.0) + optimizer / 2
    assert bool(found) is (saved > 0)
    if found:
        assert found[0].gain == pytest.approx(1 / (1 - saved)) and found[0].gain_kind == "estimate"
        assert (
            found[0].flags == ["--per-device-batch-size", "64"] and "effective batch doubles" in found[0].changes_result
        )
    accumulating = plant(planted, settings__gradient_accumulation_steps=2)  # same effective batch: same steps
    found = [s for s in advisor.advise(accumulating) if s.rule == "batch_at_peak"]
    assert bool(found) is resolved
    if found:
        assert found[0].flags == ["--per-device-batch-size", "64", "--gradient-accumulation-steps", "1"]
        assert found[0].changes_result is None


@pytest.mark.parametrize("native,speedup,fires", [(False, 2.2, True), (True, 0.9, False), (None, 3.0, True)])
def test_bf16_advice_follows_the_measured_matmuls_whatever_the_flags_say(native, speedup, fires):
    """Without the run's model timed, bf16 is named where this CPU's bf16 matmuls measured faster, whatever its flags
    say (the flags beside it), with no estimate: the machine's peak says nothing of this run's share."""
    bf16 = {
        "flags": ["avx512_bf16"] if native else [],
        "native_by_flags": native,
        "fp32_tflops": 0.2,
        "bf16_tflops": 0.2 * speedup,
        "speedup": speedup,
        "faster": speedup > 1,
    }
    found = [s for s in advisor.advise(record(environment__cpu_bf16=bf16)) if s.rule == "cpu_precision"]
    assert bool(found) is fires
    if fires:
        assert found[0].gain is None and found[0].gain_text().startswith("estimate unavailable")
        assert ("avx512_bf16" in found[0].evidence) is bool(native)


# ---------------------------------------------------------------- a host-bound GPU (summary.device_time)


def h200_bf16(**changes) -> dict:
    """The committed H200 bf16 run (benchmarks/gpu/nvidia-h200.json, check precision-bf16: roberta-base, batch 32 x
    128, 48 steady steps of 40 ms, MFU 5.4%) as a record: its summary's own figures, `device_time` computed from them
    as train.py computes it, the settings from its command, the environment its machine had (an H200's 143771 MiB,
    16 cores; the fused AdamW, the default)."""
    from trainscope.measure import summary

    checks = json.loads((ROOT / "benchmarks" / "gpu" / "nvidia-h200.json").read_text())
    check = next(c for c in checks["checks"] if c["name"] == "precision-bf16")
    timing, measured = check["timing"], check["measured_peak"]
    planted = {
        "run_name": "h200-bf16",
        "warnings": [],
        "settings": {
            "per_device_batch_size": 32,
            "gradient_accumulation_steps": 1,
            "num_workers": 0,
            "pin_memory": None,
            "epochs": 1,
            "compile": False,
            "pad_to_max_length": True,
            "group_by_length": False,
            "eval_batch_size": None,
            "ddp_comm_hook": "none",
        },
        "environment": {
            "device": "cuda:0",
            "device_name": "NVIDIA H200",
            "effective_precision": check["precision"],
            "timing_mode": timing["mode"],
            "device_memory_gib": 143771 / 1024,
            "backend": None,
            "threads": {
                "torch_threads": 16,
                "thread_budget": 16,
                "usable_cores": 16,
                "local_processes": 1,
                "threads_source": "auto",
            },
        },
        "model": {"optimizer": {"name": "AdamW", "fused": True, "foreach": None}},
        "summary": {
            "world_size": 1,
            "optimizer_steps": 50,
            "timing": timing,
            "throughput": check["throughput"],
            "mfu": check["mfu"],
            "memory": check["memory"],
            "measured_peak": measured,
            "compile": check["compile"],
            "wall_s": timing["across_ranks"]["run"]["wall_s"]["median"],
            "device_time": summary.device_time(timing["per_rank"], "steady", timing["mode"], measured["run_shapes"]),
        },
    }
    return plant(planted, **changes)


def batch_flags(found) -> list:
    return [s for s in found if s.flags[:1] == ["--per-device-batch-size"]]


def test_the_committed_h200_bf16_run_is_host_bound_and_gets_what_shortens_the_hosts_part_ranked():
    record = h200_bf16()
    block = record["summary"]["device_time"]
    # its spans are host time (the device caught up): the events' bound says little; the layer's kernels say half
    assert block["idle_share_at_least"] == pytest.approx(0.033, abs=0.001)
    assert block["kernel_estimate"]["idle_share"] == pytest.approx(0.50, abs=0.01)
    assert block["host_bound"] is True and block["host_bound_by"] == "kernel estimate"
    found = advisor.advise(record)
    assert found[0].rule == "host_bound" and found[0].gain == pytest.approx(1 / (1 - 0.499), rel=0.01)
    headline = found[0].evidence
    assert "idle at least 3%" in headline and "idle about 50%" in headline and "MFU 5.4%" in headline
    ranked = headline.split("what helps, ranked: ")[1]
    assert ranked.index("--per-device-batch-size 64") < ranked.index("--num-workers 4")  # 1.76x before 1.12x
    assert "fused already" in ranked
    # CUDA graphs from the run's own split: the host's 28.4 ms of forward and backward gone, its other 11.4 ms beside
    # the device's 20.0 ms: 2.00x on the steady step, not won back in a 4 s run
    assert "CUDA graphs (--compile --compile-mode reduce-overhead): about 2.00x on the steady step" in ranked
    assert "paying back its compile time (40 s assumed) after about" in ranked and "not in a run this short" in ranked
    (batch,) = batch_flags(found)  # the host-bound batch, not a second one from the MFU rule
    assert batch.rule == "batch" and "3.3 of 140 GiB" in batch.evidence and batch.gain_kind == "estimate"
    wall, data, busy = block["step_wall_s"], block["stage_spans_s"]["data"], block["kernel_estimate"]["busy_s"]
    assert batch.gain == pytest.approx(wall / max((wall - data) / 2 + data, busy))
    rules_found = rules(found)
    assert "compile" not in rules_found and "optimizer" not in rules_found  # a 4 s run; fused already
    assert not {"dropout", "attention_kernel"} & set(rules_found)  # device-time savings: not on a host-bound step
    assert rules_found.index("batch") < rules_found.index("data_loading")


def test_the_host_bound_rule_offers_only_what_applies():
    long = h200_bf16(summary__wall_s=3600.0)  # an hour: the compile time pays back
    (graphs,) = [s for s in advisor.advise(long) if s.rule == "compile"]
    assert graphs.flags == ["--compile", "--compile-mode", "reduce-overhead"] and graphs.kind == "exact"
    assert "CUDA graphs" in graphs.change and graphs.gain_kind == "estimate" and "a step of 20.0 ms" in graphs.factor
    block, run = long["summary"]["device_time"], long["summary"]["wall_s"]
    steady, training = (
        block["step_wall_s"] / block["kernel_estimate"]["busy_s"],
        1 - RunView(long).shares("run")["eval"],
    )
    assert graphs.gain == pytest.approx(1 / (1 - (1 - 1 / steady) * training + 40 / run))  # the compile time counted
    assert graphs.interval[0] < graphs.gain  # in sequence: the host's rest after the device's forward and backward
    already = advisor.advise(h200_bf16(summary__wall_s=3600.0, settings__compile_mode="reduce-overhead"))
    assert "compile" not in rules(already) and "CUDA graphs: captured already" in already[0].evidence
    unfused = h200_bf16(model={"optimizer": {"name": "AdamW", "fused": False, "foreach": True}})
    found = advisor.advise(unfused)
    assert "optimizer" in rules(found) and "use the fused AdamW" in found[0].evidence.split("not offered")[0]
    full = advisor.advise(h200_bf16(summary__memory={"max_allocated_gib": {"max": 80.0}}))
    assert batch_flags(full) == [] and "twice it does not fit" in full[0].evidence
    unknown = advisor.advise(h200_bf16(model={}))
    assert "does not say the optimizer's implementation" in unknown[0].evidence


def test_no_host_bound_advice_on_a_device_bound_gpu_run_or_a_cpu_run():
    from trainscope.measure import summary

    device_bound = h200_bf16()
    layer = device_bound["summary"]["measured_peak"]["run_shapes"]["layer"]
    layer["window_s"] = 2.5e-3  # 12 x 2.5 ms: the device fills the step
    timing = device_bound["summary"]["timing"]
    device_bound["summary"]["device_time"] = summary.device_time(
        timing["per_rank"], "steady", "events", device_bound["summary"]["measured_peak"]["run_shapes"]
    )
    assert device_bound["summary"]["device_time"]["host_bound"] is False
    found = advisor.advise(device_bound)
    assert "host_bound" not in rules(found)
    (batch,) = batch_flags(found)  # the MFU rule's batch, as before
    assert batch.evidence.startswith("MFU 5%")
    cpu = record(summary__device_time=summary.device_time([], "steady", "host"))
    assert "host_bound" not in rules(advisor.advise(cpu))
    # a CPU record planted with a host-bound verdict still gets none: the rule is a GPU's
    planted = record(summary__device_time=h200_bf16()["summary"]["device_time"])
    assert "host_bound" not in rules(advisor.advise(planted))


def test_a_measured_host_bound_verdict_is_high_confidence_and_claims_no_ceiling_without_the_kernel_estimate():
    measured = h200_bf16()
    block = measured["summary"]["device_time"]
    block.update(
        busy_at_most_s=0.02,
        idle_share_at_least=0.5,
        kernel_estimate=None,
        host_bound=True,
        host_bound_by="event spans",
    )
    found = advisor.advise(measured)
    (headline,) = [s for s in found if s.rule == "host_bound"]
    assert headline.confidence == "high" and headline.gain is None  # a lower bound on idle bounds no gain
    (batch,) = batch_flags(found)
    wall, data = block["step_wall_s"], block["stage_spans_s"]["data"]
    assert batch.gain == pytest.approx(wall / max((wall - data) / 2 + data, 0.02))


def test_unpad_is_not_offered_on_a_host_bound_step_its_flops_estimate_would_mislead():
    """The committed H200 run with the encoder's shape and dynamic padding planted (74% of its positions padding):
    host-bound, --unpad is not offered (its estimate counts FLOPs as time; it ran 0.87x there) and the not-offered
    list says why; the same run with the device busy gets it, on its FLOPs."""
    shape = {"layers": 12, "hidden": 768, "intermediate": 3072}
    padded = dict(settings__pad_to_max_length=False, settings__unpad=False)
    bound = h200_bf16(model={"optimizer": {"name": "AdamW", "fused": True}, "shape": shape}, **padded)
    found = advisor.advise(bound)
    (headline,) = [s for s in found if s.rule == "host_bound"]
    assert "unpad" not in rules(found) and "--unpad: its estimate counts FLOPs" in headline.evidence
    busy = h200_bf16(
        model={"optimizer": {"name": "AdamW", "fused": True}, "shape": shape}, summary__device_time={}, **padded
    )
    (unpad,) = [s for s in advisor.advise(busy) if s.rule == "unpad"]
    assert unpad.flags == ["--unpad"] and "matmul FLOPs on padding positions" in unpad.factor
