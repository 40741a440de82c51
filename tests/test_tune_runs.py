"""`trainscope tune -- <command>` on real runs of the examples and a Trainer script, as a new user runs it (its
main() in this process, each run forked with what its launcher starts: conftest.fork_launches), once per command,
several tests reading each: a loop launched on one thread of two cores gets its share from outside and is exact; bf16
through `accelerate launch`'s own flag, judged on paired seeds (kept where the CPU runs it natively); train.py's own
flags on the round's seed; a planted change that alters the losses rejected; an unseeded script named.

Speed verdicts need a quiet machine, which a test worker beside another is not: the keeping of a faster change is
shown on these commands' real records with a quiet machine's run times standing in (`Quiet`); what the changes buy
on a quiet machine is measured by make tune (docs/tune.md#committed-results)."""

import contextlib
import io
import json
import os
import random
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, TINY, cpu_env, fork_launches

from trainscope.advice import advisor, changes
from trainscope.core.launching import ACCELERATE
from trainscope.core.records import read_record, read_steps
from trainscope.tune import main as tune
from trainscope.tune.command import Change, Command

PLAIN = [sys.executable, "examples/plain_loop.py", "--steps", "30", "--log-every", "10", "--batch-size", "256"]
NATIVE_BF16 = any(flag in Path("/proc/cpuinfo").read_text() for flag in ("avx512_bf16", "amx_bf16"))

TRAINER = '''"""A transformers.Trainer run as its documentation writes one, with trainscope's callback; its learning rate read
from PLANTED_LEARNING_RATE."""
import os, sys
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
import trainscope

class Rows(torch.utils.data.Dataset):
    def __init__(self, count):
        self.ids = torch.randint(5, 500, (count, 16), generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": index % 2}

torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=500, hidden_size=32, num_hidden_layers=2,
    num_attention_heads=2, intermediate_size=64, max_position_embeddings=64, num_labels=2))
args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=8, max_steps=8, logging_steps=2,
    learning_rate=float(os.environ.get("PLANTED_LEARNING_RATE", "1e-3")), save_strategy="no", report_to="none",
    use_cpu=True, disable_tqdm=True, seed=0)
trainer = Trainer(model=model, args=args, train_dataset=Rows(64))
trainer.add_callback(trainscope.TrainscopeCallback(trainer, log_every=2))
trainer.train()
'''


def tuned(folder: Path, argv: list[str], plant=None, **env) -> SimpleNamespace:
    """`trainscope tune --runs <folder> <argv>` in this process, its runs forked, with the tests' CPU environment and
    `env`: its comparison, what it printed, its folder."""
    with pytest.MonkeyPatch.context() as patch:
        fork_launches(patch)
        for name, value in {**cpu_env(), **env}.items():
            patch.setenv(name, value)
        if "OMP_NUM_THREADS" not in env:
            patch.delenv("OMP_NUM_THREADS", raising=False)
        if plant:
            plant(patch)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            tune.main(["--runs", str(folder), *argv])
    return SimpleNamespace(
        result=json.loads((folder / "comparison.json").read_text()), printed=printed.getvalue(), runs=folder
    )


