"""Every health warning fires on a record planted with its condition and stays silent on a clean one."""

import copy
import json

import pytest
from conftest import ROOT, plant

from trainscope.core.record_view import RunView
from trainscope.measure import health, machine_kinds

CLEAN = {
    "settings": {"profile": False, "tf32": False, "compile": False, "memory_every": 10},
    "environment": {
        "device": "cpu",
        "device_name": "AMD EPYC",
        "cpu_capability": "AVX2, no native bf16",
        "cpu_native_bf16": False,
        "requested_precision": "no",
        "effective_precision": "fp32",
        "tf32_in_effect": False,
        "threads": {
            "torch_threads": 2,
            "thread_budget": 2,
            "usable_cores": 2,
            "local_processes": 1,
            "threads_source": "auto",
        },
        "requested_max_seq_length": 128,
        "model_sequence_limit": 512,
    },
    "summary": {
        "throughput": {"optimizer_steps": 40},
        "mfu": None,
        "compile": None,
        "timing": {"across_ranks": {"run": {"shares": {"eval": {"median": 0.2}}}}},
    },
}


def planted(**changes):
    return plant(copy.deepcopy(CLEAN), **changes)


def test_a_clean_record_has_no_warnings():
    assert health.check(CLEAN) == []


@pytest.mark.parametrize(
    "changes,code",
    [
        ({"environment__threads__torch_threads": 1}, "threads_below_budget"),
        ({"environment__threads__torch_threads": 4}, "threads_above_budget"),
        ({"settings__profile": True}, "profiler_on"),
        ({"environment__effective_precision": "bf16"}, "bf16_emulated"),
        ({"environment__requested_precision": "fp16"}, "fp16_unavailable"),
        ({"environment__tf32_in_effect": True}, "tf32_implicit"),
        ({"summary__compile": {"recompiles": 3}}, "recompiles"),
        (
            {"environment__device": "cuda:0", "settings__memory_every": 1, "summary__mfu": 0.4},
            "stage_memory_every_step",
        ),
        ({"summary__timing": {"across_ranks": {"run": {"shares": {"eval": {"median": 0.7}}}}}}, "eval_dominates"),
        ({"summary__throughput": {"optimizer_steps": 3}}, "few_steady_steps"),
        ({"environment__device": "cuda:0", "environment__device_name": "NVIDIA A10G"}, "mfu_unknown"),
        ({"environment__requested_max_seq_length": 4096}, "max_seq_length_clamped"),
        (
            {
                "environment__device": "cuda:0",
                "environment__device_name": "Tesla T4",
                "environment__effective_precision": "bf16",
                "environment__gpu_native_bf16": False,
                "summary__mfu": 0.1,
            },
            "gpu_bf16_emulated",
        ),
        (
            {
                "environment__device": "cuda:0",
                "environment__device_name": "Tesla V100-SXM2-16GB",
                "settings__tf32": True,
                "environment__tf32_supported": False,
                "summary__mfu": 0.1,
            },
            "tf32_unsupported",
        ),
        (
            {
                "environment__cpu_fallback": {"processes": 2, "requested_precision": "fp16"},
                "environment__requested_precision": "no",
            },
            "ran_on_cpu",
        ),
        (
            {
                "environment__device": "cuda:0",
                "environment__device_name": "NVIDIA H100 80GB HBM3",
                "settings__memory_snapshot": True,
            },
            "memory_snapshot_on",
        ),
        ({"settings__tuned_on": "cpu AVX512, bf16 native: Intel(R) Xeon(R) Processor"}, "tuned_elsewhere"),
        (
            {
                "summary__communication": {
                    "measured": True,
                    "method": "direct",
                    "exposed_s": 0.2,
                    "exposed_resolved": True,
                    "exposed_interval": [0.18, 0.22],
                    "transfer_s": 0.1,
                }
            },
            "comm_exposed_above_total",
        ),
        (
            {
                "summary__communication": {
                    "measured": True,
                    "method": "direct",
                    "exposed_s": 0.02,
                    "exposed_resolved": False,
                    "exposed_interval": [0.001, 0.06],
                    "steps": 14,
                }
            },
            "comm_not_resolved",
        ),
        (
            {
                "summary__communication": {
                    "measured": True,
                    "method": "direct",
                    "exposed_s": 0.05,
                    "exposed_resolved": True,
                    "agreement": {
                        "ddp": {
                            "verdict": "disagree",
                            "pairs": 8,
                            "median_difference": 0.04,
                            "interval": [0.035, 0.045],
                            "tolerance": 0.015,
                        }
                    },
                }
            },
            "comm_instruments_disagree",
        ),
        (
            {
                "summary__communication": {
                    "measured": True,
                    "method": "direct",
                    "exposed_s": 0.05,
                    "exposed_resolved": True,
                    "agreement": {
                        "ddp": {
                            "verdict": "agree",
                            "pairs": 8,
                            "median_difference": 0.0,
                            "interval": [-0.001, 0.001],
                            "tolerance": 0.015,
                            "overlap": {
                                "verdict": "undecided",
                                "pairs": 5,
                                "median_difference": 0.02,
                                "interval": None,
                                "tolerance": 0.1,
                            },
                        }
                    },
                }
            },
            "comm_instruments_undecided",
        ),
    ],
)
def test_each_condition_raises_its_warning(changes, code):
    warnings = health.check(planted(**changes))
    assert [w["code"] for w in warnings] == [code]
    assert warnings[0]["message"] and "\n" not in warnings[0]["message"]


