"""make gpu-check: what only a GPU can show, checked on one GPU (and, where two are present, on two).

    python -m trainscope.gpu_check [--out benchmarks/gpu] [--dry-run]

On a machine without a usable CUDA device it prints one line, writes nothing and exits 0.
With one, it runs (each by the documented commands, RoBERTa-base architecture-only at sequence
length 128 unless said otherwise) and writes benchmarks/gpu/<device>.{json,md} with provenance:

1. timing: the same run with --timing events and --timing sync (per-stage seconds must agree
   within 5%), and their cost against a bare loop (make bench-overhead; targets 1% and 3%);
2. fp16 loss scaling: a CUDA GradScaler with the fused AdamW and planted inf gradients, counted;
3. precision: fp32, TF32, bf16 and fp16: samples/s, tokens/s, MFU, peak memory per stage
   (goals: bf16 >= 3x fp32 and >= 1.5x TF32);
4. torch.compile in bf16: compile time, recompiles, MFU (goal >= 40%);
5. a memory snapshot (--memory-snapshot) and the batch-size search (make batch-sweep's path,
   halving from --search-from on one process);
6. the DataLoader sweep with the copy to the device;
7. single device vs DataParallel vs DDP (what one GPU can and cannot show);
8. with two GPUs: DDP with --compile, and a DDP run whose per-step communication is measured on
   device time (CUDA events); with fewer, both are reported as skipped with their reason.

Every check says what only a GPU run confirms (`--dry-run` lists them). How long it all takes:
not measured on GPU.
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from trainscope import bench, launching
from trainscope.record_view import RunView
from trainscope.records import read_record

ROOT = launching.ROOT
MODEL = ["--model", "roberta-base", "--architecture-only", "--tokenizer", "embedded:minilm-l6", "--max-seq-length",
         "128", "--pad-to-max-length", "--per-device-batch-size", "32", "--max-train-samples", "4096",
         "--max-eval-samples", "64", "--max-test-samples", "64", "--report-to", "none", "--log-every", "10"]
PRECISIONS = {"fp32": ("single_gpu", []), "tf32": ("single_gpu", ["--tf32"]), "bf16": ("bf16", []),
              "fp16": ("fp16", [])}
GOALS = {"timing_agreement": 0.05, "bf16_over_fp32": 3.0, "bf16_over_tf32": 1.5, "compiled_bf16_mfu": 0.40}


def plan(gpus: int | None = None) -> list[dict]:
    """The checks: each a name, what only a GPU run confirms, and a train.py run (config + args) or a
    command ("{out}" stands for its results folder). A run whose config needs more GPUs than `gpus` is
    marked skipped with launching.plan's reason. With no GPU (a dry run) it is planned as for one."""
    gpus = launching.cuda_devices() if gpus is None else gpus
    steps = [{"name": f"timing-{mode}", "config": "single_gpu",
              "args": [*MODEL, "--max-steps", "40", "--timing", mode, "--memory-every", "1"],
              "confirms": f"--timing {mode} charges each stage its device time (events and sync agree within "
                          f"{GOALS['timing_agreement']:.0%})"} for mode in ("events", "sync")]
    steps += [{"name": f"precision-{name}", "config": config, "args": [*MODEL, "--max-steps", "60", *flags],
               "confirms": f"{name} is the precision in effect; samples/s, MFU and per-stage peak memory in it"}
              for name, (config, flags) in PRECISIONS.items()]
    steps.append({"name": "compile-bf16", "config": "bf16", "args": [*MODEL, "--max-steps", "60", "--compile"],
                  "confirms": "torch.compile in bf16: compile time, recompiles with dynamic shapes, MFU"})
    steps.append({"name": "memory-snapshot", "config": "single_gpu",
                  "args": [*MODEL, "--memory-snapshot", "--max-steps", "20"],
                  "confirms": "the allocator's history is recorded over the window after warm-up and dumped "
                              "for pytorch.org/memory_viz"})
    steps.append({"name": "batch-search", "config": "single_gpu", "command": [
        sys.executable, "-m", "trainscope.experiments", "batch-sweep", "--config", "single_gpu", "--runs", "{out}",
        "--batch-sizes", "32", "64", "--steps", "6", "--rounds", "1", "--search-from", "4096", "--", *MODEL],
        "confirms": "a real CUDA out-of-memory error is caught, the allocator recovers between tries, and the "
                    "search halves to the largest batch that fits"})
    steps.append({"name": "overhead", "command": [sys.executable, "-m", "trainscope.benchmarks.overhead", "--pairs", "3",
                                                  "--modes", "events", "sync", "--out", "{out}/overhead"],
                  "confirms": "timing costs at most 1% (events) and 3% (sync) against a bare loop on one GPU"})
    steps.append({"name": "loaders", "command": [sys.executable, "loaders_bench.py", "--workers", "0", "2", "4", "8",
                                                 "--repeats", "2", "--modes", "device-copy", "in-training",
                                                 "--results-dir", "{out}"],
                  "confirms": "where pinned memory and workers hide the copy to the device"})
    steps.append({"name": "compare-dp", "command": [sys.executable, "compare_dp.py", "--rounds", "3",
                                                    "--results-dir", "{out}"],
                  "confirms": "each DDP worker binds its own GPU (NCCL); DataParallel needs two GPUs"})
    steps.append({"name": "ddp-compile", "config": "ddp", "args": [*MODEL, "--max-steps", "60", "--compile"],
                  "confirms": "torch.compile under DDP over NCCL: compile time, recompiles, speed per GPU"})
    steps.append({"name": "ddp-communication-memory", "config": "ddp",
                  "args": [*MODEL, "--max-steps", "40", "--measure-communication", "on", "--memory-every", "1"],
                  "confirms": "exposed communication over NCCL, measured on every step with CUDA events on the "
                              "compute stream, agrees with DDP's own logger on the same iterations; the one read of "
                              "DDP's buckets stays out of each GPU's peak memory (measurement_peak_allocated_gib)"})
    for step in steps:
        if "config" in step:
            verdict = launching.plan(step["config"], max(gpus, 1))
            if not verdict.runnable:
                step["skipped"] = verdict.reason
    return steps


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


