"""Advice that holds (issue 60): every estimate from the record alone -- the same text with an empty cache, a full one
and another machine kind's, the committed report's advice included --, a failure inside an estimate shown, advice for
every record a Run writes in the loop's own terms, and the model's own timing after the loop leaving the run as it
was."""

import copy
import importlib.util
import json

import pytest
import torch
from conftest import ROOT, assert_ok, plant, read_record, run_in_forked_ranks, run_in_process
from public_loops import hf_trainer, mnist, nanogpt, nlp_example, peft_lora

from trainscope.advice import advisor, estimates
from trainscope.core.record_view import RunView
from trainscope.measure import operations, peak
from trainscope.report import sections

COMMITTED_ADVICE_RUNS = [
    "benchmarks/runs/tune/advice-r0",
    "benchmarks/runs/tune_amx/advice-r0",
    "benchmarks/runs/tune_avx512bf16/advice-r0",
]


def advice_text(record: dict) -> str:
    return "\n".join(advisor.lines(advisor.advise(copy.deepcopy(record))))


# ---------------------------------------------------------------- the same record, the same advice, anywhere


def machine_kind(monkeypatch, tmp_path, kind: str) -> None:
    """This process as a machine of another kind: its own cache folder, and every measurement it would make
    answered at once with that kind's planted rates (bf16 2x fp32 on "A", 9x on "B"; 1 ms per other operator), so
    any estimate that reads the machine rather than the record reads that kind's figures."""
    speed = {"A": 2.0, "B": 9.0}[kind]
    monkeypatch.setenv("TRAINSCOPE_CACHE_DIR", str(tmp_path / f"cache-{kind}"))

    def planted(device, precision_name, shape, best_tflops=None):
        tflops = 0.1 * (speed if precision_name == "bf16" else 1.0)
        return peak.Rate(precision_name, tuple(shape), tflops, tflops, tflops, 3, "2026-01-01T00:00:00+00:00", 0.0)

    monkeypatch.setattr(peak, "measure", planted)
    from trainscope.predict import op_costs

    monkeypatch.setattr(op_costs, "time_guarded", lambda *args, **kwargs: (1e-3 * (1 if kind == "A" else 5), None))


def test_the_same_record_gives_the_same_advice_with_an_empty_cache_a_full_one_and_another_machines(
    monkeypatch, tmp_path
):
    """Before issue 60 a record with a prediction took its precision and batch estimates from the reading machine's
    measured rates (the predictor, trainscope.predict.speedup), so the same make train record read 2.42x under one
    machine's cache and 12.00x under another's."""
    records = [read_record(ROOT / path) for path in COMMITTED_ADVICE_RUNS]
    records.append(planted_run_record())
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("TRAINSCOPE_CACHE_DIR", str(empty))
    monkeypatch.setattr(peak, "measure", lambda *a, **k: pytest.fail("the advice measured the machine"))
    first = [advice_text(r) for r in records]
    assert not any(empty.iterdir())  # nothing was read or written there
    for kind in ("A", "B"):
        machine_kind(monkeypatch, tmp_path, kind)
        assert [advice_text(r) for r in records] == first, kind


class MarkdownOnly:
    """The report writer's calls a section makes, kept as the Markdown lines they would write."""

    def __init__(self):
        self.markdown = []

    def begin(self, title, machines, missing) -> bool:
        self.markdown.append(f"# {title}")
        return True

    def text(self, line: str) -> None:
        self.markdown.append(line)

    def code(self, text: str) -> None:
        self.markdown += ["```", text, "```"]

    def part(self, heading, machines) -> None:
        self.markdown.append(f"## {heading}")

    def table(self, table) -> None:
        self.markdown += table.markdown_lines()


def test_the_committed_reports_advice_is_the_same_built_with_another_machine_kinds_cache(monkeypatch, tmp_path):
    """The report's section on make tune (its advice blocks: `python report.py --advise` on each make tune's advice
    run) built from the committed inputs as report.md has it, under two machine kinds' caches: the same Markdown."""
    from trainscope.experiments import REGISTRY, optimization

    found = sections.collect(ROOT / "benchmarks" / "runs", ROOT / "benchmarks", REGISTRY)
    built = {}
    for kind in ("A", "B"):
        machine_kind(monkeypatch, tmp_path, kind)
        writer = MarkdownOnly()
        optimization.section(writer, found)
        built[kind] = "\n".join(writer.markdown)
    assert built["A"] == built["B"]
    # the advice blocks (make tune's tables keep what each make tune estimated when it ran: a committed result)
    blocks = built["A"].split("```")[1::2]
    assert blocks and all("estimate" in block for block in blocks)
    assert not any("this machine's measured rates" in block for block in blocks)


