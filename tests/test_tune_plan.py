"""trainscope tune's closed loop on planted runs: the command and its changes made from outside the script (through
Accelerate's own launcher code), the determinism probe, the trials planned from the advice, the kept ones stacked,
failures and changes that did not take, the final command and the comparison page. (The decision's error rates
under simulation: tests/test_tune.py; real runs: tests/test_tune_runs.py.)"""

import json
import random
import sys
from types import SimpleNamespace

import pytest
from conftest import cpu_env, planned_launch, run_in_process

import report
from trainscope.advice import advisor, changes
from trainscope.advice.judge import merge_flags
from trainscope.core.errors import UserError
from trainscope.core.launching import ACCELERATE
from trainscope.core.record_view import RunView
from trainscope.tune import main as tune
from trainscope.tune.command import Change, Command, not_applied, outside
from trainscope.tune.tuner import Trial, TrialFailed, plan_trials

TRAIN = [sys.executable, "train.py", "--max-steps", "30"]


def test_the_final_command_has_each_flag_once():
    assert merge_flags(["--threads", "1", "--lora", "--max-steps", "8"], ["--threads", "auto", "--num-workers", "1"]) == [
        "--lora", "--max-steps", "8", "--threads", "auto", "--num-workers", "1",
    ]  # fmt: skip


def test_a_change_reaches_the_script_through_accelerates_own_launcher_over_its_config():
    """`accelerate launch --config_file cpu.yaml` (fp32, no dynamo) with tune's change: Accelerate's own launcher code
    (conftest.planned_launch) exports the precision, threads and compile mode tune asked for -- its flags win over
    the config file --, and trainscope.Run's own variables ride along; the script's flags are merged, not doubled."""
    command = Command.parse([ACCELERATE, "launch", "--config_file", "accelerate_configs/cpu.yaml", "x.py", "--a", "1"])
    change = Change("bf16", 2, "reduce-overhead", num_workers=1, flags=("--a", "2"))
    argv, env = command.applied(change)
    assert argv[-3:] == ["x.py", "--a", "2"] and command.script == "x.py"
    kind, launched, launch_env, _ = planned_launch(argv, {**cpu_env(), **env})
    assert kind == "python" and launched[-3:] == ["x.py", "--a", "2"]
    assert (launch_env["ACCELERATE_MIXED_PRECISION"], launch_env["OMP_NUM_THREADS"]) == ("bf16", "2")
    assert (launch_env["ACCELERATE_DYNAMO_BACKEND"], launch_env["ACCELERATE_DYNAMO_MODE"]) == (
        "INDUCTOR",
        "reduce-overhead",
    )
    assert launch_env["TRAINSCOPE_NUM_WORKERS"] == "1" and launch_env["TRAINSCOPE_EAGER_RANDOM"] == "1"
    _, _, as_it_is, _ = planned_launch(command.applied(Change())[0], cpu_env())
    assert as_it_is["ACCELERATE_MIXED_PRECISION"] == "no" and as_it_is["ACCELERATE_DYNAMO_BACKEND"] == "NO"
    # `python` and torchrun read the environment: Accelerator() its ACCELERATE_* variables, torch OMP_NUM_THREADS
    python = Command.parse([sys.executable, "-m", "my.train", "--lr", "1"])
    assert (
        python.text(Change("fp16", 4))
        == f"ACCELERATE_MIXED_PRECISION=fp16 OMP_NUM_THREADS=4 {sys.executable} -m my.train --lr 1"
    )
    assert Command.parse(["torchrun", "--nproc-per-node", "2", "t.py"]).applied(Change(threads=1)) == (
        ["torchrun", "--nproc-per-node", "2", "t.py"], {"OMP_NUM_THREADS": "1"},
    )  # fmt: skip


