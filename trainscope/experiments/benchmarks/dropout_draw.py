"""The dropout loop's draw (trainscope.workload.dropout_draws) against torch's bernoulli_: nanoseconds an element.

Alternating pairs of one draw each into memory already touched, after a check that both arms draw the same masks and
leave the same generator state (where they do not: no speed verdict, exit 1).

    python -m trainscope.experiments.benchmarks.dropout_draw [--elements 10000000] [--pairs 7] [--dtype float32]

Writes benchmarks/dropout_draw.{json,md}.
How it works: docs/benchmarks.md#in-the-code-how-make-bench-dropout-draw-measures-trainscopeexperimentsbenchmarksdropout_drawpy.
"""

import argparse
import contextlib
import ctypes
import ctypes.util
import resource
import sys
import time
from pathlib import Path

import torch

from trainscope.core import environment, precision
from trainscope.core.paths import ROOT
from trainscope.measure import bench
from trainscope.report.document import Heading, Paragraph, markdown
from trainscope.report.tables import Table, spread_cell
from trainscope.workload import dropout_draws

CPU = torch.device("cpu")
DTYPES = {name: dtype for dtype, name in dropout_draws.NAMES.items()}
DEFAULT_ELEMENTS = 10_000_000
DEFAULT_PAIRS = 7
# glibc's mallopt parameters (malloc.h) and the defaults put back after measuring
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX = 128 * 1024, 65536
KEEP_FREED = 2**31 - 1  # mallopt takes an int: freed memory up to 2 GiB stays with the process


@contextlib.contextmanager
def reused_memory(fresh: bool):
    """glibc keeps freed memory while the block runs (a draw's output lands where the last one was freed), put back
    as glibc's defaults after; yields how the outputs' memory was had."""
    libc = None
    if not fresh:
        with contextlib.suppress(OSError, AttributeError):
            found = ctypes.CDLL(ctypes.util.find_library("c") or None)
            found.mallopt.argtypes, found.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            libc = found  # a C library with mallopt (glibc's; not macOS's)
    if libc is None:
        yield "the allocator's own (fresh pages wherever it maps a draw's output afresh)"
        return
    try:
        kept = libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED)
        yield (
            "reused: glibc keeps freed memory (mallopt M_MMAP_MAX 0, M_TRIM_THRESHOLD 2 GiB)"
            if kept
            else "the allocator's own (glibc refused mallopt)"
        )
    finally:
        libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        with contextlib.suppress(AttributeError):
            libc.malloc_trim(0)


def loop_draw(shape, keep: float, dtype: torch.dtype) -> torch.Tensor:
    return dropout_draws.bernoulli(shape, keep, dtype, CPU)  # looked up at each call: the module's path as it stands


def torch_draw(shape, keep: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=CPU).bernoulli_(keep)  # dropout_draws.bernoulli's fallback


def timed(draw, elements: int, keep: float, dtype: torch.dtype, start: torch.Tensor) -> dict:
    """One draw from generator state `start`: ns an element and the minor page faults inside the timed window."""
    torch.set_rng_state(start)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    began = time.perf_counter()
    mask = draw((elements,), keep, dtype)
    seconds = time.perf_counter() - began
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    del mask  # freed outside the window: the next draw's memory
    return {"ns_per_element": seconds * 1e9 / elements, "page_faults": faults}


def same_draw(elements: int, keep: float, dtype: torch.dtype, seed: int) -> dict:
    """One draw by each arm from `seed`: are the masks equal, and is the generator left in the same state?"""
    torch.manual_seed(seed)
    start = torch.get_rng_state()
    theirs = torch_draw((elements,), keep, dtype)
    after_theirs = torch.get_rng_state()
    torch.set_rng_state(start)
    mine = loop_draw((elements,), keep, dtype)
    after_mine = torch.get_rng_state()
    same_mask = bool(torch.equal(theirs, mine))
    return {
        "seed": seed,
        "elements": elements,
        "same_mask": same_mask,
        "differing_elements": int((theirs != mine).sum()) if theirs.shape == mine.shape else None,
        "same_generator_state": bool(torch.equal(after_theirs, after_mine)),
        "same_work": same_mask and bool(torch.equal(after_theirs, after_mine)),
    }


def cpu_facts() -> dict:
    return {
        "model": environment.cpu_model_name(),
        "capability": environment.cpu_capability(),
        "instruction_set": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": precision.cpu_native_bf16(),
    }


