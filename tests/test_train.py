"""train.py launched exactly as the README says, on the CPU, checked through the records it writes."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import (
    CONFIGS, ROOT, TINY, assert_ok, config_processes, cpu_env, launch, read_record, read_steps, run_command,
)

EXPECTED_PRECISION = {"fp16": "fp32", "ddp_fp16": "fp32", "bf16": "bf16", "fsdp": "bf16"}


def check_record(run_dir, world_size):
    record = read_record(run_dir)
    assert record["status"] == "complete"
    summary = record["summary"]
    assert summary["world_size"] == world_size == record["environment"]["world_size"]
    assert len(summary["timing"]["per_rank"]) == world_size
    assert sorted(r["rank"] for r in summary["timing"]["per_rank"]) == list(range(world_size))
    for per_rank in summary["timing"]["per_rank"]:
        for phase in ("warmup", "steady", "run"):
            table = per_rank["timing"][phase]
            assert sum(table["shares"].values()) == pytest.approx(1.0)
            assert sum(table["seconds"].values()) == pytest.approx(table["wall_s"])
            assert table["seconds"]["other"] >= -1e-6
    assert summary["throughput"]["samples_per_s"] > 0 and summary["throughput"]["tokens_per_s"] > 0
    assert summary["optimizer_steps"] == record["plan"]["optimizer_steps"]
    assert 0 <= summary["test"]["accuracy"] <= 1
    assert record["environment"]["timing_mode"] == "host"
    steps = read_steps(run_dir)
    assert steps and steps[-1]["step"] == summary["optimizer_steps"]
    return record


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_launches_as_documented(config, runs):
    result = launch("train.py", [*TINY, "--output-dir", str(runs), "--run-name", "r"], config=config)
    assert_ok(result)
    world_size = config_processes(config)
    record = check_record(runs / "r", world_size)
    precision = EXPECTED_PRECISION.get(config.stem, "fp32")
    assert record["environment"]["effective_precision"] == precision
    if config.stem in ("fp16", "ddp_fp16"):
        assert "fp16 was requested but cpu runs fp32" in result.stdout + result.stderr
    if world_size > 1:
        assert record["environment"]["distributed_type"] == "MULTI_CPU"
        assert record["environment"]["backend"] == "gloo"


@pytest.mark.parametrize("launcher", ["python", "accelerate"])
def test_plain_launches_run_the_same_script(launcher, runs):
    result = launch("train.py", [*TINY, "--output-dir", str(runs), "--run-name", "plain"], launcher=launcher)
    assert_ok(result)
    check_record(runs / "plain", 1)


def test_loss_falls_on_the_embedded_data(runs):
    """The pretrained embedded MiniLM learns the embedded tweets within 48 steps."""
    result = launch("train.py", ["--max-train-samples", "768", "--max-eval-samples", "128", "--max-test-samples",
                                 "64", "--per-device-batch-size", "16", "--max-seq-length", "48", "--log-every", "8",
                                 "--report-to", "none", "--output-dir", str(runs), "--run-name", "learn"],
                    launcher="python")
    assert_ok(result)
    losses = [line["loss"] for line in read_steps(runs / "learn")]
    assert len(losses) == 6
    assert sum(losses[-2:]) / 2 < losses[0] - 0.1, losses
    assert read_record(runs / "learn")["summary"]["validation"][0]["loss"] < 1.0986 - 0.1  # ln 3: chance


def test_record_holds_settings_environment_data_and_step_lines(runs):
    result = launch("train.py", [*TINY, "--output-dir", str(runs), "--run-name", "full",
                                 "--gradient-accumulation-steps", "2", "--timing-warmup-steps", "1"],
                    launcher="python")
    assert_ok(result)
    record = read_record(runs / "full")
    assert record["schema_version"] == 1
    assert record["settings"]["gradient_accumulation_steps"] == 2
    assert set(record["environment"]["packages"]) >= {"torch", "transformers", "accelerate"}
    assert record["data"]["labels"] == ["negative", "neutral", "positive"]
    assert record["model"]["weights"].startswith("random")
    # 256 rows / 16 = 16 micro-batches = 8 optimizer steps of 2
    assert record["plan"]["optimizer_steps"] == 8 and record["plan"]["global_batch_size"] == 32
    counts = record["summary"]["timing"]["per_rank"][0]["counts"]
    assert counts["warmup"]["optimizer_steps"] == 1 and counts["steady"]["optimizer_steps"] == 7
    assert counts["warmup"]["micro_batches"] + counts["steady"]["micro_batches"] == 16
    line = read_steps(runs / "full")[0]
    assert set(line) >= {"step", "loss", "lr", "samples", "tokens", "stage_s"}
    assert set(line["stage_s"]) == {"data", "forward", "backward", "optimizer", "eval"}
    assert line["micro_batches"] == 4 and line["samples"] == 64  # two optimizer steps per line
    assert "peak_rss_gib" in record["summary"]["memory"]


def test_lora_records_trainable_parameters(runs):
    result = launch("train.py", [*TINY, "--output-dir", str(runs), "--run-name", "lora", "--lora",
                                 "--gradient-checkpointing"], launcher="python")
    assert_ok(result)
    model = read_record(runs / "lora")["model"]
    assert model["lora"]["target_modules"] == ["query", "value"]
    assert 0 < model["trainable_parameters"] < model["parameters"] / 10
    assert model["lora"]["trainable_parameters"] == model["trainable_parameters"]


def test_trackers_write_offline_and_nothing_secret(runs):
    secrets = {"HF_TOKEN": "hf_secretsecretsecret123", "WANDB_API_KEY": "0123456789abcdef" * 2 + "01234567",
               "AWS_SECRET_ACCESS_KEY": "aws-very-secret-value-42"}
    env = cpu_env(**secrets, WANDB_BASE_URL="https://127.0.0.1:9")  # a key, but no route: offline
    env.pop("WANDB_MODE", None)
    result = launch("train.py", [*TINY, "--output-dir", str(runs), "--run-name", "tracked", "--report-to", "all"],
                    env=env, launcher="python")
    assert_ok(result)
    record = read_record(runs / "tracked")
    assert record["trackers"]["wandb"]["mode"] == "offline"
    assert list((runs / "tracked" / "wandb").glob("offline-run-*"))
    assert list((runs / "tracked" / "tensorboard").rglob("events.out.tfevents.*"))
    for path in (runs / "tracked").rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            for value in secrets.values():
                assert value.encode() not in content, f"{value} leaked into {path}"


def test_a_plain_torchrun_of_two_processes_is_refused(runs):
    result = launch("train.py", [*TINY, "--output-dir", str(runs)], launcher="torchrun",
                    env={k: v for k, v in cpu_env().items() if k != "ACCELERATE_USE_CPU"})
    assert result.returncode != 0
    assert "independent single-process runs" in result.stderr
    assert not runs.exists() or not any(runs.iterdir())


@pytest.mark.parametrize("args,message", [
    (["--per-device-batch-size", "0"], "must be a positive integer"),
    (["--no-such-flag"], "unknown argument"),
    (["--dataset", "missing/file.csv"], "no such dataset file"),
    (["--dataset", "no-such-owner/no-such-dataset-xyz"], "not found"),
    (["--model", "no-such-owner/no-such-model-xyz"], "not found"),
    (["--label-column", "stars"], "label column 'stars' is not in the data"),
    (["--model", "./nowhere"], "no such tokenizer directory"),
])
def test_bad_input_is_one_line_nonzero_and_writes_nothing(runs, args, message):
    result = launch("train.py", [*TINY, "--output-dir", str(runs), *args], launcher="python")
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors and message in errors[-1], result.stderr[-2000:]
    assert not runs.exists() or not any(runs.iterdir())


def test_one_class_data_is_refused(runs, tmp_path):
    data = tmp_path / "one.csv"
    data.write_text("text,label\n" + "".join(f"row {i},same\n" for i in range(50)))
    result = launch("train.py", [*TINY, "--output-dir", str(runs), "--dataset", str(data)], launcher="python")
    assert result.returncode == 2 and "one class only" in result.stderr
    assert not runs.exists()


def test_more_processes_than_batches_is_refused(runs):
    ddp = ROOT / "accelerate_configs" / "ddp.yaml"
    result = launch("train.py", [*TINY, "--output-dir", str(runs), "--max-train-samples", "10"], config=ddp)
    assert result.returncode != 0
    assert "fewer than the 2 processes" in result.stderr
    assert not runs.exists()


def test_an_unknown_config_file_fails(runs):
    result = launch("train.py", [*TINY, "--output-dir", str(runs)], config=ROOT / "accelerate_configs" / "nope.yaml")
    assert result.returncode != 0
    assert not runs.exists()


def test_existing_run_is_not_overwritten_without_asking(runs):
    assert_ok(launch("train.py", [*TINY, "--output-dir", str(runs), "--run-name", "same", "--max-steps", "2"],
                     launcher="python"))
    again = launch("train.py", [*TINY, "--output-dir", str(runs), "--run-name", "same"], launcher="python")
    assert again.returncode == 2 and "already exists" in again.stderr
    assert read_record(runs / "same")["summary"]["optimizer_steps"] == 2


def test_non_finite_loss_stops_the_run_naming_the_step(runs):
    result = launch("train.py", [*TINY, "--output-dir", str(runs), "--run-name", "nan", "--learning-rate", "1e12",
                                 "--max-grad-norm", "0", "--log-every", "1", "--lr-scheduler", "constant_with_warmup",
                                 "--warmup-fraction", "0"], launcher="python")
    assert result.returncode == 1
    assert "at optimizer step" in result.stderr
    record = read_record(runs / "nan")
    assert record["status"] == "failed" and "at optimizer step" in record["error"]


def test_out_of_memory_names_the_batch_size_and_what_to_try(runs, tmp_path):
    # A CPU cannot run out of memory on cue: make the loss raise torch's OutOfMemoryError at step 3.
    script = tmp_path / "oom.py"
    script.write_text(
        "import sys, torch, torch.nn.functional as F\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import train\n"
        "calls = {'n': 0}\n"
        "real = F.cross_entropy\n"
        "def cross_entropy(*a, **k):\n"
        "    calls['n'] += 1\n"
        "    if calls['n'] == 3:\n"
        "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
        "    return real(*a, **k)\n"
        "train.F.cross_entropy = cross_entropy\n"
        "train.main(sys.argv[1:])\n")
    result = run_command([sys.executable, str(script), *TINY, "--output-dir", str(runs), "--run-name", "oom"])
    assert result.returncode == 1
    assert "out of memory at --per-device-batch-size 16 (step 3)" in result.stderr
    assert "--gradient-checkpointing" in result.stderr
    assert read_record(runs / "oom")["status"] == "failed"


def test_killed_run_resumes_with_the_same_data_order_and_step_count(runs):
    common = ["--model", "embedded:minilm-l6", "--max-train-samples", "320", "--max-eval-samples", "32",
              "--max-test-samples", "32", "--per-device-batch-size", "16", "--max-seq-length", "32",
              "--max-steps", "14", "--log-every", "1", "--report-to", "none", "--output-dir", str(runs)]
    assert_ok(launch("train.py", [*common, "--run-name", "whole"], launcher="python"))

    process = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *common, "--run-name", "cut",
                                "--save-every", "5"], cwd=ROOT, env=cpu_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    steps_file = runs / "cut" / "steps.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        # the step-6 line is written after the step-5 checkpoint finished
        if steps_file.exists() and len(steps_file.read_text().splitlines()) >= 6:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be killed"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert read_record(runs / "cut")["status"] == "running"

    resumed = launch("train.py", [*common, "--run-name", "cut", "--resume"], launcher="python")
    assert_ok(resumed)
    assert "resuming cut from step_00000005" in resumed.stdout + resumed.stderr
    whole, cut = read_steps(runs / "whole"), read_steps(runs / "cut")
    assert [line["step"] for line in cut] == list(range(1, 15)) == [line["step"] for line in whole]
    # same weights, same batches, same dropout: the same losses after the restart
    for a, b in zip(whole, cut):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
        assert b["tokens"] == a["tokens"]
    record = read_record(runs / "cut")
    assert record["status"] == "complete" and record["resumed_from"] == ["step_00000005"]
    assert record["summary"]["optimizer_steps"] == 14


def test_resume_without_a_checkpoint_is_refused(runs):
    result = launch("train.py", [*TINY, "--output-dir", str(runs), "--run-name", "never", "--resume"],
                    launcher="python")
    assert result.returncode == 2 and "has no checkpoint" in result.stderr