@pytest.mark.parametrize(
    "argv, said",
    [
        ([], "no command to tune"),
        (["bash", "run.sh"], "tune runs commands of accelerate launch, python, torchrun"),
        ([sys.executable, "-c", "print(1)"], "tune runs `python script.py ...` or `python -m module ...`"),
        ([ACCELERATE, "launch", "--num_processes"], "accelerate launch cannot read its arguments"),
    ],
)
def test_a_command_tune_cannot_run_is_refused_in_one_line(argv, said, capsys):
    with pytest.raises(SystemExit) as ended:
        tune.main(["--runs", "unused", "--", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 1 and len(err) == 1 and err[0].startswith("error: ") and said in err[0]


def test_the_advice_becomes_changes_from_outside_and_a_record_says_whether_they_took():
    loop = RunView({"instrument": {"api": "trainscope.Run"}, "environment": {"threads": {"thread_budget": 8}}})
    trainer = RunView({"instrument": {"api": "trainscope.TrainscopeCallback (transformers.Trainer)"}})
    said = lambda flags, config=None: advisor.Suggestion("r", "c", "e", flags, config=config)  # noqa: E731
    assert outside(said(["--threads", "auto"]), loop) == Change(threads=8)
    assert outside(said([], "bf16"), loop) == Change("bf16")
    assert outside(said(["--compile", "--compile-mode", "reduce-overhead"]), loop) == Change(
        compile_mode="reduce-overhead"
    )
    assert outside(said(["--num-workers", "2", "--pin-memory"]), loop) == Change(num_workers=2, pin_memory=True)
    assert outside(said(["--num-workers", "2"]), trainer).startswith("not from outside the script: DataLoader(num")
    assert outside(said(["--per-device-batch-size", "64"]), loop) == (
        "not from outside the script: the training DataLoader's batch_size=64"
    )
    assert outside(said(["--unpad"], "bf16"), RunView({})) == Change("bf16", flags=("--unpad",))  # train.py's flags
    assert outside(said([], "ddp"), RunView({})).startswith("another Accelerate config")
    ran = RunView({"environment": {"effective_precision": "fp32", "threads": {"torch_threads": 1}}, "model": {}})
    assert "stayed in fp32: the script's own code sets its precision" in not_applied(Change("bf16"), ran)
    assert "kept 1 thread(s)" in not_applied(Change(threads=2), ran)
    assert "its model was not compiled" in not_applied(Change(compile_mode="default"), ran)
    assert not_applied(Change("no", 1), ran) is None
    assert Change(flags=("--tf32",)).kind == "numeric" and (Change(threads=2) | Change("bf16")).kind == "numeric"
    assert Change(env=(("X", "1"),)).kind == "training"  # not in the catalogue: taken to change what is learned


# ---------------------------------------------------------------- tune() on planted runs


def planted(speed=None, tokens=None, noise=0.03, seed=0, losses=None, shift=None, fail=None):
    """A runner of planted runs: each arm `speed[name]` times the baseline's speed with lognormal noise; the result
    and step losses depend on the seed alone (every arm learns the same) but for an arm in `losses` (added to each
    step's loss) or `shift` (added to its accuracies); `fail` (arm name -> round) fails that run."""
    rng = random.Random(seed)
    speed, tokens, losses, shift, fail = speed or {}, tokens or {}, losses or {}, shift or {}, fail or {}

    def run(arm, round_index, run_seed):
        name = arm.name
        if fail.get(name) == round_index:
            raise TrialFailed(f"{name}-r{round_index} failed: planted")
        factor = speed.get(name, 1.0) * rng.lognormvariate(0, noise)
        trained = tokens.get(name, 1.0) * 10_000
        accuracy = 0.65 + 0.004 * ((run_seed - 42) % 5) + shift.get(name, 0.0)
        train_wall = 10.0 * trained / 10_000 / factor
        step_losses = [
            [step, 1.1 - step / 100 + 0.001 * (run_seed - 42) + losses.get(name, 0.0)] for step in (10, 20, 30)
        ]
        return {
            "run": f"{name}-r{round_index}", "eval_s": 5.0 / factor, "wall_s": 5.0 / factor + train_wall,
            "train_wall_s": train_wall, "train_tokens": trained, "validation_accuracy": accuracy,
            "validation_loss": 0.9 - accuracy / 10, "test_accuracy": accuracy - 0.01, "test_loss": 0.92 - accuracy / 10,
            "seed": run_seed, "data_seed": 42, "optimizer_steps": 30, "steps_per_epoch": 125, "epochs": 1,
            "step_losses": step_losses,
        }  # fmt: skip

    return run


def suggestion(rule, flags, config=None):
    s = advisor.Suggestion(rule, f"try {rule}", "planted", flags, config=config, gain=1.5, gain_kind="bound")
    s.kind, s.unavailable = changes.kind_of(flags, config), changes.unavailable(flags, config)
    return s


# Numeric changes (judged by the equivalence test), on train.py's record (planted: {})
NUMERIC = [
    suggestion("tf32", ["--tf32"]),
    suggestion("bf16", [], "bf16"),
    suggestion("fp16", [], "fp16"),
    suggestion("hook", ["--ddp-comm-hook", "fp16"]),
]


def run_tune(monkeypatch, ideas, runner, record=None, command=TRAIN, log=None, **overrides):
    monkeypatch.setattr(tune.advisor, "advise", lambda record, in_loop_terms=True: ideas)
    monkeypatch.setattr(tune, "read_record", lambda folder: record or {})
    args = {"runs": "unused", "budget": 1e9, "rounds": 6, "seed": 42, "only": None, "max_suggestions": 4, "confirm": None,
            "accuracy_margin": 0.01, "loss_margin": 0.02, **overrides}  # fmt: skip
    return tune.tune(SimpleNamespace(**args), Command.parse(command), runner, log=log or (lambda line: None))


def test_tune_keeps_a_planted_one_and_a_half_times_faster_change_and_rejects_three_no_op_changes(monkeypatch):
    lines = []
    result = run_tune(monkeypatch, NUMERIC, planted({"s1": 1.5}), log=lines.append)
    trials = {t["name"]: t for t in result["trials"]}
    assert trials["s1"]["verdict"] == "faster" and trials["s1"]["same_result"] is True
    assert trials["s1"]["kind"] == "numeric" and trials["s1"]["result"].startswith("same over 6 seeds")
    assert trials["s1"]["speed"]["median_ratio"] == pytest.approx(1.5, rel=0.05)
    assert trials["s1"]["speed"]["correction"] == "Holm over 5 test(s)"  # 4 trials and the kept ones together
    for name in ("s2", "s3", "s4"):  # no-ops: the same rounds, judged once, not kept
        assert trials[name]["verdict"] == "within noise" and trials[name]["pairs"] == 6
    assert trials["s2"]["own_flags"] == ["ACCELERATE_MIXED_PRECISION=bf16"]  # `python`: Accelerator() reads it
    assert all(t["rounds"] == list(range(6)) for t in trials.values()) and "kept" not in trials
    assert result["final_flags"] == ["--tf32"] and result["final_command"] == f"{' '.join(TRAIN)} --tf32"
    assert result["determinism"]["verdict"] == "exact" and result["design"]["tests"] == 5
    # the probe, then the design, before the first round; every verdict with its n and looks
    assert lines[2].startswith("deterministic: two runs of the command as it is on seed 42 agree")
    assert next(i for i, x in enumerate(lines) if x.startswith("design:")) < lines.index(
        next(x for x in lines if x.startswith("round 1 baseline"))
    )
    page = "\n".join(tune.page({**result, "provenance": {}}))
    assert page.startswith("# trainscope tune") and "boundary: fixed: one look after 6 rounds" in page
    assert f"Command to use: `{' '.join(TRAIN)} --tf32`" in page and "6/6 runs" in page


def test_two_kept_changes_are_tried_together_in_their_own_rounds(monkeypatch):
    result = run_tune(monkeypatch, NUMERIC[:2], planted({"s1": 1.5, "s2": 1.4, "kept": 2.1}))
    kept = result["trials"][-1]
    assert kept["name"] == "kept" and kept["flags"] == ["ACCELERATE_MIXED_PRECISION=bf16", "--tf32"]
    assert kept["rounds"] == list(range(6, 12)) and kept["verdict"] == "faster"
    assert kept["runs"] == [f"kept-r{i}" for i in range(6, 12)] and kept["speed"]["correction"] == "Holm over 3 test(s)"
    assert (result["final_flags"], result["final_mixed_precision"]) == (["--tf32"], "bf16")  # make tune-confirm's


def test_exact_changes_are_tried_first_stacked_and_the_others_run_on_top_of_them(monkeypatch):
    """Two exact changes (one 1.5x faster, one a no-op) and a numeric one 1.3x faster on top: the exact phase keeps
    the first; the numeric trial runs with it and against it (the stack as its baseline, rounds 6-11); the final
    command holds both and names the machine (train.py warns on another kind)."""
    ideas = [suggestion("workers", ["--num-workers", "1"]), suggestion("foreach", ["--optimizer-implementation", "foreach"]), NUMERIC[0]]  # fmt: skip
    monkeypatch.setattr(tune.machine_kinds, "machine_kind", lambda view: "cpu AVX2, bf16 emulated: AMD EPYC 7B13")
    result = run_tune(monkeypatch, ideas, planted({"e1": 1.5, "stacked": 1.5, "s1": 1.95}), {"environment": {}})
    trials = {t["name"]: t for t in result["trials"]}
    assert [t["name"] for t in result["trials"]] == ["e1", "e2", "s1"]
    assert trials["e1"]["verdict"] == "faster" and trials["e1"]["exactness"]["verdict"] == "exact"
    assert trials["e1"]["result"].startswith("exact over 6 pair(s): 18 logged losses")
    assert trials["e2"]["verdict"] == "within noise" and trials["e2"]["same_result"] is True
    assert trials["s1"]["flags"] == ["--num-workers", "1", "--tf32"] and trials["s1"]["own_flags"] == ["--tf32"]
    assert trials["s1"]["baseline_runs"] == [f"stacked-r{i}" for i in range(6, 12)]
    assert trials["s1"]["speed"]["median_ratio"] == pytest.approx(1.3, rel=0.05) and trials["s1"]["verdict"] == "faster"
    assert result["design"]["exact"] == 2 and result["design"]["tests"] == 4  # e1, e2, their together; s1
    assert result["final_flags"] == ["--num-workers", "1", "--tf32"]
    assert result["final_command"].endswith(
        "--num-workers 1 --tf32 --tuned-on 'cpu AVX2, bf16 emulated: AMD EPYC 7B13'"
    )


def test_an_exact_change_whose_numbers_differ_is_not_exact_and_never_kept(monkeypatch):
    ideas = [suggestion("workers", ["--num-workers", "1"]), NUMERIC[0]]
    result = run_tune(monkeypatch, ideas, planted({"e1": 1.5}, losses={"e1": 1e-3}))
    first, second = result["trials"]
    assert first["verdict"] == "faster" and first["exactness"]["verdict"] == "not exact" and not first["same_result"]
    assert first["result"].startswith("not exact: seed 42, step 10 loss") and "never kept" in first["result"]
    assert second["flags"] == ["--tf32"] and second["baseline_runs"][0] == "baseline-r6"
    assert "--num-workers" not in result["final_command"]


def test_an_unseeded_command_is_named_and_its_exact_changes_are_judged_by_the_equivalence_test(monkeypatch):
    """The probe's second run differs from its first on the same seed: 'not deterministic', and an exact change
    cannot be shown exact on such runs: it is judged as a numeric one, by the equivalence test over the seeds."""
    runner = planted({"s1": 1.5}, losses={"repeat": 0.01})
    result = run_tune(monkeypatch, [suggestion("workers", ["--num-workers", "1"])], runner)
    assert result["determinism"]["verdict"] == "not exact"
    assert result["determinism"]["text"].startswith("not deterministic: two runs of the command as it is on seed 42")
    (trial,) = result["trials"]
    assert trial["name"] == "s1" and trial["kind"] == "numeric" and trial["exactness"] is None
    assert trial["result"].startswith("same over 6 seeds") and result["design"]["exact"] == 0


def test_a_trial_that_fails_stops_and_the_others_go_on_and_the_command_failing_ends_in_one_line(monkeypatch):
    result = run_tune(monkeypatch, NUMERIC[:2], planted({"s1": 1.5}, fail={"s2": 2}))
    assert [t["name"] for t in result["trials"]] == ["s1"] and result["final_flags"] == ["--tf32"]
    (failed,) = [n for n in result["not_tried"] if n["change"] == "try bf16"]
    assert failed["why"] == "s2-r2 failed: planted"
    with pytest.raises(UserError, match=r"^the command as it is: advice-r0 failed: planted$"):
        run_tune(monkeypatch, NUMERIC[:1], planted(fail={"advice": 0}))
    with pytest.raises(UserError, match=r"^the command as it is \(baseline, round 3\): baseline-r2 failed: planted$"):
        run_tune(monkeypatch, NUMERIC[:1], planted(fail={"baseline": 2}))


def test_every_suggestion_not_tried_is_listed_with_why(monkeypatch):
    ideas = [*NUMERIC, suggestion("gadget", ["--made-up-flag"]), suggestion("ddp", [], "ddp")]
    ideas.append(advisor.Suggestion("advice", "read the docs", "planted", [], gain=None, gain_kind="estimate"))
    result = run_tune(monkeypatch, ideas, planted(), max_suggestions=3)
    assert [t["name"] for t in result["trials"]] == ["s1", "s2", "s3"]
    assert {n["change"]: n["why"] for n in result["not_tried"]} == {
        "try hook": "over the time budget or --max-suggestions",
        "try gadget": "not available in this build (train.py has no --made-up-flag)",
        "try ddp": "another Accelerate config (ddp): its topology is the launch's",
    }
    only = run_tune(monkeypatch, NUMERIC, planted(), only={"fp16"})
    assert [t["change"] for t in only["trials"]] == ["try fp16"]
    page = "\n".join(tune.page({**result, "provenance": {}}))
    assert "- not tried: try gadget (`--made-up-flag`): not available in this build" in page


def test_a_change_to_what_a_step_holds_is_judged_on_the_same_work(monkeypatch):
    """Twice the tokens per step in twice the time is no slower: training is scaled to the baseline's tokens."""
    ideas = [suggestion("accumulate", ["--gradient-accumulation-steps", "2"])]
    (trial,) = run_tune(monkeypatch, ideas, planted(tokens={"s1": 2.0}))["trials"]
    assert trial["speed"]["median_ratio"] == pytest.approx(1.0, abs=0.05) and trial["verdict"] == "within noise"


def test_a_faster_change_that_learns_something_else_is_not_kept_and_a_training_one_waits_for_the_full_job(monkeypatch):
    result = run_tune(monkeypatch, NUMERIC[:1], planted({"s1": 1.5}, shift={"s1": -0.1}))
    (trial,) = result["trials"]
    assert trial["verdict"] == "faster" and trial["same_result"] is False and result["final_flags"] == []
    assert trial["result"].startswith("changed over 6 seeds: validation accuracy -0.1000")
    (dropout,) = run_tune(monkeypatch, [suggestion("attention", ["--attention-dropout", "0"])], planted({"s1": 1.2}))[
        "trials"
    ]
    assert dropout["kind"] == "training" and dropout["same_result"] is None
    assert dropout["result"].startswith("not decided here: a training change is 'same' only from the full job")


def test_one_round_decides_nothing(monkeypatch):
    lines = []
    result = run_tune(monkeypatch, NUMERIC[:1], planted({"s1": 1.5}), rounds=1, log=lines.append)
    (trial,) = result["trials"]
    assert trial["verdict"] == "too few pairs" and trial["same_result"] is None and result["final_flags"] == []
    assert any("no speed verdict is possible (at least 4 rounds" in line for line in lines)


def test_tune_plans_only_the_trials_its_budget_holds():
    """In runs of the command's second run: per phase (the exact ones, then the others) R rounds x (baseline + k),
    and R x 2 for the kept ones together when k >= 2."""
    trial = lambda kind: Trial("t", None, kind=kind)  # noqa: E731
    ideas = [trial("numeric"), trial("numeric"), trial("training")]
    plan = lambda remaining, most=3, found=ideas: plan_trials(found, 10.0, remaining, 6, most)  # noqa: E731
    assert plan(119.9) == ([], ideas) and plan(120) == (ideas[:1], ideas[1:]) and plan(299) == (ideas[:1], ideas[1:])
    assert (
        plan(300) == (ideas[:2], ideas[2:]) and plan(360) == (ideas, []) and plan(1e6, most=2) == (ideas[:2], ideas[2:])
    )
    exact = [trial("exact"), trial("exact")]
    mixed = [ideas[0], *exact]  # the exact ones first: 2 exact (6 x 3 + 12 runs) and 1 numeric (6 x 2): 42 runs
    assert plan(420, found=mixed) == ([*exact, ideas[0]], []) and plan(419, found=mixed) == (exact, [ideas[0]])
    assert plan_trials(exact, 10.0, 1e6, 6, 3, fp32_pairs=True) == (exact, [])


def test_what_tune_sets_from_outside_reaches_every_run_as_it_opens(tmp_path):
    """trainscope.run.overrides, read where a run opens (its folder chosen) and where `run.data` takes the loop's
    loader: the run's folder and the round's seed (set there, the data split's seed held), the loader's workers
    (a DataLoader over a map-style dataset, Accelerate's wrapper too), refused in one line where they would change
    the batches."""
    import numpy as np
    import torch
    from accelerate.data_loader import DataLoaderShard

    from trainscope.run import overrides
    from trainscope.workload.settings import Settings

    env = {overrides.OUTPUT: str(tmp_path / "e1-r3"), overrides.SEED: "45", overrides.WORKERS: "2"}
    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng():  # the generators put back as they were
        settings = overrides.settings(Settings(seed=7, run_name="mine"), env)
        assert torch.initial_seed() == 45
    random.setstate(states[0])
    np.random.set_state(states[1])
    assert (settings.output_dir, settings.run_name, settings.overwrite) == (str(tmp_path), "e1-r3", True)
    assert (settings.seed, settings.data_seed, settings.num_workers) == (45, 7, 2)
    assert overrides.settings(settings, {}) is settings  # nothing set: the run's own
    dataset = torch.utils.data.TensorDataset(torch.arange(8))
    wrapped = DataLoaderShard(dataset, batch_size=4)
    assert overrides.loader(wrapped, env) is wrapped and wrapped.base_dataloader.num_workers == 2
    assert wrapped.base_dataloader.prefetch_factor == 2  # DataLoader's default with workers (None without)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    with pytest.raises(UserError, match="not a DataLoader over a map-style dataset"):
        overrides.loader(torch.utils.data.DataLoader(Stream()), env)
    with pytest.raises(UserError, match="list"):
        overrides.loader([1, 2], env)
    assert overrides.loader([1, 2], {}) == [1, 2]


def test_rounds_in_bf16_whose_command_cannot_run_in_fp32_leave_exact_changes_unproven_and_go_on(monkeypatch):
    """Rounds in bf16 judge an exact change on an fp32 pair; a command that cannot run in fp32 (its code fixes bf16:
    the pair's record shows it) leaves every exact change unproven -- listed, never kept -- and the others go on."""
    ideas = [suggestion("workers", ["--num-workers", "1"]), NUMERIC[0]]
    bf16 = {"environment": {"effective_precision": "bf16"}}
    runner = planted({"e1": 1.5, "s1": 1.5}, fail={"baseline-fp32": 0})
    result = run_tune(monkeypatch, ideas, runner, bf16)
    assert [t["name"] for t in result["trials"]] == ["s1"] and result["final_flags"] == ["--tf32"]
    (unproven,) = [n for n in result["not_tried"] if n["change"] == "try workers"]
    assert unproven["why"] == "no fp32 pair to show it exact: baseline-fp32-r0 failed: planted"


def test_a_command_without_its_separator_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as ended:
        tune.main([ACCELERATE, "launch", "x.py"])
    assert ended.value.code == 2 and capsys.readouterr().err == (
        "error: put `--` before your command: trainscope tune [options] -- <your command>\n"
    )


def test_confirm_tries_the_change_an_earlier_tuning_kept_against_the_command_as_it_is(monkeypatch, tmp_path):
    """--confirm <comparison.json>: the kept change (its environment, launcher settings and flags, as JSON keeps
    them) is the one trial, on this command (the whole job, say), judged by the same rules; no advice asked."""
    earlier = tmp_path / "comparison.json"
    earlier.write_text('{"final_change": {"mixed_precision": "bf16", "flags": ["--tf32"], "env": [["X", "1"]]}}')
    monkeypatch.setitem(changes.CATALOGUE, "env:X", changes.Change("env:X", changes.NUMERIC, "planted"))
    result = run_tune(monkeypatch, None, planted({"s1": 1.5}), confirm=str(earlier))
    (confirmed,) = result["trials"]
    assert confirmed["own_flags"] == ["X=1", "ACCELERATE_MIXED_PRECISION=bf16", "--tf32"]
    assert confirmed["verdict"] == "faster" and confirmed["result"].startswith("same over 6 seeds")
    assert result["final_command"] == f"X=1 ACCELERATE_MIXED_PRECISION=bf16 {' '.join(TRAIN)} --tf32"
    earlier.write_text('{"final_change": {}}')
    ran = []  # said before any run: the probe's two runs cost 80 s on examples/causal_lm.py
    with pytest.raises(UserError, match="kept no change, nothing to confirm"):
        run_tune(monkeypatch, None, lambda *run: ran.append(run), confirm=str(earlier))
    assert ran == []


def test_make_tune_confirms_result_is_read_by_the_report_beside_make_tunes(monkeypatch, tmp_path):
    """make tune-confirm is trainscope tune --confirm on the full job: its result in runs/tune_confirm/ is shown in
    the Optimization section as the confirmation of make tune's final command, and the first page gives it beside
    make tune's answer."""
    tuned = run_tune(monkeypatch, NUMERIC[:1], planted({"s1": 1.5}))  # keeps --tf32
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "comparison.json").write_text(json.dumps(tuned))
    confirmed = run_tune(monkeypatch, None, planted({"s1": 2.0}), confirm=str(tmp_path / "tune" / "comparison.json"))
    assert confirmed["experiment"] == "tune-confirm"
    for folder in ("tune_confirm", "tune_confirm_kept"):  # its own folder, and one kept beside it
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "comparison.json").write_text(json.dumps(confirmed))
    out = tmp_path / "reports"
    completed = run_in_process(
        ["--runs", str(tmp_path), "--results", str(tmp_path / "none"), "--out", str(out)], main=report.main
    )
    assert completed.returncode == 0, completed.stderr
    text = (out / "report.md").read_text()
    section = text.split("## Optimization: what to try next")[1].split("\n## ")[0]
    assert section.count("`make tune-confirm` in ") == 2 and "tune_confirm_kept/`: make tune's final command" in section
    confirm = section.split("`make tune-confirm` in ")[1]
    assert "make tune's final command above against make train's, on make train's full job" in confirm
    ratio = confirmed["trials"][0]["speed"]["median_ratio"]
    assert (
        f"| s1 | --tf32 | numeric | no speed claim | {ratio:.3f} (" in confirm and (out / "tune_confirm.tex").exists()
    )
    glance = text.split("## At a glance")[1].split("\n## ")[0]
    assert f"on the full job (make tune-confirm): training samples/s {ratio:.4f} (" in glance