def measure(args) -> dict:
    dtype, keep, elements = DTYPES[args.dtype], args.keep, args.elements
    torch.set_num_threads(args.threads)
    status = dropout_draws.status(CPU)  # builds and checks the loop on first use: before anything is timed
    usable = dropout_draws.drawn_here(dtype, CPU)
    report = {
        "benchmark": "dropout_draw",
        "benchmark_version": 1,
        "elements": elements,
        "dtype": args.dtype,
        "keep": keep,
        "pairs_planned": args.pairs,
        "threads_requested": args.threads,
        "threads": torch.get_num_threads(),
        "cpu": cpu_facts(),
        "dropout_draws": {
            "status": status,
            "drawn_here": usable,
            "checked_dtypes": [dropout_draws.NAMES[d] for d in dropout_draws._loaded.get("dtypes", [])],
            "marker": Path(dropout_draws._loaded["marker"]).name if dropout_draws._loaded.get("marker") else None,
        },
    }
    arms = {"loop": loop_draw, "torch": torch_draw} if usable else {"torch": torch_draw}
    with reused_memory(args.fresh_memory) as memory:
        report["memory"] = memory
        report["check"] = same_draw(elements, keep, dtype, args.seed) if usable else None
        torch.manual_seed(args.seed)
        start = torch.get_rng_state()
        for draw in arms.values():  # warm-up: code, the generator's path, the output's memory
            timed(draw, elements, keep, dtype, start)
        rounds = bench.alternate(
            {name: (lambda i, draw=draw: timed(draw, elements, keep, dtype, start)) for name, draw in arms.items()},
            args.pairs,
        )
    report["rounds"] = rounds
    report["arms"] = {
        name: {
            "ns_per_element": bench.spread([r[name]["ns_per_element"] for r in rounds]),
            "page_faults_per_draw": bench.spread([r[name]["page_faults"] for r in rounds]),
        }
        for name in arms
    }
    if not usable:
        report["comparison"] = None
        why = dropout_draws._loaded.get("why") or "its check did not pass this dtype"
        report["status"] = f"the loop is not used here for {args.dtype} ({why}): torch's bernoulli_ alone timed"
    elif not report["check"]["same_work"]:
        report["comparison"] = None
        report["status"] = (
            "the loop's draw differs from torch's bernoulli_ "
            f"(masks {'equal' if report['check']['same_mask'] else 'differ'}, generator state "
            f"{'equal' if report['check']['same_generator_state'] else 'differs'}): not the same work, no speed verdict"
        )
    else:
        # ratio torch / loop of each pair's ns an element: above 1, and "faster", is the loop faster
        report["comparison"] = bench.compare_rounds(rounds, "loop", "torch", "ns_per_element", higher_is_better=False)
        report["status"] = None
    return report


def page(report: dict) -> list:
    cpu, check, comparison = report["cpu"], report["check"], report["comparison"]
    arms = Table(
        "Arms",
        ["arm", "ns an element (median, min-max)", "page faults a draw (median)"],
        [
            [name, spread_cell(arm["ns_per_element"], digits=3), f"{arm['page_faults_per_draw']['median']:.0f}"]
            for name, arm in report["arms"].items()
        ],
        "dropout_draw_arms",
    )
    same = None
    if check is not None:
        differing = "" if check["same_mask"] else f" ({check['differing_elements']} of {check['elements']:,} elements)"
        same = Paragraph(
            f"Same masks and generator state as torch's bernoulli_ ({check['elements']:,} elements from seed "
            f"{check['seed']}): masks **{'equal' if check['same_mask'] else 'DIFFER'}**{differing}, generator state "
            f"**{'equal' if check['same_generator_state'] else 'DIFFERS'}**."
        )
    verdict = None
    if comparison is not None:
        verdict = Table(
            "Comparison",
            ["comparison", "ratio (median, min-max)", "verdict"],
            [["torch / loop (ns an element)", bench.ratio_text(comparison), f"the loop: {comparison['verdict']}"]],
            "dropout_draw",
            align="lrl",
        )
    elif check is not None:
        verdict = Paragraph(
            "No speed verdict: the two arms did not draw the same masks, so they did not do the same work."
        )
    return [
        Heading("The dropout loop's draw against torch's bernoulli_"),
        Paragraph(f"Status: {report['status']}." if report["status"] else ""),
        Paragraph(
            f"One draw of {report['elements']:,} elements ({report['dtype']}, keep {report['keep']}) per arm per pair, "
            f"allocated and filled as `dropout_draws.bernoulli` does; {len(report['rounds'])} alternating pairs; "
            f"memory: {report['memory']}; torch threads: {report['threads']} (asked {report['threads_requested']}); "
            f"CPU: {cpu['model']} ({cpu['capability']}); verdicts: {bench.METHOD}."
        ),
        Paragraph(f"Draws: {report['dropout_draws']['status']}."),
        same,
        arms,
        verdict,
    ]


def parser() -> argparse.ArgumentParser:
    default_out = ROOT / "benchmarks" / "dropout_draw"
    made = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    made.add_argument(
        "--elements",
        type=int,
        default=DEFAULT_ELEMENTS,
        help=f"elements in each draw (default {DEFAULT_ELEMENTS:,})",
    )
    made.add_argument("--pairs", type=int, default=DEFAULT_PAIRS, help=f"alternating pairs (default {DEFAULT_PAIRS})")
    made.add_argument("--dtype", default="float32", choices=list(DTYPES), help="the mask's dtype (default float32)")
    made.add_argument("--keep", type=float, default=0.9, help="the chance an element is kept, 1 - p (default 0.9)")
    made.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads while measuring (default 1: both draws are serial loops); the number in effect is recorded",
    )
    made.add_argument("--seed", type=int, default=0, help="the seed every draw starts from (default 0)")
    made.add_argument(
        "--fresh-memory",
        action="store_true",
        help="leave glibc's allocator alone: draws it maps afresh time their page faults too",
    )
    made.add_argument("--out", default=str(default_out), help=f"results path without suffix (default {default_out})")
    return made


def main() -> None:
    made = parser()
    args = made.parse_args()
    if args.elements < 1 or args.pairs < 1 or args.threads < 1:
        made.error("--elements, --pairs and --threads must be at least 1")
    if not 0 <= args.keep <= 1:
        made.error("--keep must be between 0 and 1")
    state = torch.get_rng_state()
    try:
        report = measure(args)
    finally:
        torch.set_rng_state(state)  # the generator as it was found
    bench.publish(Path(args.out), report, markdown(page(report)))
    if report["check"] is not None and not report["check"]["same_work"]:
        print(f"error: {report['status']}", file=sys.stderr)
        raise SystemExit(1)
    if report["comparison"] is not None:
        print(f"torch / loop: {bench.describe(report['comparison'])}", file=sys.stderr)


if __name__ == "__main__":
    main()
