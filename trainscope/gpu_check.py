"""make gpu-check: what only a GPU can show, checked on one GPU in under 9 minutes.

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
5. the DataLoader sweep with the copy to the device;
6. single device vs DataParallel vs DDP on one device (what one GPU can and cannot show).
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


def plan() -> list[dict]:
    """The checks, each a name and the command that runs it (or None for the in-process scaler check)."""
    steps = [{"name": f"timing-{mode}", "config": "single_gpu",
              "args": [*MODEL, "--max-steps", "40", "--timing", mode, "--memory-every", "1"]} for mode in ("events", "sync")]
    steps += [{"name": f"precision-{name}", "config": config, "args": [*MODEL, "--max-steps", "60", *flags]}
              for name, (config, flags) in PRECISIONS.items()]
    steps.append({"name": "compile-bf16", "config": "bf16", "args": [*MODEL, "--max-steps", "60", "--compile"]})
    steps.append({"name": "overhead", "command": [sys.executable, "-m", "trainscope.benchmarks.overhead", "--pairs", "3",
                                                  "--modes", "events", "sync"]})
    steps.append({"name": "loaders", "command": [sys.executable, "loaders_bench.py", "--workers", "0", "2", "4", "8",
                                                 "--repeats", "2", "--modes", "device-copy", "in-training"]})
    steps.append({"name": "compare-dp", "command": [sys.executable, "compare_dp.py", "--rounds", "3"]})
    return steps


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def scaler_check() -> dict:
    """fp16 on CUDA: a real GradScaler, the fused AdamW and planted inf gradients; the skips counted."""
    from trainscope.precision import planted_overflow_run

    planted = {3, 7, 11}
    skips, _ = planted_overflow_run(torch.device("cuda"), planted)
    return {"planted": len(planted), "counted": skips.total(), "ok": skips.total() == len(planted)}


def run_step(step: dict, scratch: Path) -> dict:
    started = time.monotonic()
    if "command" in step:
        out = scratch / step["name"]
        result = launching.run_captured([*step["command"], *(["--results-dir", str(out)] if "loaders" in step["name"]
                                         or "compare" in step["name"] else ["--out", str(out / "overhead")])],
                                        launching.training_env())
        figures = {"exit": result.returncode, "output_tail": result.stdout[-2000:]}
        for path in out.rglob("*.json") if out.exists() else []:
            figures[path.stem] = json.loads(path.read_text())
    else:
        result = launching.run_training([*step["args"], "--output-dir", str(scratch), "--run-name", step["name"]],
                                        step["config"], echo=False)
        figures = {"exit": result.returncode}
        if result.returncode == 0:
            view = RunView(read_record(scratch / step["name"]))
            figures.update(throughput=view.throughput, mfu=view.mfu, memory=view.memory, compile=view.compile,
                           timing=view.summary.get("timing"))
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
        if r["name"].startswith(("precision", "compile", "timing")) and r.get("throughput"):
            outcome = (f"{r['throughput']['samples_per_s']:.1f} samples/s, {r['throughput']['tokens_per_s']:.0f} tokens/s, "
                       f"MFU {r['mfu']:.1%}" if r.get("mfu") is not None else outcome)
        lines.append(f"| {r['name']} | {r['seconds']:.0f} | {outcome} |")
    lines += ["", f"fp16 skipped steps: planted {report['scaler']['planted']}, counted {report['scaler']['counted']}.", ""]
    for goal, target in GOALS.items():
        value = report["verdicts"].get(goal)
        lines.append(f"- {goal}: " + ("not measured" if value is None else f"{value:.3f} (goal {target})"))
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
        for step in plan():
            print(f"{step['name']}: " + " ".join(step.get("command") or launching.train_command(step["args"], step["config"])))
        return
    if not torch.cuda.is_available():
        print(f"gpu-check: no usable CUDA device for this torch ({torch.__version__}): nothing measured, nothing written")
        return
    import tempfile

    started, name = time.monotonic(), torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as scratch:
        checks = [run_step(step, Path(scratch)) for step in plan()]
    report = {"benchmark": "gpu_check", "device": name, "driver": driver_version(), "scaler": scaler_check(),
              "checks": checks, "seconds": time.monotonic() - started}
    report["verdicts"] = verdicts({c["name"]: c for c in checks})
    for path in bench.write_results(Path(args.out) / device_slug(name), report, markdown(report)):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