@pytest.mark.parametrize("kind", ["numeric", "exact"])
def test_a_budget_that_holds_no_trial_says_the_budget_or_the_rounds_that_would(kind, monkeypatch):
    """examples/causal_lm.py on 2 cores: runs of 43 s, the default 600 s left 504 s after the probe for one trial of
    12 runs; the line names what holds one (a budget, or 5 rounds) instead of only the flags' names; and the run
    ends with no trial whichever kind the first change is (an exact one's count once took the exact trials' list)."""
    now, lines, inner = [0.0], [], planted()

    def run(arm, round_index, run_seed):
        now[0] += 43.0
        return inner(arm, round_index, run_seed)

    ideas = NUMERIC[:1] if kind == "numeric" else [suggestion("threads", ["--threads", "2"])]
    assert ideas[0].kind == kind
    monkeypatch.setattr(tune.advisor, "advise", lambda record, in_loop_terms=True: ideas)
    monkeypatch.setattr(tune, "read_record", lambda folder: {})
    args = SimpleNamespace(runs="unused", budget=600, rounds=6, seed=42, only=None, max_suggestions=4, confirm=None,
                           accuracy_margin=0.01, loss_margin=0.02)  # fmt: skip
    result = tune.tune(args, Command.parse(TRAIN), run, clock=lambda: now[0], log=lines.append)
    assert result["trials"] == [] and now[0] == 2 * 43.0  # the probe only
    assert (
        "the budget holds no trial: one takes 12 runs of about 43 s; --budget 660 holds one, or --rounds 5 (10 runs)"
        in lines
    )
