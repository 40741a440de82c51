"""nn.DataParallel against DistributedDataParallel, measured on the same model, data and steps.

Three explicit loops, written to differ only where the parallelism differs (the diffs are part of
the output): one device; torch.nn.DataParallel (one process, the batch scattered over the GPUs,
outputs gathered on GPU 0); DDP with plain torch.distributed (one process per device, each with its
own shard of every global batch, gradients all-reduced). Same model, seed, global batch, samples and
optimizer steps; dropout is off so the three compute the same function and their losses can be
compared step by step.

    python compare_dp.py [--steps 20 --global-batch-size 32 --ddp-processes 2] [train.py data/model flags]

DataParallel needs at least two CUDA devices; with fewer it is reported as not measurable here.
DDP runs as processes on whatever is there (NCCL on GPUs, gloo on CPU). Writes
<results-dir>/compare_dp.{json,md,tex,png,pdf} and the two diffs.
"""

import contextlib
import difflib
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.hf_argparser import HfArg

from trainscope import environment
from trainscope.data import build_collator, load_classification_data
from trainscope.distributed import destroy_process_group
from trainscope.errors import UserError, exit_with
from trainscope.memory import GIB, peak_rss_bytes
from trainscope.modeling import build_model, build_tokenizer
from trainscope.records import write_json_atomic
from trainscope.reporting import save_figure
from trainscope.settings import Settings, parse_settings

ROOT = Path(__file__).resolve().parent
# All-reduce bus bandwidth (GB/s, per GPU) and per-hop latency (us) that NCCL reaches in practice;
# assumptions for the projection, overridable with --bandwidth-gbs / --latency-us.
INTERCONNECTS = {
    "nvlink": {"bandwidth_gbs": 350.0, "latency_us": 5.0, "what": "NVLink 4 / NVSwitch (H100 SXM node)"},
    "pcie": {"bandwidth_gbs": 20.0, "latency_us": 10.0, "what": "PCIe Gen4 x16 through the host, no NVLink"},
    "infiniband": {"bandwidth_gbs": 45.0, "latency_us": 8.0, "what": "InfiniBand NDR 400 Gb/s between nodes"},
}
# Published multi-node data-parallel scaling, for scale: NVIDIA NeMo, 4B-parameter BERT on a DGX
# SuperPOD (8 x A100 80GB per node), tokens/s relative to one node.
ANCHORS = [
    {"what": "NeMo BERT 4B, 2 nodes (16 A100)", "gpus": 16, "speedup_over_8": 1.89, "efficiency": 1.89 / 2,
     "source": "https://docs.nvidia.com/nemo-framework/user-guide/latest/llms/bert/performance.html"},
    {"what": "NeMo BERT 4B, 16 nodes (128 A100)", "gpus": 128, "speedup_over_8": 12.71, "efficiency": 12.71 / 16,
     "source": "https://docs.nvidia.com/nemo-framework/user-guide/latest/llms/bert/performance.html"},
]


@dataclass
class CompareSettings:
    steps: int = HfArg(default=20, help="Optimizer steps in every loop (one pass over steps x global batch samples).")
    global_batch_size: int = HfArg(default=32, help="Samples per optimizer step, summed over devices.")
    ddp_processes: int | None = HfArg(default=None, help="DDP processes; default: the GPU count, or 2 on a CPU.")
    results_dir: str = HfArg(default="results/compare_dp", help="Where results, tables, plot and diffs go.")
    projection_gpus: list[int] = HfArg(default_factory=lambda: [1, 2, 4, 8, 16],
                                       help="GPU counts for the DDP step-time projection.")
    interconnect: list[str] = HfArg(default_factory=lambda: list(INTERCONNECTS),
                                    help=f"Presets to project for: {', '.join(INTERCONNECTS)}.")
    bandwidth_gbs: float | None = HfArg(default=None, help="Custom all-reduce bandwidth in GB/s (adds a 'custom' row).")
    latency_us: float = HfArg(default=10.0, help="Per-hop latency in microseconds for --bandwidth-gbs.")
    overlap: float = HfArg(default=0.0, help="Share of the all-reduce hidden behind backward (DDP buckets); "
                           "0 assumes none, the pessimistic bound.")
    role: str = HfArg(default="compare", help="Internal: 'ddp-worker' runs one DDP process.")
    result_file: str | None = HfArg(default=None, help="Internal: where a DDP worker writes its result.")

    def validate(self):
        for flag, value in (("steps", self.steps), ("global-batch-size", self.global_batch_size)):
            if value < 1:
                raise UserError(f"--{flag} must be at least 1, got {value}")
        if self.ddp_processes is not None and self.ddp_processes < 1:
            raise UserError(f"--ddp-processes must be at least 1, got {self.ddp_processes}")
        unknown = [name for name in self.interconnect if name not in INTERCONNECTS]
        if unknown:
            raise UserError(f"unknown interconnect(s) {unknown}: choose from {', '.join(INTERCONNECTS)}")
        if not 0 <= self.overlap <= 1:
            raise UserError(f"--overlap must be between 0 and 1, got {self.overlap}")
        if any(n < 1 for n in self.projection_gpus):
            raise UserError("--projection-gpus must be positive")