@pytest.fixture(scope="module")
def one_thread(tmp_path_factory):
    """The plain loop launched on one thread (OMP_NUM_THREADS=1, as `accelerate launch` exports it), one round."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one usable core: no thread budget above one")
    return tuned(tmp_path_factory.mktemp("one-thread"), ["--rounds", "1", "--", *PLAIN], OMP_NUM_THREADS="1")


def trial(result: dict, own: list[str]) -> dict:
    return next(t for t in result["trials"] if t["own_flags"] == own)


def test_a_loop_launched_on_one_thread_gets_its_share_of_the_cores_from_outside_and_is_exact(one_thread):
    advice = read_record(one_thread.runs / "advice-r0")
    assert (
        advice["environment"]["threads"]["torch_threads"] == 1
        and advice["environment"]["threads"]["thread_budget"] == 2
    )
    assert "threads_below_budget" in [w["code"] for w in advice["warnings"]]
    # the advice run asks for the model timed alone after the loop (its estimates read it); the others do not pay it
    assert advice["summary"]["measured_peak"]["run_shapes"]["operations"]["configurations"]
    repeat = read_record(one_thread.runs / "repeat-r0")["summary"]["measured_peak"]["run_shapes"]["operations"]
    assert repeat["reason"].startswith("not timed: time_model=True times the run's model alone")
    threads = trial(one_thread.result, ["OMP_NUM_THREADS=2"])
    assert threads["rule"] == "warning:threads_below_budget" and threads["kind"] == "exact"
    assert read_record(one_thread.runs / threads["runs"][0])["environment"]["threads"]["torch_threads"] == 2
    assert read_record(one_thread.runs / threads["baseline_runs"][0])["environment"]["threads"]["torch_threads"] == 1
    assert threads["exactness"]["verdict"] == "exact" and threads["exactness"]["logged_losses"] == 3
    assert threads["verdict"] == "too few pairs"  # one round decides no speed: the command stands
    assert (
        one_thread.result["final_command"] == " ".join(PLAIN) and one_thread.result["determinism"]["verdict"] == "exact"
    )
    # a doubled batch is suggested where the model timed alone on twice the rows says it gains (a timing: on a busy
    # machine it may not); where it is, it is said in the script's words (tests/test_tune_plan.py plants it)
    for batch in (n for n in one_thread.result["not_tried"] if n["flags"][:1] == ["--per-device-batch-size"]):
        assert batch["why"] == "not from outside the script: the training DataLoader's batch_size=512"


def test_a_new_user_sees_a_line_a_run_and_the_command_to_use(one_thread):
    lines = one_thread.printed.splitlines()
    runs = [line for line in lines if " (seed 4" in line and "s of the budget left" in line]
    ran = {run for t in one_thread.result["trials"] for run in t["runs"] + t["baseline_runs"]}
    assert runs[0].startswith("as it is (the advice run) (seed 42): training ") and len(runs) == 2 + len(ran)
    assert any(line.startswith("deterministic: two runs of the command as it is on seed 42 agree") for line in lines)
    assert lines[-2:] == [f"command to use: {' '.join(PLAIN)}", f"comparison: {one_thread.runs / 'comparison'}.md"]
    page = (one_thread.runs / "comparison.md").read_text()
    assert (
        page.startswith("# trainscope tune")
        and "OMP_NUM_THREADS=2" in page
        and one_thread.result["provenance"]["commit"]
    )


class Quiet:
    """A quiet machine standing in for this busy one: every arm's run is the command's own advice run (its step
    losses, its records), its training time the advice run's divided by `speed` of the arm's change (threads or
    precision) and a little noise; an arm whose change is numeric moves the result by `moved`."""

    def __init__(self, runs: Path, speed: dict, moved: float = 0.0):
        self.figures = tune.figures(read_record(runs / "advice-r0"), read_steps(runs / "advice-r0"))
        self.speed, self.moved, self.rng = speed, moved, random.Random(0)

    def __call__(self, arm, round_index, seed):
        change = arm.change
        factor = (self.speed.get("threads", 1.0) if change.threads else 1.0) * (
            self.speed.get("bf16", 1.0) if change.mixed_precision == "bf16" else 1.0
        )
        run = {**self.figures, "run": f"{arm.name}-r{round_index}", "seed": seed}
        run["train_wall_s"] = self.figures["train_wall_s"] / factor * self.rng.lognormvariate(0, 0.03)
        moved = self.rng.gauss(self.moved, 1e-3) if change.mixed_precision == "bf16" else 0.0  # rounding, a shift
        for metric in ("test_loss", "log_train_loss"):
            run[metric] = None if run.get(metric) is None else run[metric] + moved
        return run


def args(runs: Path, **overrides) -> SimpleNamespace:
    return SimpleNamespace(**{"runs": str(runs), "budget": 1e9, "rounds": 6, "seed": 42, "only": None,
                              "max_suggestions": 4, "accuracy_margin": 0.01, "loss_margin": 0.02, "confirm": None,
                              **overrides})  # fmt: skip


def test_on_a_quiet_machine_the_threads_the_record_shows_off_budget_are_kept(one_thread, tmp_path):
    shutil.copytree(one_thread.runs / "advice-r0", tmp_path / "advice-r0")
    command = Command.parse(PLAIN)
    result = tune.tune(
        args(tmp_path, only={"threads_below_budget"}), command, Quiet(tmp_path, {"threads": 1.6}), log=lambda line: None
    )
    (threads,) = result["trials"]
    assert threads["verdict"] == "faster" and threads["result"].startswith("exact over 6 pair(s)")
    assert result["final_command"] == f"OMP_NUM_THREADS=2 {' '.join(PLAIN)}"


LM = [ACCELERATE, "launch", "--num_processes", "1", "examples/causal_lm.py", "--steps", "4", "--log-every", "2",
      "--max-texts", "300", "--seq-length", "32", "--batch-size", "4"]  # fmt: skip


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory):
    """The causal LM example through `accelerate launch`, bf16 tried (--confirm: the advisor's bf16 estimate rests
    on the model timed in a busy test worker), one round."""
    folder = tmp_path_factory.mktemp("causal-lm")
    (folder / "bf16.json").write_text('{"final_change": {"mixed_precision": "bf16"}}')
    return tuned(folder / "tune", ["--rounds", "1", "--confirm", str(folder / "bf16.json"), "--", *LM])


def test_the_causal_lm_through_accelerate_launch_gets_bf16_by_the_launchers_own_flag(causal_lm):
    (bf16,) = causal_lm.result["trials"]
    assert bf16["own_flags"] == ["--mixed_precision", "bf16"] and bf16["kind"] == "numeric"
    assert read_record(causal_lm.runs / bf16["runs"][0])["environment"]["effective_precision"] == "bf16"
    assert read_record(causal_lm.runs / "advice-r0")["environment"]["effective_precision"] == "fp32"
    assert "test_loss" in bf16["equivalence"]["metrics"]  # the example's held-out loss, paired on the seed


@pytest.mark.skipif(not NATIVE_BF16, reason="bf16 is emulated on this CPU: slower, never kept")
def test_on_a_quiet_machine_bf16_is_kept_where_it_is_native_and_the_same(causal_lm, tmp_path):
    for folder in ("same", "moved"):
        shutil.copytree(causal_lm.runs / "advice-r0", tmp_path / folder / "advice-r0")
    command, confirm = Command.parse(LM), str(causal_lm.runs.parent / "bf16.json")
    quiet = lambda folder, moved: Quiet(tmp_path / folder, {"bf16": 1.5}, moved)  # noqa: E731
    result = tune.tune(args(tmp_path / "same", confirm=confirm), command, quiet("same", 0.0), log=print)
    (bf16,) = result["trials"]
    assert bf16["verdict"] == "faster" and bf16["result"].startswith("same over 6 seeds")
    assert result["final_command"] == " ".join([*LM[:4], "--mixed_precision", "bf16", *LM[4:]])
    moved = tune.tune(args(tmp_path / "moved", confirm=confirm), command, quiet("moved", 0.05), log=print)
    assert moved["trials"][0]["result"].startswith("changed over 6 seeds") and moved["final_mixed_precision"] is None


def plant_the_learning_rate(patch) -> None:
    """A change tune is told is exact: the script's learning rate, which it reads from the environment."""
    advise, outside = tune.advisor.advise, tune.outside
    planted = advisor.Suggestion("planted", "the learning rate read from the environment", "planted", ["--planted"])
    patch.setattr(tune.advisor, "advise", lambda record, in_loop_terms=True: [*advise(record, in_loop_terms), planted])
    lr = Change(env=(("PLANTED_LEARNING_RATE", "2e-3"),))
    patch.setattr(tune, "outside", lambda s, view: lr if s is planted else outside(s, view))
    patch.setitem(changes.CATALOGUE, "env:PLANTED_LEARNING_RATE", changes.Change("env:X", changes.EXACT, "planted"))


