"""What compare_dp.py needs around its three loops (its flags are in trainscope.experiments.data_parallel.options):
the step clock and the helpers the loops share, the inputs built as train.py builds them, the torchrun launch of the
DDP workers, and the analysis and writing of its results (the speed ratios with their verdicts, the code diffs, the
N-GPU projection, Markdown, JSON, LaTeX and the figure). The loops themselves (single device, nn.DataParallel, DDP)
stay in compare_dp.py, where a reader sees them side by side."""

import difflib
import gc
import inspect
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from trainscope.core import environment, launching
from trainscope.core.errors import UserError
from trainscope.core.paths import GIB
from trainscope.core.record_view import RunView
from trainscope.core.records import read_record, write_text_atomic
from trainscope.experiments.data_parallel.options import CompareSettings
from trainscope.experiments.data_parallel.results import figure, projection_table, results_table
from trainscope.measure import bench
from trainscope.measure.communication.measured import INTERCONNECTS, ring_allreduce_seconds
from trainscope.measure.memory import CudaMemoryProbe, peak_rss_bytes
from trainscope.report import document
from trainscope.report.document import Bullets, Code, Heading, Paragraph
from trainscope.report.tables import save_figure

# Published multi-node data-parallel scaling, for scale: NVIDIA NeMo, 4B-parameter BERT on a DGX
# SuperPOD (8 x A100 80GB per node), tokens/s relative to one node.
ANCHORS = [
    {
        "what": f"NeMo BERT 4B, {nodes} nodes ({8 * nodes} A100)",
        "gpus": 8 * nodes,
        "speedup_over_8": speedup,
        "efficiency": speedup / nodes,
        "source": "https://docs.nvidia.com/nemo-framework/user-guide/latest/llms/bert/performance.html",
    }
    for nodes, speedup in ((2, 1.89), (16, 12.71))
]
# ---------------------------------------------------------------- helpers the loops share


class NotMeasurable(Exception):
    """The hardware here cannot run this variant; reported, never faked."""


class StepClock:
    """Times the steps after `warmup`; the device memory peaks are reset when the loop starts, so a peak
    belongs to this loop alone (not to one run before it in the same process)."""

    def __init__(self, warmup: int, devices: list[torch.device], barrier=None, probes=None):
        self.warmup, self.devices, self.barrier = warmup, devices, barrier
        self.probes = probes if probes is not None else [CudaMemoryProbe(d) for d in devices if d.type == "cuda"]
        gc.collect()
        if self.probes:
            torch.cuda.empty_cache()  # the parent's cached blocks from the previous loop
        for probe in self.probes:
            probe.reset()
        self.losses, self.steps, self.started = [], 0, None
        if warmup == 0:
            self._start()

    def _start(self):
        synchronize(self.devices)
        if self.barrier is not None:
            self.barrier()
        self.started = time.perf_counter()

    def step(self, loss) -> None:
        self.steps += 1
        if self.steps > self.warmup:
            self.losses.append(loss.detach())
        if self.steps == self.warmup:
            self._start()

    def finish(self) -> dict:
        """Wall time of the timed steps, their losses and each device's peak memory."""
        synchronize(self.devices)
        wall = time.perf_counter() - self.started
        memory = {str(p.device): p.read()[0] / GIB for p in self.probes} or {"cpu (peak RSS)": peak_rss_bytes() / GIB}
        return {"wall_s": wall, "losses": torch.stack(self.losses).float().cpu().tolist(), "peak_memory_gib": memory}


def worker_device(local_rank: int, cuda_available: bool) -> torch.device:
    """A DDP worker's device: the GPU of its local rank (one per process), else the CPU."""
    return torch.device("cuda", local_rank) if cuda_available else torch.device("cpu")