# ---------------------------------------------------------------- the three loops


def single_device(model, dataset, collate, global_batch, lr, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device)
    sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    loader = torch.utils.data.DataLoader(dataset, batch_size=global_batch, sampler=sampler,
                                         collate_fn=collate, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, started = [], time.perf_counter()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    synchronize(device)
    return finish(losses, started, [device])


def data_parallel(model, dataset, collate, global_batch, lr, seed, min_gpus=2):
    if torch.cuda.device_count() < min_gpus:
        raise NotMeasurable(f"nn.DataParallel needs at least {min_gpus} CUDA devices; "
                            f"this machine has {torch.cuda.device_count()}")
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model = torch.nn.DataParallel(model.to(device))  # scatters each batch, gathers outputs on cuda:0
    sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    loader = torch.utils.data.DataLoader(dataset, batch_size=global_batch, sampler=sampler,
                                         collate_fn=collate, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, started = [], time.perf_counter()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    synchronize(device)
    return finish(losses, started, devices_of(model))


def distributed_data_parallel(model, dataset, collate, global_batch, lr, seed):
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if torch.cuda.is_available() else "cpu")
    model = torch.nn.parallel.DistributedDataParallel(model.to(device), device_ids=[device] if device.index is not None else None)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=global_batch // world, sampler=sampler,
                                         collate_fn=collate, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, started = [], time.perf_counter()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()  # DDP all-reduces (averages) gradients in buckets during backward
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    synchronize(device)
    result = finish(losses, started, [device])
    result["world_size"] = world
    result["losses"] = average_over_ranks(result["losses"], device)  # each rank saw its own shard
    result["per_rank_wall_s"] = gather_floats(result["wall_s"], device)
    destroy_process_group()
    return result


# ---------------------------------------------------------------- helpers the loops share


class NotMeasurable(Exception):
    """The hardware here cannot run this variant; reported, never faked."""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def devices_of(model) -> list[torch.device]:
    ids = getattr(model, "device_ids", None) or []
    return [torch.device("cuda", i) for i in ids] or [next(model.parameters()).device]


def finish(losses, started, devices) -> dict:
    """Wall time, per-step losses and per-device peak memory of a finished loop."""
    wall = time.perf_counter() - started
    memory = {}
    for device in devices:
        if device.type == "cuda":
            memory[str(device)] = torch.cuda.max_memory_allocated(device) / GIB
        else:
            memory["cpu (peak RSS)"] = peak_rss_bytes() / GIB
    return {"wall_s": wall, "losses": torch.stack(losses).float().cpu().tolist(), "peak_memory_gib": memory}


def average_over_ranks(values: list[float], device) -> list[float]:
    tensor = torch.tensor(values, device=device)
    torch.distributed.all_reduce(tensor)
    return (tensor / torch.distributed.get_world_size()).cpu().tolist()


def gather_floats(value: float, device) -> list[float]:
    tensor = torch.tensor([value], device=device)
    gathered = [torch.zeros_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, tensor)
    return [t.item() for t in gathered]


def prepare_inputs(settings: Settings, compare: CompareSettings):
    """Model (dropout off) and exactly steps x global-batch training rows, built as train.py builds them."""
    tokenizer = build_tokenizer(settings)
    data = load_classification_data(settings, tokenizer, contextlib.nullcontext)
    needed = compare.steps * compare.global_batch_size
    if len(data.train) < needed:
        raise UserError(f"{compare.steps} steps of {compare.global_batch_size} need {needed} training rows; the "
                        f"data has {len(data.train)}: lower --steps or raise --max-train-samples")
    dataset = data.train.select(range(needed))
    collate = build_collator(tokenizer, settings)

    def fresh_model():
        torch.manual_seed(settings.seed)
        model, facts = build_model(settings, data.label_names, tokenizer)
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0  # dropout masks would differ between one big and two half batches
        return model, facts

    return fresh_model, dataset, collate


def run_variant(loop, settings, compare, fresh_model, dataset, collate, **extra) -> dict:
    model, facts = fresh_model()
    result = loop(model, dataset, collate, compare.global_batch_size, settings.learning_rate, settings.seed, **extra)
    samples = compare.steps * compare.global_batch_size
    result.update(status="measured", samples=samples, samples_per_s=samples / result["wall_s"],
                  step_s=result["wall_s"] / compare.steps, final_loss=result["losses"][-1],
                  gradient_bytes=sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))
    return result