# ---------------------------------------------------------------- a failure inside an estimate is shown


def test_an_estimate_that_raises_is_shown_as_unavailable_never_swallowed(monkeypatch):
    record = planted_run_record()
    (bf16,) = [s for s in advisor.advise(copy.deepcopy(record)) if s.rule == "cpu_precision"]
    assert bf16.gain is not None

    def broken(view, target):
        raise KeyError("planted")

    monkeypatch.setattr(estimates, "precision", broken)
    (bf16,) = [s for s in advisor.advise(copy.deepcopy(record)) if s.rule == "cpu_precision"]
    assert bf16.gain is None and bf16.gain_text() == "estimate unavailable: KeyError: 'planted'"

    def raises(view):
        raise ZeroDivisionError("planted in a rule")

    monkeypatch.setattr(advisor, "RULES", [raises, *advisor.RULES])
    found = advisor.advise(copy.deepcopy(record))  # no exception out of the advice
    (item,) = [s for s in found if s.rule == "raises"]
    assert item.gain_text() == "estimate unavailable: ZeroDivisionError: planted in a rule"
    assert any("estimate unavailable: ZeroDivisionError" in line for line in advisor.lines(found))


# ---------------------------------------------------------------- estimates from the run's own timing


def planted_run_record(**configurations) -> dict:
    """A trainscope.Run record of a plain loop on a 2-core CPU: 100 steady micro-batches of 10 ms, its model timed
    alone at 6 ms (fp32, 2 threads), 2 ms in bf16, 8 ms at 1 thread, 9 ms on twice the rows (or as given)."""
    seconds = {"run": 0.006, "precision bf16": 0.002, "threads 1": 0.008, "rows x2": 0.009, **configurations}

    def config(name, value):
        where = {
            "precision": "bf16" if "bf16" in name else "fp32",
            "threads": 1 if name == "threads 1" else 2,
            "rows": 2 if name == "rows x2" else 1,
        }
        return {"name": name, **where, "seconds": {"median": value, "low": value * 0.98, "high": value * 1.02}}

    counts = {"samples": 3200, "micro_batches": 100, "optimizer_steps": 100, "tokens": 0}
    stages = {"data": 0.05, "forward": 0.3, "backward": 0.4, "optimizer": 0.2, "eval": 0.0, "other": 0.05}
    return {
        "run_name": "planted-loop",
        "status": "complete",
        "instrument": {"api": "trainscope.Run"},
        "settings": {"gradient_accumulation_steps": 1, "num_workers": 0, "epochs": 1},
        "environment": {
            "device": "cpu",
            "device_name": "AMD EPYC",
            "effective_precision": "fp32",
            "cpu_capability": "AVX512 + avx512_bf16",
            "cpu_bf16": {"flags": ["avx512_bf16"], "native_by_flags": True, "speedup": 3.0, "faster": True},
            "threads": {
                "torch_threads": 2,
                "thread_budget": 2,
                "usable_cores": 2,
                "local_processes": 1,
                "threads_source": "launcher",
            },
        },
        "model": {},
        "warnings": [],
        "summary": {
            "timing": {
                "across_ranks": {
                    "steady": {
                        "wall_s": {"median": 1.0},
                        "seconds": {k: {"median": v} for k, v in stages.items()},
                        "shares": {k: {"median": v} for k, v in stages.items()},
                    }
                },
                "per_rank": [{"counts": {"steady": counts, "warmup": counts}}],
            },
            "throughput": {"train_wall_s": 1.0, "samples": 3200, "optimizer_steps": 100},
            "memory": {"peak_rss_gib": {"max": 0.3}},
            "measured_peak": {
                "run_shapes": {
                    "operations": {
                        "configurations": [config(name, value) for name, value in seconds.items()],
                        "precision": "fp32",
                        "threads": 2,
                        "micro_batches_per_step": 1.0,
                        "others_cores": 0.0,
                    }
                }
            },
        },
    }