def bind(device: torch.device) -> None:
    """Make a worker's GPU its current device. Unbound, every rank's current device is cuda:0: barrier()
    has to guess a device (and warns), and what names no device (a CUDA context) can land on GPU 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def process_group_arguments(device: torch.device) -> dict:
    """init_process_group's arguments: NCCL bound to the worker's GPU (device_id), gloo on a CPU."""
    return {"backend": "nccl", "device_id": device} if device.type == "cuda" else {"backend": "gloo"}


def synchronize(devices) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def devices_of(model) -> list[torch.device]:
    ids = getattr(model, "device_ids", None) or []
    return [torch.device("cuda", i) for i in ids] or [next(model.parameters()).device]


def average_over_ranks(values: list[float], device) -> list[float]:
    tensor = torch.tensor(values, device=device)
    torch.distributed.all_reduce(tensor)
    return (tensor / torch.distributed.get_world_size()).cpu().tolist()


def gather_floats(value: float, device) -> list[float]:
    tensor = torch.tensor([value], device=device)
    gathered = [torch.zeros_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, tensor)
    return [t.item() for t in gathered]


def divisible_batch(global_batch: int, processes: int) -> int:
    """The multiple of `processes` nearest to `global_batch` (the larger one on a tie, never 0)."""
    below = max(processes, global_batch // processes * processes)
    above = below + processes
    return below if global_batch - below < above - global_batch else above


def training_rows(train, compare: CompareSettings):
    """Exactly (warm-up + steps) x global-batch training rows, the same for every loop."""
    needed = (compare.warmup_steps + compare.steps) * compare.global_batch_size
    if len(train) < needed:
        raise UserError(
            f"{compare.warmup_steps} + {compare.steps} steps of {compare.global_batch_size} need {needed} "
            f"training rows; the data has {len(train)}: lower --steps or raise --max-train-samples"
        )
    return train.select(range(needed))


def run_variant(loop, settings, compare, fresh_model, dataset, collate, **extra) -> dict:
    model, facts = fresh_model()
    result = loop(
        model,
        dataset,
        collate,
        compare.global_batch_size,
        settings.learning_rate,
        settings.seed,
        compare.warmup_steps,
        **extra,
    )
    samples = compare.steps * compare.global_batch_size
    result.update(
        status="measured",
        samples=samples,
        samples_per_s=samples / result["wall_s"],
        step_s=result["wall_s"] / compare.steps,
        final_loss=result["losses"][-1],
        threads=torch.get_num_threads(),
        gradient_bytes=sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
    )
    return result


# ---------------------------------------------------------------- the DDP launch


def launch_ddp(script: Path, processes: int, argv: list[str], global_batch: int) -> dict:
    """torchrun one worker per device running `script --role ddp-worker`: plain torch.distributed, no Accelerate,
    so the set-up is visible; the result rank 0 wrote."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # this process's cached blocks (DataParallel's, on every GPU) would crowd the workers
    with tempfile.TemporaryDirectory() as scratch:
        result_file = Path(scratch) / "ddp.json"
        torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(processes)]
        worker = ["--global-batch-size", str(global_batch), "--role", "ddp-worker", "--result-file", str(result_file)]
        command = [*torchrun, str(script), *argv, *worker]
        env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
        completed = launching.run_captured(command, env)
        if completed.returncode != 0:
            tail = "\n".join(completed.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"the DDP workers failed (exit {completed.returncode}):\n{tail}")
        return json.loads(result_file.read_text())


# ---------------------------------------------------------------- analysis (pure)


def code_diff(before, after) -> dict:
    """Unified diff between two loops' source and the number of lines it adds and removes."""
    a, b = inspect.getsource(before).splitlines(), inspect.getsource(after).splitlines()
    diff = list(difflib.unified_diff(a, b, before.__name__, after.__name__, lineterm="", n=1))
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
    return {
        "from": before.__name__,
        "to": after.__name__,
        "added": added,
        "removed": removed,
        "changed_lines": added + removed,
        "diff": "\n".join(diff),
    }


def project_ddp(
    compute_step_s: float,
    gradient_bytes: float,
    per_device_batch: int,
    gpus: list[int],
    bandwidth_gbs: float,
    latency_us: float,
    overlap: float,
) -> list[dict]:
    """DDP step time for N GPUs at a fixed per-device batch (weak scaling).

    step(N) = compute + (1 - overlap) * allreduce(N); efficiency = step(1) / step(N).
    """
    rows = []
    for n in gpus:
        communication = ring_allreduce_seconds(gradient_bytes, n, bandwidth_gbs, latency_us)
        step = compute_step_s + (1 - overlap) * communication
        rows.append(
            {
                "gpus": n,
                "step_s": step,
                "allreduce_s": communication,
                "samples_per_s": n * per_device_batch / step,
                "efficiency": compute_step_s / step,
            }
        )
    return rows