def test_bf16_on_a_cpu_with_native_units_is_not_called_emulated():
    assert health.check(planted(environment__effective_precision="bf16", environment__cpu_native_bf16=True)) == []


def _cpu_bf16(speedup: float, native: bool | None, flags=("avx512_bf16",)) -> dict:
    return {
        "flags": list(flags) if native else [],
        "native_by_flags": native,
        "fp32_tflops": 0.2,
        "bf16_tflops": 0.2 * speedup,
        "speedup": speedup,
        "faster": speedup > 1.0,
    }


@pytest.mark.parametrize(
    "native,speedup,codes",
    [
        (True, 0.6, ["bf16_not_faster"]),  # the flags say native, the timing says slower: the timing is said
        (None, 0.3, ["bf16_not_faster"]),  # no flags to read (a container hiding /proc/cpuinfo): the timing decides
        (False, 0.05, ["bf16_emulated"]),  # the flags already say emulated: one warning, not two
        (True, 4.4, []),  # native and faster: nothing to say
    ],
)
def test_bf16_detection_reads_the_flags_and_the_timing_together(native, speedup, codes):
    record = planted(
        environment__effective_precision="bf16",
        environment__cpu_native_bf16=native,
        environment__cpu_bf16=_cpu_bf16(speedup, native),
    )
    warnings = health.check(record)
    assert [w["code"] for w in warnings] == codes
    if codes == ["bf16_not_faster"]:
        assert f"{speedup:.2f}x fp32's" in warnings[0]["message"]
    fp32 = planted(environment__cpu_native_bf16=native, environment__cpu_bf16=_cpu_bf16(speedup, native))
    assert health.check(fp32) == []  # an fp32 run is not told about bf16 (the advisor's rule is)


def _measured(peak: float, achieved: float, spread: float = 0.05, breakdown=None, executed=None) -> dict:
    return {
        "summary__measured_peak": {
            "precision": "fp32",
            "peak_tflops": peak,
            "spread": spread,
            "achieved_tflops": achieved,
            "share": achieved / peak,
            **({"executed_tflops": executed} if executed else {}),
        },
        "summary__profile": {"breakdown": breakdown} if breakdown else None,
    }


@pytest.mark.parametrize(
    "changes,fires",
    [
        (_measured(0.2, 0.15), False),
        (_measured(0.2, 0.205), False),  # inside the peak's own spread
        (_measured(0.2, 0.3), True),  # the whole run faster than its matmuls can be: the peak was measured low
        (_measured(0.2, 0.1, breakdown={"matmul_flops": 3e11, "matmul_s": 1.0}), True),  # the traced matmuls at 0.3
        (_measured(0.2, 0.1, breakdown={"matmul_flops": 1.5e11, "matmul_s": 1.0}), False),
        (_measured(0.2, 0.15, executed=0.25), True),  # with checkpointing's recomputation: what the matmuls executed
        (_measured(0.2, 0.15, executed=0.19), False),
    ],
)
def test_the_measured_peak_is_checked_against_the_run_and_the_profiled_matmuls(changes, fires):
    codes = [w["code"] for w in health.check(planted(**changes))]
    assert codes == (["above_measured_peak"] if fires else [])


def test_tf32_asked_for_is_not_a_warning():
    assert health.check(planted(environment__tf32_in_effect=True, settings__tf32=True)) == []


def test_every_warning_is_one_registry_entry_with_its_fix_and_the_start_ones_are_said_at_start():
    for entry in health.REGISTRY.values():
        assert entry.meaning and entry.fix and callable(entry.condition)
    started = planted(environment__threads__torch_threads=1, summary__compile={"recompiles": 3})
    assert [w["code"] for w in health.check(started, at_start=True)] == [
        "threads_below_budget"
    ]  # recompiles: at the end


def test_unknown_codes_are_refused():
    with pytest.raises(ValueError):
        health.warning("made_up", "x")


# ---------------------------------------------------------------- the machine a command was tuned on (--tuned-on)

RUNS = ROOT / "benchmarks" / "runs"


