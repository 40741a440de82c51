"""trainscope.Run on loops that are not train.py's: the README's snippet as written, a plain loop with no HuggingFace
model (under gradient accumulation and a short last batch), a decoder-only language model in one process and on two
DDP ranks, and the advisor on their records."""

import dataclasses
import re
import runpy
import sys

import pytest
import torch
from conftest import ACCELERATE, ROOT, cpu_env, launch_forked, read_record, read_steps, run_command, run_in_process

from trainscope.advice import advisor

EXAMPLES = ROOT / "examples"


def example_main(name: str):
    return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name=name)["main"]


def readme_snippet() -> str:
    """The README's 'your own training' code block, as written."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- instrument-snippet -->\s*```python\n(.*?)```", text, re.S)
    assert match, "README.md has no instrument snippet"
    return match.group(1)


def test_the_readme_snippet_run_as_written_writes_a_record_with_stage_times(tmp_path):
    loaded = (
        "\nimport sys\nprint('LOADED', sorted({'transformers', 'datasets', 'evaluate', 'peft'} & set(sys.modules)))\n"
    )
    (tmp_path / "snippet.py").write_text(readme_snippet() + loaded)
    result = run_command([sys.executable, "snippet.py"], cwd=tmp_path, env=cpu_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = list((tmp_path / "runs").glob("*/record.json"))
    assert len(records) == 1
    record = read_record(records[0].parent)
    assert record["status"] == "complete" and record["instrument"]["api"] == "trainscope.Run"
    seconds = record["summary"]["timing"]["across_ranks"]["run"]["seconds"]
    assert all(seconds[stage]["median"] > 0 for stage in ("data", "forward", "backward", "optimizer"))
    assert "stage        seconds" in result.stdout  # the end-of-run table
    assert "LOADED []" in result.stdout  # an MLP's run loads no model library
    assert "tokens/s n/a" in result.stdout and "0.000 TFLOP/s" not in result.stdout


def test_instrumenting_the_plain_loop_takes_at_most_10_lines():
    source = (EXAMPLES / "plain_loop.py").read_text()
    loop = source[source.index("def train") : source.index("def main")]
    marked = [line for line in loop.splitlines() if "# trainscope" in line]
    assert 1 <= len(marked) <= 10, marked


def mlp_flops_per_sample() -> float:
    """FlopCounterMode's count of one training step of the plain loop's model, per sample."""
    from torch.utils.flop_counter import FlopCounterMode

    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 1))
    x, y = torch.randn(10, 64), torch.randn(10, 1)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.mse_loss(model(x), y).backward()
    return counter.get_total_flops() / 10


def test_the_plain_loop_counts_every_sample_under_accumulation_and_a_short_last_batch(tmp_path):
    # 8192 samples in batches of 1000: 8 full ones and one of 192 per epoch; 2 micro-batches a step, the epoch's last
    # step its one short batch (Accelerate syncs at the loader's end): 5 steps an epoch, 10 in all
    args = ["--steps", "10", "--batch-size", "1000", "--accumulate", "2", "--log-every", "5"]
    result = run_in_process([*args, "--output-dir", str(tmp_path)], main=example_main("plain_loop"))
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_record(tmp_path / "plain-loop")
    summary = record["summary"]
    counts = summary["timing"]["per_rank"][0]["counts"]
    samples = sum(counts[phase]["samples"] for phase in counts)
    micro = sum(counts[phase]["micro_batches"] for phase in counts)
    assert (summary["optimizer_steps"], micro, samples) == (10, 18, 2 * 8192)
    assert [line["samples"] for line in read_steps(tmp_path / "plain-loop")] == [8192, 8192]
    # no tokens in a batch of features: none counted, none claimed
    assert summary["throughput"]["tokens"] is None and summary["throughput"]["tokens_per_s"] is None
    # FLOPs: FlopCounterMode once (first micro-batch), scaled by samples: every micro-batch at the counted rate
    assert record["instrument"]["flops_basis"].startswith("FlopCounterMode")
    flops = sum(counts[phase]["flops"] for phase in counts)
    assert flops == pytest.approx(mlp_flops_per_sample() * samples, rel=1e-6)
    # what does not apply is said, and the advisor offers nothing that needs a transformer
    assert set(record["instrument"]["not_available"]) == {"prediction", "unpad"}
    assert record["prediction"] is None
    # the record holds what this run had: the run's own options and keywords (and the Accelerator's accumulation),
    # none of train.py's settings
    from trainscope.run.options import RunOptions
    from trainscope.workload.settings import Settings

    own = {f.name for f in dataclasses.fields(RunOptions)}
    assert set(record["settings"]) == own | {"steps", "gradient_accumulation_steps", "flops"}
    assert not set(record["settings"]) & ({f.name for f in dataclasses.fields(Settings)} - own) - {
        "gradient_accumulation_steps"
    }
    assert record["data"] == {} and record["instrument"]["options"] == "keywords"
    assert not {"requested_max_seq_length", "model_sequence_limit"} & set(record["environment"])
    assert record["environment"]["machine_peak"]["sized_at"] is None  # an MLP: the large square only
    rules = {s.rule for s in advisor.advise(record)}
    assert not rules & advisor.CLASSIFIER_ONLY
    assert "not available for this model: the predictor and --unpad" in result.stdout  # said once, at the start
    import report  # python report.py --advise <run>: reads the record without a crash

    advice = run_in_process([], main=lambda _: report.advise(str(tmp_path / "plain-loop")))
    assert advice.returncode == 0 and "What to try next for plain-loop" in advice.stdout, advice.stderr[-2000:]


def test_the_causal_lm_records_tokens_and_formula_flops_in_one_process(tmp_path):
    args = ["--steps", "4", "--seq-length", "32", "--batch-size", "4", "--max-texts", "1500", "--log-every", "2"]
    result = run_in_process([*args, "--output-dir", str(tmp_path), "--run-name", "lm"], main=example_main("causal_lm"))
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_record(tmp_path / "lm")
    summary, instrument = record["summary"], record["instrument"]
    assert instrument["flops_basis"].startswith("formula: the model's layers as they train (4 of 4 layers train; an LM")
    throughput = summary["throughput"]
    assert throughput["tokens"] == throughput["samples"] * 32 and throughput["tokens_per_s"] > 0
    assert throughput["padding_flops_share"] == 0.0  # packed blocks: every token real
    from transformers import AutoConfig  # noqa: F401  (the formula's config: GPT-2's, as the example builds it)

    from trainscope.measure import flops

    config = example_config()
    per_sequence = flops.causal_lm_training_flops(config, 1, 32)
    counts = summary["timing"]["per_rank"][0]["counts"]
    assert sum(counts[p]["flops"] for p in counts) == per_sequence * sum(counts[p]["samples"] for p in counts)
    assert "perplexity" in summary["test"] and "test loss" in result.stdout
    suggestions = advisor.advise(record)
    assert not {s.rule for s in suggestions} & advisor.CLASSIFIER_ONLY
    assert all(s.unavailable for s in suggestions if s.flags and not s.fix_first)


def test_the_trainer_example_records_the_trainers_own_steps_and_samples(tmp_path):
    """examples/trainer_classifier.py: a Trainer script as transformers documents one, plus the callback's line; the
    record's optimizer steps and samples are the Trainer's own (its state's global_step, its batch size)."""
    args = ["--steps", "6", "--max-texts", "400", "--batch-size", "8", "--output-dir", str(tmp_path)]
    result = run_in_process([*args, "--run-name", "tc"], main=example_main("trainer_classifier"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_record(tmp_path / "tc")["summary"]
    steady = 6 - summary["timing"]["warmup_steps"]  # the throughput's window: the steps after warm-up
    assert summary["optimizer_steps"] == 6 and summary["throughput"]["optimizer_steps"] == steady
    assert summary["throughput"]["samples"] == steady * 8
    assert "eval_loss" in result.stdout


def example_config():
    from transformers import AutoTokenizer

    from trainscope.workload import embedded

    module = runpy.run_path(str(EXAMPLES / "causal_lm.py"), run_name="causal_lm")
    tokenizer = AutoTokenizer.from_pretrained(embedded.minilm_dir())
    return module["TINY"]["embedded:tiny-gpt2"](len(tokenizer), module["end_token"](tokenizer))


def test_the_causal_lm_on_two_ddp_ranks_has_the_communication_block(tmp_path):
    """`accelerate launch --config_file accelerate_configs/ddp.yaml examples/causal_lm.py`, 2 ranks over gloo."""
    args = ["--steps", "6", "--seq-length", "32", "--batch-size", "4", "--max-texts", "1500", "--log-every", "3"]
    command = [
        ACCELERATE,
        "launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / "ddp.yaml"),
        str(EXAMPLES / "causal_lm.py"),
        *args,
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "lm",
    ]
    result = launch_forked(command, cpu_env(ACCELERATE_USE_CPU="1"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_record(tmp_path / "lm")
    summary = record["summary"]
    assert summary["world_size"] == 2 and sorted(r["rank"] for r in summary["timing"]["per_rank"]) == [0, 1]
    assert summary["communication"] is not None and summary["communication"].get("buckets")
    assert "communication (2 ranks" in result.stdout
    assert [line["step"] for line in read_steps(tmp_path / "lm")] == [3, 6]


def test_the_encoder_formula_source_gives_the_formula_for_every_layout():
    """EncoderFlops (its coefficients computed once per what trains) against trainscope.measure.flops' own functions."""
    from transformers import BertConfig

    from trainscope.measure import flops
    from trainscope.measure.flops_source import BatchFacts, EncoderFlops

    config = BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    frozen = flops.Training(trained_share=0.0, adapter_weights=100, input_gradient=False)
    for training in (flops.FULL, frozen):
        for unpad in (False, True):
            source = EncoderFlops(config, unpad, lambda training=training: training)
            for batch, length in ((4, 16), (3, 33)):
                mask = torch.ones(batch, length, dtype=torch.long)
                mask[0, length // 2 :] = 0
                facts = BatchFacts({"input_ids": torch.zeros(batch, length, dtype=torch.long), "attention_mask": mask})
                expected = (
                    flops.padding_free_training_flops(config, batch, length, int(mask.sum()), training)
                    if unpad
                    else flops.training_flops(config, batch, length, training)
                )
                assert source.micro_batch(facts) == expected


def test_a_loop_call_before_with_run_is_one_line_and_leaves_no_record(tmp_path):
    """`run.stage` or `run.data` before `with run:` raised "stage 'data' timed outside start()/stop()" and left a
    record at "running" forever; now one line that says how, no record, and the run can still open. A batch iterator
    wrapped before `with run:` is checked when it is first iterated, not when it is made."""
    from accelerate import Accelerator

    import trainscope

    def main(_):
        accelerator = Accelerator(cpu=True)
        model, optimizer = accelerator.prepare(torch.nn.Linear(4, 1), torch.optim.SGD([torch.zeros(1)], lr=0.1))
        run = trainscope.Run(accelerator, model, optimizer, steps=2, name="early", output_dir=str(tmp_path))
        batches = run.data([torch.ones(4)] * 2)  # made before the run opens, as nanoGPT makes its iterator: not read
        messages = []
        for misuse in (
            lambda: next(run.data([1, 2])),
            lambda: run.stage("forward"),
            lambda: run.count_micro_batch({}, torch.ones(())),
        ):
            with pytest.raises(trainscope.UserError) as raised:
                misuse()
            messages.append(str(raised.value))
        assert not (tmp_path / "early").exists()
        with run:  # the run still opens and counts as it should, the iterator made before it included
            for x in batches:
                loss = model(x).sum()
                run.backward(loss)
                optimizer.step()
                run.count_micro_batch(x, loss)
        assert read_record(tmp_path / "early")["summary"]["optimizer_steps"] == 2
        return messages

    from accelerate.state import AcceleratorState

    try:
        messages = main(None)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert all("\n" not in m and "used before `with run:`" in m and "docs/instrument.md" in m for m in messages)
    assert messages[0].startswith("trainscope.Run: run.data(...) used before `with run:`")


def test_a_loop_with_its_own_loss_scaler_goes_past_a_non_finite_loss_recorded_and_warned(tmp_path):
    """A loop with its own torch.amp.GradScaler whose loss overflows once -- the step the scaler exists to skip -- runs
    to its end: trainscope records the non-finite loss and warns, and never raises it (a NonFiniteLoss ended the
    run, and the loop with it)."""
    from accelerate import Accelerator

    import trainscope

    scales = []  # the scaler's scale after each micro-batch: halved where it skipped the step

    def main(_):
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        run = trainscope.Run(accelerator, model, optimizer, name="scaled", output_dir=str(tmp_path), log_every=1)
        with run:
            for x in run.data([torch.randn(8, 4) for _ in range(6)]):
                loss = model(x).pow(2).mean()
                if len(scales) == 2:
                    loss = loss * float("inf")  # its loss overflowed
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                run.count_micro_batch(x, loss)
                scales.append(scaler.get_scale())

    result = run_in_process([], main=main)
    assert result.returncode == 0, result.stderr[-3000:]
    assert scales == [2.0**8] * 2 + [2.0**7] * 4  # all six trained, the third's step skipped by the scaler
    record, lines = read_record(tmp_path / "scaled"), read_steps(tmp_path / "scaled")
    assert record["status"] == "complete"
    assert record["summary"]["non_finite_losses"]["micro_batches"] == 1
    assert sum(line.get("non_finite_losses", 0) for line in lines) == 1
    assert all(line["loss"] is not None and line["loss"] == line["loss"] for line in lines)  # the finite ones' mean
    assert "non_finite_loss" in [w["code"] for w in record["warnings"]]
    assert result.stderr.count("warning [non_finite_loss]: loss became [inf] at optimizer step") == 1