def test_a_trainer_script_whose_planted_exact_change_alters_the_losses_has_it_rejected(tmp_path):
    script = tmp_path / "trainer_script.py"
    script.write_text(TRAINER)
    command = [sys.executable, str(script), str(tmp_path / "trainer")]
    found = tuned(tmp_path / "tune", ["--rounds", "1", "--only", "planted", "--", *command], plant_the_learning_rate)
    assert found.result["determinism"]["verdict"] == "exact"  # seeded, its run reseeded by tune the same way
    assert read_record(found.runs / "advice-r0")["instrument"]["api"].startswith("trainscope.TrainscopeCallback")
    (planted,) = found.result["trials"]
    assert planted["own_flags"] == ["PLANTED_LEARNING_RATE=2e-3"] and planted["exactness"]["verdict"] == "not exact"
    assert planted["result"].startswith("not exact: seed 42, step 2 loss") and "never kept" in planted["result"]
    assert found.result["final_command"] == " ".join(command)


def test_an_unseeded_script_is_named_not_deterministic(tmp_path):
    """The plain loop seeded from the operating system's entropy (torch.seed()) where it fixed its seed: its data
    and weights differ from run to run. (A script that never seeds torch is deterministic in a fresh process: torch's
    generator starts from one fixed seed.)"""
    source = (ROOT / "examples" / "plain_loop.py").read_text()
    assert "    torch.manual_seed(0)\n" in source
    script = tmp_path / "unseeded_loop.py"
    script.write_text(source.replace("    torch.manual_seed(0)\n", "    torch.seed()\n"))
    found = tuned(tmp_path / "tune", ["--only", "none", "--", sys.executable, str(script), *PLAIN[2:]])
    assert found.result["determinism"]["verdict"] == "not exact" and found.result["trials"] == []
    assert found.result["determinism"]["text"].startswith("not deterministic: two runs of the command as it is on")
    assert "not deterministic" in (found.runs / "comparison.md").read_text()