SCALER_CONFIRMS = "a CUDA GradScaler with the fused AdamW skips exactly the steps with planted inf gradients"


def scaler_check() -> dict:
    """fp16 on CUDA: a real GradScaler, the fused AdamW and planted inf gradients; the skips counted."""
    from trainscope.precision import planted_overflow_run

    planted = {3, 7, 11}
    skips, _ = planted_overflow_run(torch.device("cuda"), planted)
    return {"planted": len(planted), "counted": skips.total(), "ok": skips.total() == len(planted)}


def run_step(step: dict, scratch: Path) -> dict:
    if step.get("skipped"):
        return {"name": step["name"], "seconds": 0.0, "skipped": step["skipped"]}
    started = time.monotonic()
    if "command" in step:
        out = scratch / step["name"]
        result = launching.run_captured([part.replace("{out}", str(out)) for part in step["command"]],
                                        launching.training_env())
        figures = {"exit": result.returncode, "output_tail": result.stdout[-2000:]}
        for path in out.glob("*.json") if out.exists() else []:  # results, not the records of the runs under it
            figures[path.stem] = json.loads(path.read_text())
    else:
        result = launching.run_training([*step["args"], "--output-dir", str(scratch), "--run-name", step["name"]],
                                        step["config"], echo=False)
        figures = {"exit": result.returncode}
        if result.returncode == 0:
            view = RunView(read_record(scratch / step["name"]))
            figures.update(throughput=view.throughput, mfu=view.mfu, memory=view.memory, compile=view.compile,
                           timing=view.summary.get("timing"), memory_snapshot=view.summary.get("memory_snapshot"),
                           communication=view.communication)
        else:
            figures["error"] = launching.failure_reason(result)
    return {"name": step["name"], "seconds": time.monotonic() - started, **figures}