def committed(run: str) -> dict:
    """A committed record: machine A (AMD EPYC, AVX2) in tune/, B (AMD EPYC, AVX512-BF16) in tune_avx512bf16/, C
    (Intel Xeon, AMX) in tune_amx/."""
    return json.loads((RUNS / run / "record.json").read_text())


def on_cores(record: dict, cores: int) -> dict:
    """The record as the same machine with `cores` usable cores writes it."""
    moved = copy.deepcopy(record)
    moved["environment"]["usable_cores"] = moved["environment"]["threads"]["usable_cores"] = cores
    moved["provenance"]["machine"]["usable_cores"] = cores
    return moved


def kind(record: dict) -> str:
    return machine_kinds.machine_kind(RunView(record))


def test_the_machine_kind_tells_amx_from_avx512_bf16_by_the_records_flags():
    """Machines C and B both run torch's AVX512 kernels with native bf16, but C's matmuls run on AMX (3,153 GFLOP/s
    bf16) and B's on AVX512-BF16 (427): a command tuned on one, run on the other, is warned of."""
    amx, avx512 = committed("tune_amx/advice-r0"), committed("tune_avx512bf16/advice-r0")
    assert kind(amx) == "cpu AVX512, bf16 AMX, 2 cores: Intel(R) Xeon(R) Processor"
    assert kind(avx512) == "cpu AVX512, bf16 AVX512-BF16, 2 cores: AMD EPYC"
    assert machine_kinds.kind_difference(kind(amx), kind(avx512)) == "bf16 AMX there, AVX512-BF16 here"
    assert machine_kinds.kind_difference(kind(avx512), kind(amx)) == "bf16 AVX512-BF16 there, AMX here"
    assert machine_kinds.kind_difference(kind(amx), kind(committed("tune/advice-r0"))) == (
        "instruction set AVX512 there, AVX2 here; bf16 AMX there, emulated here"
    )
    (warning,) = health.check({**avx512, "settings": {"tuned_on": kind(amx)}}, at_start=True)
    assert warning["code"] == "tuned_elsewhere" and "(bf16 AMX there, AVX512-BF16 here)" in warning["message"]


def test_the_machine_kind_names_the_usable_cores_the_threads_and_workers_were_tuned_for():
    avx512 = committed("tune_avx512bf16/advice-r0")
    eight = kind(on_cores(avx512, 8))
    assert eight == "cpu AVX512, bf16 AVX512-BF16, 8 cores: AMD EPYC"
    assert machine_kinds.kind_difference(eight, kind(avx512)) == "8 cores there, 2 here"
    assert machine_kinds.kind_difference(kind(on_cores(avx512, 1)), eight) == "1 core there, 8 here"
    (warning,) = health.check({**avx512, "settings": {"tuned_on": eight}}, at_start=True)
    assert "(8 cores there, 2 here)" in warning["message"]


def test_the_same_machine_is_the_same_kind_whatever_run_wrote_it():
    for tuned, here in (
        ("tune_amx/advice-r0", "tune_confirm_amx/make-tune-r0"),
        ("tune_avx512bf16/advice-r0", "tune_confirm_avx512bf16/make-tune-r0"),
        ("tune/advice-r0", "tune_confirm/make-tune-r0"),
    ):
        assert machine_kinds.kind_difference(kind(committed(tuned)), kind(committed(here))) is None


def test_an_older_tuned_on_string_compares_on_the_fields_it_has():
    """make tune wrote 'cpu AVX512, bf16 native: AMD EPYC' before it named the bf16 path and the cores (the committed
    tune-confirm runs carry such strings): the same machine is the same kind, with no warning; what the string
    lacks is unknown, not a difference; what it has still differs."""
    for run in ("tune_confirm_avx512bf16/make-tune-r0", "tune_confirm/make-tune-r0"):
        record = committed(run)
        old = record["settings"]["tuned_on"]
        assert "core" not in old and machine_kinds.kind_difference(old, kind(record)) is None
        assert [w["code"] for w in health.check(record, at_start=True) if w["code"] == "tuned_elsewhere"] == []
    old_b = committed("tune_confirm_avx512bf16/make-tune-r0")["settings"]["tuned_on"]
    assert old_b == "cpu AVX512, bf16 native: AMD EPYC"
    assert (
        machine_kinds.kind_difference(old_b, kind(committed("tune_amx/advice-r0"))) is None
    )  # native: AMX or AVX512-BF16
    assert machine_kinds.kind_difference(old_b, kind(committed("tune/advice-r0"))) == (
        "instruction set AVX512 there, AVX2 here; bf16 native there, emulated here"
    )
    assert machine_kinds.kind_difference(kind(committed("tune/advice-r0")), old_b) == (
        "instruction set AVX2 there, AVX512 here; bf16 emulated there, native here"
    )
