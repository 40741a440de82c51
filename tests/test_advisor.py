"""The advisor's rules on planted records, and make tune's closed loop."""

import json
import sys
from types import SimpleNamespace

import pytest

import report
from conftest import ROOT, TINY, cpu_env, plant, run_command
from trainscope import advisor, tune

STAGES = ("data", "forward", "backward", "optimizer", "eval", "other")


def record(shares=None, run_shares=None, **changes) -> dict:
    """A complete record with a healthy CPU run; `changes` plant symptoms (dotted paths as a__b)."""
    shares = {"data": 0.005, "forward": 0.35, "backward": 0.5, "optimizer": 0.1, "eval": 0.0, "other": 0.045,
              **(shares or {})}
    run_shares = {**shares, "eval": 0.02, **(run_shares or {})}
    table = lambda values: {"wall_s": {"median": 10.0}, "shares": {s: {"median": values[s]} for s in STAGES}}  # noqa: E731
    planted = {
        "run_name": "planted", "warnings": [],
        "settings": {"num_workers": 0, "pin_memory": None, "epochs": 1, "group_by_length": False,
                     "pad_to_max_length": False, "per_device_batch_size": 32, "eval_batch_size": None,
                     "gradient_accumulation_steps": 1, "ddp_comm_hook": "none"},
        "environment": {"device": "cpu", "device_name": "AMD EPYC", "effective_precision": "fp32",
                        "threads": {"torch_threads": 2, "thread_budget": 2, "usable_cores": 2, "local_processes": 1,
                                    "threads_source": "auto"}, "device_memory_gib": None},
        "model": {"optimizer": {"name": "AdamW", "fused": True}},
        "summary": {"timing": {"across_ranks": {"steady": table(shares), "run": table(run_shares)}},
                    "throughput": {"tokens": 1000, "padded_tokens": 1010}, "memory": {}, "mfu": None},
    }
    return plant(planted, **changes)


def rules(found) -> list[str]:
    return [s.rule for s in found]


def test_a_healthy_record_gets_no_suggestion():
    assert advisor.advise(record()) == []
    assert advisor.lines([]) == ["No suggestion: no measured share leaves 2% to gain."]


def test_a_data_bound_loop_gets_workers_bounded_by_amdahl():
    found = advisor.advise(record(shares={"data": 0.4, "forward": 0.2, "backward": 0.3}))
    (data,) = [s for s in found if s.rule == "data_loading"]
    assert data.flags == ["--num-workers", "1"]  # 2 usable cores: one for the compute, one for a worker
    assert data.bound == pytest.approx(1 / 0.6) and data.confidence == "low"
    assert "data 40.0% of the steady step, 0 workers, 2 usable cores" in data.evidence


def test_threads_below_the_budget_are_raised():
    found = advisor.advise(record(environment__threads={"torch_threads": 1, "thread_budget": 4, "usable_cores": 4,
                                                        "local_processes": 1, "threads_source": "launcher"}))
    (threads,) = [s for s in found if s.rule == "threads"]
    assert threads.flags == ["--threads", "auto"] and threads.bound == pytest.approx(1 / (1 - 0.95 + 0.95 / 4))


def test_padding_waste_suggests_grouping_by_length():
    found = advisor.advise(record(summary__throughput={"tokens": 600, "padded_tokens": 1000}))
    (padding,) = [s for s in found if s.rule == "padding"]
    assert padding.flags == ["--group-by-length"] and "40% of the token positions" in padding.evidence
    assert padding.bound == pytest.approx(1 / (1 - 0.87 * 0.4))
    assert advisor.advise(record(summary__throughput={"tokens": 600, "padded_tokens": 1000},
                                 settings__group_by_length=True)) == []


def test_a_large_evaluation_share_suggests_a_larger_eval_batch():
    (evaluation,) = advisor.advise(record(run_shares={"eval": 0.4}))
    assert evaluation.flags == ["--eval-batch-size", "128"] and evaluation.rule == "evaluation"


def test_an_unfused_optimizer_with_a_large_share_is_named():
    found = advisor.advise(record(shares={"optimizer": 0.3, "backward": 0.3}, model={"optimizer": {"name": "AdamW",
                                                                                                   "fused": False}}))
    assert "optimizer" in rules(found)


def test_gpu_rules_precision_batch_and_memory():
    gpu = {"environment__device": "cuda:0", "environment__device_name": "NVIDIA H100 80GB HBM3",
           "environment__device_memory_gib": 80.0}
    found = advisor.advise(record(summary__mfu=0.12, summary__memory={"max_allocated_gib": {"max": 20.0}}, **gpu))
    precision = next(s for s in found if s.rule == "precision")
    assert precision.config == "bf16" and precision.bound > 1.5
    batch = next(s for s in found if s.rule == "batch")
    assert batch.flags == ["--per-device-batch-size", "64"] and batch.changes_result == "the effective batch doubles"
    full = advisor.advise(record(summary__mfu=0.45, summary__memory={"max_allocated_gib": {"max": 75.0}}, **gpu))
    assert "memory" in rules(full) and "batch" not in rules(full)


def test_exposed_communication_suggests_buckets_compression_and_accumulation():
    block = {"measured": True, "exposed_share": 0.2, "exposed_s": 0.05, "total_allreduce_s": 0.1, "overlap": 0.5}
    found = advisor.advise(record(summary__communication=block))
    assert {"ddp_buckets", "ddp_compression", "ddp_accumulation"} <= set(rules(found))
    assert next(s for s in found if s.rule == "ddp_buckets").bound == pytest.approx(1.25)