def test_make_tune_on_train_py_tries_its_own_flags_with_the_rounds_seed_and_finds_them_exact(tmp_path):
    """train.py's command (as make tune gives it): the advice run's padding-free layers tried by train.py's own flag,
    each run on the round's seed with the data's seed held (train.py's --seed and --data-seed, set where its run
    opens), the change exact."""
    command = [sys.executable, "train.py", *TINY, "--threads", "1", "--max-steps", "8"]
    found = tuned(tmp_path, ["--rounds", "1", "--only", "unpad", "--", *command])
    (unpad,) = found.result["trials"]
    assert unpad["own_flags"] == ["--unpad"] and unpad["kind"] == "exact" and unpad["exactness"]["verdict"] == "exact"
    settings = read_record(found.runs / unpad["runs"][0])["settings"]
    assert (settings["unpad"], settings["seed"], settings["data_seed"], settings["run_name"]) == (True, 42, 42, "e1-r0")
    assert found.result["final_command"].startswith(f"{' '.join(command)} --tuned-on ")  # the machine it was tuned on


def test_the_report_reads_a_trainscope_tune_result_as_it_was_judged(one_thread, tmp_path):
    """The report's Optimization section on a trainscope tune of a loop of its own (records without a seed setting
    or token counts): its result as tune judged it, its table and its answer on the first page."""
    from trainscope.experiments import REGISTRY, optimization
    from trainscope.report import sections

    shutil.copytree(one_thread.runs, tmp_path / "runs" / "tune")
    found = sections.collect(tmp_path / "runs", tmp_path, [e for e in REGISTRY if e.name == "tune"])
    assert found.comparisons["tune"]["trials"] == one_thread.result["trials"]
    rows = optimization.tune_table(found.comparisons["tune"]).rows
    assert [row[1] for row in rows] == [" ".join(t["flags"]) for t in one_thread.result["trials"]]
    assert optimization.headline(found).text.startswith("No suggestion was faster")