# ---------------------------------------------------------------- DDP worker and launcher


def ddp_worker(settings, compare) -> None:
    fresh_model, dataset, collate = prepare_inputs(settings, compare)
    result = run_variant(distributed_data_parallel, settings, compare, fresh_model, dataset, collate)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(compare.result_file).write_text(json.dumps(result))


def launch_ddp(processes: int, argv: list[str]) -> dict:
    """torchrun one worker per device: plain torch.distributed, no Accelerate, so the set-up is visible."""
    with tempfile.TemporaryDirectory() as scratch:
        result_file = Path(scratch) / "ddp.json"
        torchrun = str(Path(sys.executable).parent / "torchrun")
        command = [torchrun, "--standalone", "--nproc_per_node", str(processes), str(ROOT / "compare_dp.py"),
                   *argv, "--role", "ddp-worker", "--result-file", str(result_file)]
        threads = max(1, environment.usable_cores() // processes)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        env.pop("ACCELERATE_USE_CPU", None)
        completed = subprocess.run(command, env=env, capture_output=True, text=True)
        if completed.returncode != 0:
            tail = "\n".join(completed.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"the DDP workers failed (exit {completed.returncode}):\n{tail}")
        result = json.loads(result_file.read_text())
        result["threads_per_process"] = threads
        return result


# ---------------------------------------------------------------- analysis (pure)


def code_diff(before, after) -> dict:
    """Unified diff between two loops' source and the number of lines it adds and removes."""
    a, b = inspect.getsource(before).splitlines(), inspect.getsource(after).splitlines()
    diff = list(difflib.unified_diff(a, b, before.__name__, after.__name__, lineterm="", n=1))
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
    return {"from": before.__name__, "to": after.__name__, "added": added, "removed": removed,
            "changed_lines": added + removed, "diff": "\n".join(diff)}


def ring_allreduce_seconds(gradient_bytes: float, gpus: int, bandwidth_gbs: float, latency_us: float) -> float:
    """Ring all-reduce time: 2(N-1) steps, each moving 1/N of the buffer over one link.

    T = 2(N-1)/N * S / B + 2(N-1) * alpha   (Patarasuk & Yuan 2009; the NCCL performance notes
    define bus bandwidth the same way). One GPU communicates nothing.
    """
    if gpus <= 1:
        return 0.0
    return 2 * (gpus - 1) / gpus * gradient_bytes / (bandwidth_gbs * 1e9) + 2 * (gpus - 1) * latency_us * 1e-6


def project_ddp(compute_step_s: float, gradient_bytes: float, per_device_batch: int, gpus: list[int],
                bandwidth_gbs: float, latency_us: float, overlap: float) -> list[dict]:
    """DDP step time for N GPUs at a fixed per-device batch (weak scaling).

    step(N) = compute + (1 - overlap) * allreduce(N); efficiency = step(1) / step(N).
    """
    rows = []
    for n in gpus:
        communication = ring_allreduce_seconds(gradient_bytes, n, bandwidth_gbs, latency_us)
        step = compute_step_s + (1 - overlap) * communication
        rows.append({"gpus": n, "step_s": step, "allreduce_s": communication,
                     "samples_per_s": n * per_device_batch / step, "efficiency": compute_step_s / step})
    return rows


def compare_results(results: dict) -> dict:
    """Scaling efficiency against the single device, and how closely the losses agree."""
    single = results["single"]
    comparison = {}
    for name in ("data_parallel", "ddp"):
        result = results[name]
        if result.get("status") != "measured":
            continue
        devices = result.get("world_size") or max(1, len(result["peak_memory_gib"]))
        speedup = result["samples_per_s"] / single["samples_per_s"]
        comparison[name] = {
            "devices": devices, "speedup": speedup, "scaling_efficiency": speedup / devices,
            "max_abs_loss_difference": max(abs(a - b) for a, b in zip(single["losses"], result["losses"])),
            "final_loss_difference": result["final_loss"] - single["final_loss"],
        }
    return comparison


# ---------------------------------------------------------------- output


def write_outputs(report: dict, results_dir: Path) -> list[Path]:
    results_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(results_dir / "compare_dp.json", report)
    for diff in report["code_changes"]:
        (results_dir / f"{diff['from']}_to_{diff['to']}.diff").write_text(diff["diff"] + "\n")
    (results_dir / "compare_dp.md").write_text(markdown(report))
    (results_dir / "compare_dp.tex").write_text(latex(report))
    save_figure(plot_figure(report), results_dir / "compare_dp")
    return sorted(results_dir.iterdir())


def table_rows(report: dict) -> list[dict]:
    """One row per variant: what the Markdown and LaTeX tables show."""
    rows = []
    for name, label in (("single", "single device"), ("data_parallel", "nn.DataParallel"), ("ddp", "DDP")):
        result = report["results"][name]
        if result.get("status") != "measured":
            rows.append({"variant": label, "status": result.get("reason", "not measured")})
            continue
        comparison = report["comparison"].get(name, {})
        rows.append({
            "variant": label, "devices": comparison.get("devices", 1), "wall_s": result["wall_s"],
            "samples_per_s": result["samples_per_s"], "efficiency": comparison.get("scaling_efficiency", 1.0),
            "peak_memory": ", ".join(f"{k} {v:.2f}" for k, v in result["peak_memory_gib"].items()),
            "final_loss": result["final_loss"],
        })
    return rows


def markdown(report: dict) -> str:
    machine = report["machine"]
    lines = [f"# DataParallel vs DDP", "",
             f"{report['date']}, {machine['device_name']} x {machine['device_count'] or 1}, "
             f"{machine['usable_cores']} usable cores, torch {machine['torch']}. "
             f"{report['compare']['steps']} steps of global batch {report['compare']['global_batch_size']}, "
             f"model {report['settings']['model']}.", "",
             "| variant | devices | wall s (epoch) | samples/s | scaling efficiency | peak memory GiB | final loss |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for row in table_rows(report):
        if "status" in row:
            lines.append(f"| {row['variant']} | not measurable here: {row['status']} ||||||")
        else:
            lines.append(f"| {row['variant']} | {row['devices']} | {row['wall_s']:.2f} | {row['samples_per_s']:.1f} | "
                         f"{row['efficiency']:.1%} | {row['peak_memory']} | {row['final_loss']:.4f} |")
    lines += ["", "## Code changes from the single-device loop", ""]
    for diff in report["code_changes"]:
        lines += [f"{diff['to']}: {diff['changed_lines']} changed lines (+{diff['added']} -{diff['removed']})", "",
                  "```diff", diff["diff"], "```", ""]
    lines += ["## Projected DDP scaling", "", report["projection"]["assumptions"], "",
              "| interconnect | GPUs | step s | all-reduce s | samples/s | efficiency |", "|---|---:|---:|---:|---:|---:|"]
    for name, preset in report["projection"]["interconnects"].items():
        for row in preset["rows"]:
            lines.append(f"| {name} | {row['gpus']} | {row['step_s']:.4f} | {row['allreduce_s']:.4f} | "
                         f"{row['samples_per_s']:.1f} | {row['efficiency']:.1%} |")
    lines += ["", "Published anchors:"]
    lines += [f"- {a['what']}: {a['speedup_over_8']}x one node, {a['efficiency']:.0%} efficiency ({a['source']})"
              for a in ANCHORS]
    return "\n".join(lines) + "\n"


def latex(report: dict) -> str:
    lines = [r"\begin{table}[t]", r"\centering", r"\begin{tabular}{lrrrrr}", r"\toprule",
             r"Variant & Devices & Wall (s) & Samples/s & Efficiency & Final loss \\", r"\midrule"]
    for row in table_rows(report):
        if "status" in row:
            lines.append(rf"{row['variant']} & \multicolumn{{5}}{{l}}{{not measurable here}} \\")
        else:
            lines.append(rf"{row['variant']} & {row['devices']} & {row['wall_s']:.2f} & {row['samples_per_s']:.1f} & "
                         rf"{100 * row['efficiency']:.1f}\% & {row['final_loss']:.4f} \\")
    lines += [r"\bottomrule", r"\end{tabular}",
              rf"\caption{{DataParallel vs DDP on {report['machine']['device_name'].replace('_', ' ')}.}}",
              r"\label{tab:compare-dp}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def plot_figure(report: dict):
    """Throughput per variant and peak memory per device (DataParallel's device-0 imbalance shows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table_rows(report) if "status" not in r]
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(10, 3.8))
    speed.bar([r["variant"] for r in rows], [r["samples_per_s"] for r in rows], color="tab:blue")
    speed.set_ylabel("samples/s")
    speed.set_title("throughput")
    labels, values = [], []
    for name in ("single", "data_parallel", "ddp"):
        result = report["results"][name]
        if result.get("status") == "measured":
            for device, gib in result["peak_memory_gib"].items():
                labels.append(f"{name}\n{device}")
                values.append(gib)
    memory.bar(labels, values, color="tab:orange")
    memory.set_ylabel("peak memory (GiB)")
    memory.set_title("per device")
    memory.tick_params(axis="x", labelsize=7)
    missing = [name for name, result in report["results"].items() if result.get("status") != "measured"]
    if missing:
        speed.set_xlabel(f"not measurable here: {', '.join(missing)}", fontsize=8)
    figure.tight_layout()
    return figure


# ---------------------------------------------------------------- main


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    settings, compare = parse_settings(CompareSettings, argv=argv, description=__doc__)
    if compare.role == "ddp-worker":
        return ddp_worker(settings, compare)
    try:
        report = compare_all(settings, compare, argv)
    except UserError as error:
        exit_with(error)
    for path in write_outputs(report, Path(compare.results_dir)):
        print(f"wrote {path}")
    print((Path(compare.results_dir) / "compare_dp.md").read_text())


def compare_all(settings, compare, argv) -> dict:
    gpus = torch.cuda.device_count()
    processes = compare.ddp_processes or (gpus if gpus else 2)
    if compare.global_batch_size % processes:
        raise UserError(f"--global-batch-size {compare.global_batch_size} does not split over "
                        f"{processes} DDP processes")
    fresh_model, dataset, collate = prepare_inputs(settings, compare)
    results = {"single": run_variant(single_device, settings, compare, fresh_model, dataset, collate)}
    print(f"single device: {results['single']['samples_per_s']:.1f} samples/s", flush=True)
    try:
        results["data_parallel"] = run_variant(data_parallel, settings, compare, fresh_model, dataset, collate)
    except NotMeasurable as reason:
        results["data_parallel"] = {"status": "not measurable here", "reason": str(reason)}
    print(f"DataParallel: {results['data_parallel'].get('samples_per_s', results['data_parallel'].get('reason'))}")
    results["ddp"] = launch_ddp(processes, argv)
    results["ddp"]["backend"] = "nccl" if gpus else "gloo"
    print(f"DDP x{processes}: {results['ddp']['samples_per_s']:.1f} samples/s", flush=True)

    single = results["single"]
    presets = {name: INTERCONNECTS[name] for name in compare.interconnect}
    if compare.bandwidth_gbs:
        presets["custom"] = {"bandwidth_gbs": compare.bandwidth_gbs, "latency_us": compare.latency_us,
                             "what": "--bandwidth-gbs / --latency-us"}
    device = torch.device("cuda" if gpus else "cpu")
    projection = {
        "assumptions": (
            f"Weak scaling: every GPU keeps the measured single-device step ({single['step_s']:.4f} s at batch "
            f"{compare.global_batch_size} on {environment.device_name(device)}) and all-reduces "
            f"{single['gradient_bytes'] / 1e6:.1f} MB of gradients per step with a ring "
            f"(2(N-1)/N x bytes / bandwidth + 2(N-1) x latency); {compare.overlap:.0%} of it hidden behind "
            "backward. Ignores stragglers, the data loader, and compute slowing under contention."),
        "interconnects": {name: {**preset, "rows": project_ddp(single["step_s"], single["gradient_bytes"],
                                                                compare.global_batch_size, compare.projection_gpus,
                                                                preset["bandwidth_gbs"], preset["latency_us"],
                                                                compare.overlap)}
                          for name, preset in presets.items()},
        "anchors": ANCHORS,
    }
    return {
        "benchmark": "compare_dp", "benchmark_version": 1, "date": date.today().isoformat(),
        "machine": {"device_name": environment.device_name(device), "device_count": gpus,
                    "usable_cores": environment.usable_cores(), "torch": torch.__version__},
        "settings": asdict(settings), "compare": {k: v for k, v in asdict(compare).items()
                                                  if k not in ("role", "result_file")},
        "results": results,
        "comparison": compare_results(results),
        "code_changes": [code_diff(single_device, data_parallel), code_diff(single_device, distributed_data_parallel)],
        "projection": projection,
        "note_one_gpu": ("With one GPU, DDP runs a single process (world size 1: no all-reduce traffic, only its "
                         "bookkeeping) and DataParallel cannot run; scaling needs two or more devices."
                         if gpus == 1 else None),
    }


if __name__ == "__main__":
    main()