def verdicts(results: dict) -> dict:
    """The goals, from the measured figures (None where a check did not produce its figure)."""
    speed = lambda name: ((results.get(f"precision-{name}") or {}).get("throughput") or {}).get("samples_per_s")  # noqa: E731
    out = {}
    if speed("bf16") and speed("fp32") and speed("tf32"):
        out["bf16_over_fp32"] = speed("bf16") / speed("fp32")
        out["bf16_over_tf32"] = speed("bf16") / speed("tf32")
    events, sync = results.get("timing-events", {}).get("timing"), results.get("timing-sync", {}).get("timing")
    if events and sync:
        a, b = events["across_ranks"]["steady"]["seconds"], sync["across_ranks"]["steady"]["seconds"]
        out["timing_agreement"] = max(abs(a[s]["median"] - b[s]["median"]) / max(b[s]["median"], 1e-9)
                                      for s in ("forward", "backward", "optimizer"))
    out["compiled_bf16_mfu"] = (results.get("compile-bf16") or {}).get("mfu")
    return out


def markdown(report: dict) -> list[str]:
    lines = [f"# GPU check: {report['device']}", "", f"Driver {report['driver']}, torch {torch.__version__}, CUDA "
             f"{torch.version.cuda}; {report['seconds']:.0f} s in all.", "", "| check | seconds | outcome |", "|---|---:|---|"]
    for r in report["checks"]:
        outcome = "ok" if r.get("exit", 0) == 0 else f"failed: {r.get('error', 'see JSON')}"
        if r.get("skipped"):
            outcome = f"skipped: {r['skipped']}"
        if r["name"].startswith(("precision", "compile", "timing")) and r.get("throughput"):
            outcome = (f"{r['throughput']['samples_per_s']:.1f} samples/s, {r['throughput']['tokens_per_s']:.0f} tokens/s, "
                       f"MFU {r['mfu']:.1%}" if r.get("mfu") is not None else outcome)
        lines.append(f"| {r['name']} | {r['seconds']:.0f} | {outcome} |")
    lines += ["", f"fp16 skipped steps: planted {report['scaler']['planted']}, counted {report['scaler']['counted']}.", ""]
    for goal, target in GOALS.items():
        value = report["verdicts"].get(goal)
        lines.append(f"- {goal}: " + ("not measured" if value is None else f"{value:.3f} (goal {target})"))
    lines += ["", "What these runs confirm that a CPU cannot:", f"- scaler: {SCALER_CONFIRMS}"]
    lines += [f"- {step['name']}: {step['confirms']}" for step in report["plan"]]
    return lines


def driver_version() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu"), help="results folder (default benchmarks/gpu)")
    parser.add_argument("--dry-run", action="store_true", help="print the checks and their commands; run nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        if not launching.cuda_devices():
            print("no CUDA device here: planned as for one GPU")
        for step in plan():
            command = " ".join(step.get("command") or launching.train_command(step["args"], step["config"]))
            print(f"{step['name']}: " + (f"skipped ({step['skipped']})" if step.get("skipped") else command))
            print(f"    confirms: {step['confirms']}")
        print(f"scaler (in this process): fp16 loss scaling with planted inf gradients\n    confirms: {SCALER_CONFIRMS}")
        return
    if not torch.cuda.is_available():
        print(f"gpu-check: no usable CUDA device for this torch ({torch.__version__}): nothing measured, nothing written")
        return
    import tempfile

    started, name = time.monotonic(), torch.cuda.get_device_name(0)
    steps = plan()
    with tempfile.TemporaryDirectory() as scratch:
        checks = [run_step(step, Path(scratch)) for step in steps]
    report = {"benchmark": "gpu_check", "device": name, "driver": driver_version(), "scaler": scaler_check(),
              "checks": checks, "plan": steps, "seconds": time.monotonic() - started}
    report["verdicts"] = verdicts({c["name"]: c for c in checks})
    for path in bench.write_results(Path(args.out) / device_slug(name), report, markdown(report)):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