def hardware(gpus: int, processes: int, cores: int) -> dict:
    """What each variant runs on, and by how much more hardware DDP runs than the single device."""
    if gpus:
        return {
            "kind": "gpu",
            "single": "1 GPU",
            "ddp": f"{processes} GPUs",
            "data_parallel": f"{gpus} GPUs",
            "ddp_hardware_ratio": processes,
            "data_parallel_hardware_ratio": gpus,
            "note": "one GPU against N GPUs: scaling efficiency = speed-up / N",
        }
    threads = max(1, cores // processes)
    return {
        "kind": "cpu",
        "single": f"1 process x {cores} threads",
        "ddp": f"{processes} processes x {threads} thread(s)",
        "ddp_hardware_ratio": 1,
        "note": (
            f"the same {cores} cores on both sides: 1 process x {cores} threads against {processes} processes x "
            f"{threads} thread(s). This measures how well DDP uses the same cores (its communication and "
            "bookkeeping against intra-op threading), not what adding devices buys: efficiency = speed-up."
        ),
    }


def summarize_variant(rounds: list[dict]) -> dict:
    timed = ("wall_s", "samples_per_s", "step_s")
    return {
        **{k: v for k, v in rounds[0].items() if k not in timed},
        "status": "measured",
        "rounds": [
            {k: r[k] for k in (*timed, "peak_memory_gib") if k in r}
            | ({"per_rank_wall_s": r["per_rank_wall_s"]} if "per_rank_wall_s" in r else {})
            for r in rounds
        ],
        **{k: bench.spread([r[k] for r in rounds]) for k in timed},
    }


def compare_results(results: dict, rounds: list[dict], machine: dict) -> dict:
    """Per variant against the single device: speed ratios per round with a verdict, efficiency on an
    equal hardware budget, and how closely the losses agree."""
    single = results["single"]
    comparison = {}
    for name in ("data_parallel", "ddp"):
        if results[name].get("status") != "measured":
            continue
        speed = bench.compare_rounds(rounds, name, "single", "samples_per_s")
        ratio = machine[f"{name}_hardware_ratio"]
        comparison[name] = {
            "speed": speed,
            "hardware_ratio": ratio,
            "scaling_efficiency": speed["median_ratio"] / ratio,
            "max_abs_loss_difference": max(abs(a - b) for a, b in zip(single["losses"], results[name]["losses"])),
            "final_loss_difference": results[name]["final_loss"] - single["final_loss"],
        }
    return comparison


# ---------------------------------------------------------------- output


def write_outputs(report: dict, results_dir: Path) -> list[Path]:
    results_dir.mkdir(parents=True, exist_ok=True)
    paths = bench.write_results(results_dir / "compare_dp", report, markdown(report))
    for diff in report["code_changes"]:
        path = results_dir / f"{diff['from']}_to_{diff['to']}.diff"
        write_text_atomic(path, diff["diff"] + "\n")
        paths.append(path)
    write_text_atomic(results_dir / "compare_dp.tex", results_table(report).latex())
    return [*paths, results_dir / "compare_dp.tex", *save_figure(figure(report), results_dir / "compare_dp")]


def markdown(report: dict) -> list[str]:
    compare = report["compare"]
    return document.markdown(
        [
            Heading("DataParallel vs DDP"),
            Paragraph(
                f"{report['machine']['device_name']}: {report['machine']['hardware']['note']}\n{compare['steps']} "
                f"timed steps (after {compare['warmup_steps']} untimed) of global batch {report['global_batch_size']}, "
                f"{compare['rounds']} alternating rounds, model {report['settings']['model']}; verdicts: "
                f"{bench.METHOD}." + (f" {report['global_batch_note']}" if report.get("global_batch_note") else "")
            ),
            results_table(report),
            Heading("Code changes from the single-device loop", 2),
            *[
                block
                for diff in report["code_changes"]
                for block in (
                    Paragraph(
                        f"{diff['to']}: {diff['changed_lines']} changed lines (+{diff['added']} -{diff['removed']})"
                    ),
                    Code(diff["diff"], "diff"),
                )
            ],
            Heading("Projected DDP scaling", 2),
            Paragraph(report["projection"]["assumptions"]),
            projection_table(report),
            Paragraph("Published anchors:"),
            Bullets(
                [
                    f"{a['what']}: {a['speedup_over_8']}x one node, {a['efficiency']:.0%} efficiency ({a['source']})"
                    for a in ANCHORS
                ]
            ),
        ]
    )


def plan_batch(compare: CompareSettings, processes: int) -> str | None:
    """Sets compare.global_batch_size to a multiple of the DDP processes; the note that says so where it changed."""
    batch = divisible_batch(compare.global_batch_size, processes)
    if batch == compare.global_batch_size:
        return None
    note = (
        f"--global-batch-size {compare.global_batch_size} does not split over {processes} DDP processes: "
        f"using {batch}, the nearest multiple."
    )
    print(f"note: {note}", flush=True)
    compare.global_batch_size = batch
    return note


def build_report(settings, compare, rounds: list[dict], gpus: int, processes: int, cores: int, note, loops) -> dict:
    """The results file: each variant's rounds summarized, compared with the single device, the code diffs of
    `loops` (single device, DataParallel, DDP) and the N-GPU projection."""
    arms = [name for name in ("single", "ddp", "data_parallel") if name in rounds[0]]
    results = {name: summarize_variant([r[name] for r in rounds]) for name in arms}
    results.setdefault(
        "data_parallel",
        {
            "status": "not measurable here",
            "reason": (f"nn.DataParallel needs at least 2 CUDA devices; this machine has {gpus}"),
        },
    )
    results["ddp"]["backend"] = "nccl" if gpus else "gloo"
    machine = {
        "device_name": environment.device_name(torch.device("cuda" if gpus else "cpu")),
        "device_count": gpus,
        "usable_cores": cores,
        "hardware": hardware(gpus, processes, cores),
    }
    machine.update({k: v for k, v in machine["hardware"].items() if k.endswith("hardware_ratio")})
    single, dp, ddp = loops
    return {
        "benchmark": "compare_dp",
        "benchmark_version": 2,
        "machine": machine,
        "settings": asdict(settings),
        "compare": {k: v for k, v in asdict(compare).items() if k not in ("role", "result_file")},
        "global_batch_size": compare.global_batch_size,
        "global_batch_note": note,
        "results": results,
        "comparison": compare_results(results, rounds, machine),
        "code_changes": [code_diff(single, dp), code_diff(single, ddp)],
        "projection": projection(compare, results["single"], processes),
        "note_one_gpu": (
            "With one GPU, DDP runs a single process (world size 1: no all-reduce traffic, only its "
            "bookkeeping) and DataParallel cannot run; scaling needs two or more devices."
            if gpus == 1
            else None
        ),
    }


def projection(compare: CompareSettings, single: dict, processes: int) -> dict:
    """The N-GPU projection: compute per step from a measured GPU record, or an assumption said as such."""
    if compare.gpu_record:
        view = RunView(
            read_record(Path(compare.gpu_record).parent if compare.gpu_record.endswith(".json") else compare.gpu_record)
        )
        compute, per_device = view.step_s, view.plan["global_batch_size"] // view.world_size
        source = (
            f"the measured steady step of {view.name} ({compute:.4f} s at batch {per_device} per device on "
            f"{view.device_name}, {view.precision})"
        )
    else:
        compute, per_device = compare.assumed_compute_step_s, compare.global_batch_size
        source = (
            f"an ASSUMED {compute:.3f} s of compute per step at batch {per_device} (no --gpu-record given: this "
            "CPU's step time says nothing about a GPU's)"
        )
    presets = {name: INTERCONNECTS[name] for name in compare.interconnect or INTERCONNECTS}
    measured = json.loads(Path(compare.ddp_cost).read_text()).get("ring_model") if compare.ddp_cost else None
    if measured:
        presets["measured"] = {
            "bandwidth_gbs": measured["measured_bus_bandwidth_gbs"],
            "latency_us": 0.0,
            "what": f"the bus bandwidth make ddp-cost measured ({measured['world_size']} processes)",
        }
    if compare.bandwidth_gbs:
        presets["custom"] = {
            "bandwidth_gbs": compare.bandwidth_gbs,
            "latency_us": compare.latency_us,
            "what": "--bandwidth-gbs / --latency-us",
        }
    return {
        "compute_step_s": compute,
        "compute_source": "gpu_record" if compare.gpu_record else "assumed",
        "assumptions": (
            f"Weak scaling: every GPU computes a step in {source} and all-reduces {single['gradient_bytes'] / 1e6:.1f} MB "
            f"of gradients per step with a ring (2(N-1)/N x bytes / bandwidth + 2(N-1) x latency); {compare.overlap:.0%} "
            "of it hidden behind backward. Ignores stragglers, the data loader, and compute slowing under contention."
        ),
        "interconnects": {
            name: {
                **preset,
                "rows": project_ddp(
                    compute,
                    single["gradient_bytes"],
                    per_device,
                    compare.projection_gpus,
                    preset["bandwidth_gbs"],
                    preset["latency_us"],
                    compare.overlap,
                ),
            }
            for name, preset in presets.items()
        },
        "anchors": ANCHORS,
    }