def test_a_warning_whose_fix_is_a_rule_is_one_item_ranked_first():
    planted = record(environment__threads={"torch_threads": 1, "thread_budget": 2, "usable_cores": 2,
                                           "local_processes": 1, "threads_source": "user"},
                     warnings=[{"code": "threads_below_budget", "message": "1 torch threads, budget 2"}])
    (only,) = advisor.advise(planted)
    assert only.rule == "threads" and only.fix_first and only.bound > 1 and "budget 2" in only.evidence


def test_tune_writes_the_final_command_with_each_flag_once():
    assert tune.merge_flags(["--threads", "1", "--lora", "--max-steps", "8"], ["--threads", "auto", "--num-workers", "1"]) \
        == ["--lora", "--max-steps", "8", "--threads", "auto", "--num-workers", "1"]


def test_warnings_come_first_whatever_the_bounds():
    planted = record(shares={"data": 0.5, "forward": 0.2, "backward": 0.2},
                     warnings=[{"code": "profiler_on", "message": "the profiler was on"}])
    found = advisor.advise(planted)
    assert found[0].fix_first and found[0].rule == "warning:profiler_on" and found[1].rule == "data_loading"


def test_advise_prints_a_ranked_list_and_refuses_bad_input(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    planted = record(summary__throughput={"tokens": 600, "padded_tokens": 1000})
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


def rounds_of(baseline_walls, trial_walls, losses=(0.9, 0.9)):
    return [{"baseline": {"wall_s": b, "samples_per_s": 10.0, "validation_loss": losses[0]},
             "s1": {"wall_s": t, "samples_per_s": 10.0 * b / t, "validation_loss": losses[1]}}
            for b, t in zip(baseline_walls, trial_walls)]


def test_tune_keeps_only_what_is_faster_outside_noise_with_the_same_result():
    faster = tune.judge(rounds_of([10, 10.2, 9.9], [8, 8.1, 8.0]), "s1")
    assert faster["verdict"] == "faster" and faster["same_result"]
    noise = tune.judge(rounds_of([10, 10.2, 9.9], [10.1, 9.9, 10.0]), "s1")
    assert noise["verdict"] == "within noise"
    changed = tune.judge(rounds_of([10, 10.2, 9.9], [8, 8.1, 8.0], losses=(0.9, 1.1)), "s1")
    assert changed["verdict"] == "faster" and not changed["same_result"] and changed["result"] == "changed"


SLOW_LOADER = '''import sys, time
sys.path.insert(0, {root!r})
import trainscope.data as data
build = data.build_collator
def build_collator(*args, **kwargs):
    collate = build(*args, **kwargs)
    def slow(rows):
        time.sleep(0.06)  # a slow loader: storage that makes every batch wait
        return collate(rows)
    return slow
data.build_collator = build_collator
import train
train.main(sys.argv[1:])
'''


@pytest.fixture(scope="module")
def slow_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("tune") / "slow_loader.py"
    path.write_text(SLOW_LOADER.format(root=str(ROOT)))
    return path


def run_tune(runs, script, *options):
    return run_command([sys.executable, "-m", "trainscope.tune", "--runs", str(runs), "--launcher", "python",
                        "--script", str(script), *options, "--", *TINY, "--max-train-samples", "512"],
                       env=cpu_env(), timeout=900)


def test_tune_keeps_workers_for_a_planted_slow_loader(tmp_path, slow_script):
    completed = run_tune(tmp_path / "tune", slow_script, "--rounds", "3", "--max-suggestions", "1")
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads((tmp_path / "tune" / "comparison.json").read_text())
    (trial,) = result["trials"]
    assert trial["rule"] == "data_loading" and trial["flags"] == ["--num-workers", "1"]
    assert trial["verdict"] == "faster" and trial["same_result"]
    assert result["final_flags"] == ["--num-workers", "1"] and "--num-workers 1" in result["final_command"]
    assert result["provenance"]["commit"] and "Final command" in (tmp_path / "tune" / "comparison.md").read_text()
    # round 0's baseline is the run the advice came from: 3 baseline and 3 trial runs in all
    assert sorted(p.name for p in (tmp_path / "tune").glob("*-r*")) == [f"{n}-r{i}" for n in ("baseline", "s1")
                                                                         for i in range(3)]


def test_tune_plans_only_the_trials_its_budget_holds():
    # what each plan costs, in runs of the baseline's length: rounds x (baseline + k) - round 0's baseline,
    # plus rounds x 2 for the kept ones together when k >= 2
    ideas = [SimpleNamespace(flags=[f"--flag{i}"], config=None) for i in range(3)]
    advice_only = SimpleNamespace(flags=[], config=None)  # nothing to run: never planned
    plan = lambda remaining, most=3: tune.plan_trials([advice_only, *ideas], 10.0, remaining, 3, most)  # noqa: E731
    assert plan(5) == ([], ideas) and plan(49.9) == ([], ideas)
    assert plan(50) == (ideas[:1], ideas[1:]) and plan(139) == (ideas[:1], ideas[1:])
    assert plan(140) == (ideas[:2], ideas[2:]) and plan(169) == (ideas[:2], ideas[2:]) and plan(170) == (ideas, [])
    assert plan(1e6, most=2) == (ideas[:2], [])