def test_an_estimate_is_amdahls_law_on_the_share_the_model_took_with_its_interval_and_assumptions():
    view = RunView(planted_run_record())
    bf16 = estimates.precision(view, "bf16")
    assert bf16.gain == pytest.approx(0.010 / (0.010 - 0.006 + 0.002))  # 60% of the micro-batch, 3x faster
    assert bf16.low < bf16.gain < bf16.high and bf16.high / bf16.low < 1.2  # 2% call spreads
    assert "the rest of each micro-batch (40%" in bf16.assumes and "6 ms of each 10 ms micro-batch (60%)" in (
        bf16.evidence
    )
    # a run dominated by what the change does not touch gets a small estimate
    far = estimates.precision(RunView(planted_run_record(run=0.001, **{"precision bf16": 0.0003})), "bf16")
    assert far.gain == pytest.approx(0.010 / (0.010 - 0.001 + 0.0003)) and far.gain < 1.1
    slower = estimates.threads(view, 1)  # the rest between unchanged (1/1.2) and as slow as the model (0.75)
    assert slower.low <= 0.75 and slower.gain < 1 and slower.high < 0.9
    doubled = estimates.batch(view)  # per sample: the optimizer's 2 ms once, the rest's 2 ms (data included) x1.5
    assert doubled.gain == pytest.approx(2 * 0.010 / (0.002 + 1.5 * 0.002 + 0.009))
    assert doubled.low < doubled.gain < doubled.high
    record = planted_run_record()
    record["summary"]["measured_peak"]["run_shapes"]["operations"] = {"reason": "the model is compiled: planted"}
    missing = estimates.guarded(estimates.precision, RunView(record), "bf16")
    assert missing.gain is None and missing.unavailable == "the model is compiled: planted" and not missing.failed


def test_a_loops_advice_names_the_change_in_the_loops_terms_and_threads_where_off_the_budget():
    record = planted_run_record(**{"threads 2": 0.003})  # a loop at 1 thread of a budget of 2: timed at 2 as well
    record["environment"]["threads"].update(torch_threads=1, thread_budget=2)
    timed = record["summary"]["measured_peak"]["run_shapes"]["operations"]
    timed["configurations"] = [c for c in timed["configurations"] if c["name"] != "threads 1"]
    for config in timed["configurations"]:
        config["threads"] = 2 if config["name"] == "threads 2" else 1
    found = {s.rule: s for s in advisor.advise(record)}
    assert found["threads"].gain > 1.3 and "trainscope.Run(threads='auto')" in found["threads"].in_loop
    assert found["cpu_precision"].in_loop.startswith("Accelerator(mixed_precision='bf16')")
    assert found["batch"].in_loop == "the training DataLoader's batch_size=64"
    text = "\n".join(advisor.lines(list(found.values())))
    assert "--per-device-batch-size" not in text and "--threads" not in text and "--config_file" not in text
    train_py = plant(planted_run_record(), settings__per_device_batch_size=32)
    del train_py["instrument"]
    text = "\n".join(advisor.lines(advisor.advise(train_py)))
    assert "`--per-device-batch-size 64`" in text and "--config_file accelerate_configs/bf16.yaml" in text


def test_a_warning_about_the_prediction_alone_is_not_ranked_as_doubtful_figures():
    record = planted_run_record()
    record["warnings"] = [{"code": "prediction_fit_at_bound", "message": "the prediction's calibration has planted"}]
    found = advisor.advise(record)
    (warning,) = [s for s in found if s.rule == "warning:prediction_fit_at_bound"]
    assert not warning.fix_first and found[-1] is warning
    assert warning.gain_text() == "about the prediction only: the run's own figures stand"


# ---------------------------------------------------------------- the model timed alone after the loop


def test_the_model_timed_alone_leaves_its_gradients_buffers_modes_and_random_state_as_they_were():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.5))
    model.eval()
    kept = operations.Watch(model, lambda: "warmup")
    model.train()
    model(torch.randn(4, 8))
    kept.close()
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    model.eval()
    block = operations.measure(model, kept.inputs, torch.device("cpu"), "fp32", 2, budget=2)
    names = [c["name"] for c in block["configurations"]]
    assert names[0] == "run" and "rows x2" in names and "threads 1" in names
    assert all(c.get("seconds") for c in block["configurations"]), block
    assert all(p.grad is None for p in model.parameters())
    assert not model.training and all(torch.equal(v, buffers[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), state)
    assert operations.positions(kept.inputs) == 4 and operations.doubled(kept.inputs)[0][0].shape[0] == 8


# ---------------------------------------------------------------- every record a Run writes, advised


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LOOPS = {
    "nlp_example": (nlp_example.main, ["--rows", "64", "--epochs", "1"], "nlp_example"),
    "nanogpt": (nanogpt.main, [], "nanogpt"),
    "peft_lora": (peft_lora.main, [], "peft_lora"),
    "mnist": (mnist.main, ["--rows", "96", "--epochs", "1"], "mnist"),
    "hf_trainer": (hf_trainer.main, ["--rows", "48"], "hf_trainer"),
}


@pytest.fixture(scope="module")
def loop_records(tmp_path_factory) -> dict:
    """One record of every conformance loop (hand accumulation, nanoGPT's micro-steps, PEFT's LoRA, the mnist CNN, the
    HF Trainer, nlp_example on two DDP ranks), the causal LM and the plain loop of examples/, each run once, each run's
    model timed alone after its loop as trainscope tune's advice run asks (TRAINSCOPE_TIME_MODEL)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINSCOPE_TIME_MODEL", "1")
        return _loop_records(tmp_path_factory.mktemp("loops"))


def _loop_records(out) -> dict:
    records = {}
    for name, (main, args, folder) in LOOPS.items():
        where = out / name
        assert_ok(run_in_process(["--output-dir", str(where), "--truth", str(where / "truth"), *args], main=main))
        records[name] = read_record(where / folder)
    for name, args in (("causal_lm", ["--steps", "6", "--seq-length", "32", "--batch-size", "4", "--max-texts",
                                      "400", "--log-every", "2"]), ("plain_loop", ["--steps", "40"])):  # fmt: skip
        where = out / name
        assert_ok(run_in_process([*args, "--output-dir", str(where), "--run-name", name], main=_example(name).main))
        records[name] = read_record(where / name)
    where = out / "ddp"
    args = ["--output-dir", str(where), "--truth", str(where / "truth"), "--rows", "64", "--epochs", "1"]
    assert run_in_forked_ranks(args, main=nlp_example.main) == 0
    records["ddp"] = read_record(where / "nlp_example")
    return records


def test_a_record_whose_model_was_not_timed_says_how_to_get_the_estimates_that_read_it(tmp_path):
    """By default a run does not time its model alone after the loop (seconds to minutes a run, the whole of a short
    one's cost: asked for with time_model, as trainscope tune's advice run asks): the estimates that read it say how
    to get them, and none fails."""
    args = ["--steps", "40", "--output-dir", str(tmp_path), "--run-name", "plain"]
    assert_ok(run_in_process(args, main=_example("plain_loop").main))
    record = read_record(tmp_path / "plain")
    view = RunView(record)
    for estimate in (
        estimates.guarded(estimates.batch, view),
        estimates.guarded(estimates.threads, view, 1),
        estimates.guarded(estimates.precision, view, "bf16"),
    ):
        assert estimate.gain is None and not estimate.failed, estimate
        assert estimate.unavailable.startswith("not timed: time_model=True times the run's model alone after the loop")
    found = advisor.advise(copy.deepcopy(record))
    assert not [s for s in found if s.estimate_unavailable and "Error" in s.estimate_unavailable], found


@pytest.mark.parametrize("name", [*LOOPS, "causal_lm", "plain_loop", "ddp"])
def test_every_record_a_run_writes_is_advised_without_error_in_the_loops_terms(loop_records, name):
    record = loop_records[name]
    timed = RunView(record).run_operations
    assert timed and timed.get("configurations"), timed  # its model timed with the run, on its machine
    assert {"run", "rows x2"} <= {c["name"] for c in timed["configurations"]}
    assert all(c.get("seconds") for c in timed["configurations"]), timed["configurations"]
    found = advisor.advise(copy.deepcopy(record))
    assert not [s for s in found if s.estimate_unavailable and "Error" in s.estimate_unavailable], found
    text = "\n".join(advisor.lines(found))
    assert "--per-device-batch-size" not in text and "--config_file" not in text and "--threads" not in text
    assert all(s.in_loop for s in found if s.kind), [s for s in found if s.kind and not s.in_loop]
    for target in estimates.precisions(RunView(record)):
        assert estimates.guarded(estimates.precision, RunView(record), target).failed is False
    assert json.dumps([s.to_dict() for s in found])  # what make tune keeps of it


def test_the_committed_benchmarks_estimates_are_made_again_from_its_advice_runs_records():
    """make bench-advice keeps each loop's advice record: today's estimates of it are the committed ones (a change to
    how estimates are made shows here, and the benchmark is run again)."""
    from trainscope.experiments.benchmarks import advice_check

    results = json.loads((ROOT / "benchmarks" / "advice_check.json").read_text())
    assert {loop["loop"] for loop in results["loops"]} == set(advice_check.LOOPS)
    for loop in results["loops"]:
        again = {change.label: e for change, e in advice_check.candidates(RunView(loop["advice_run"]["record"]))}
        for shown in loop["estimates"]:
            estimate = again[shown["change"]]
            assert (estimate.gain, estimate.low, estimate.high) == pytest.approx(
                (shown["estimate"], shown["low"], shown["high"])
            ), (loop["loop"], shown["change"])
        for checked in loop["checked"]:
            assert checked["inside"] is (checked["low"] <= checked["measured"]["median_ratio"] <= checked["high"])
