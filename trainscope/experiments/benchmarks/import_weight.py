"""What `import trainscope; trainscope.Run` adds to a script that imports accelerate: fresh interpreters in
alternating rounds, each arm's own clock around its imports (the interpreter's start-up left out of both).

    python -m trainscope.experiments.benchmarks.import_weight [--pairs 10]

Writes benchmarks/import_weight.{json,md}. Target, stated before measuring: at most 0.5 s over `import accelerate`,
judged on the median added time's distribution-free interval, and none of transformers, datasets, evaluate or peft
loaded.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

from trainscope.core.paths import ROOT
from trainscope.measure import bench
from trainscope.report.document import Heading, Paragraph, markdown
from trainscope.report.tables import Table, spread_cell

TARGET_S = 0.5
WATCHED = ("transformers", "datasets", "evaluate", "peft", "torch")
ARMS = {
    "accelerate": "import accelerate",
    "accelerate + trainscope.Run": "import accelerate; import trainscope; trainscope.Run",
}


def child(imports: str) -> dict:
    """One fresh interpreter: seconds its imports took, and which watched libraries they loaded."""
    code = (
        "import time, sys, json; began = time.perf_counter(); "
        f"{imports}; seconds = time.perf_counter() - began; "
        f"print(json.dumps({{'seconds': seconds, 'loaded': sorted(set({list(WATCHED)!r}) & set(sys.modules))}}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def figures(rounds: list[dict]) -> dict:
    base, with_run = "accelerate", "accelerate + trainscope.Run"
    added = [r[with_run]["seconds"] - r[base]["seconds"] for r in rounds]
    interval = bench.median_interval(added)
    return {
        "rounds": rounds,
        "seconds": {arm: bench.spread([r[arm]["seconds"] for r in rounds]) for arm in ARMS},
        "added_s": {"median": statistics.median(added), **interval},
        "loaded": {arm: sorted({m for r in rounds for m in r[arm]["loaded"]}) for arm in ARMS},
        "target_s": TARGET_S,
        "meets_target": bench.within(interval, TARGET_S),
    }


def page(report: dict) -> list:
    added, seconds = report["added_s"], report["seconds"]
    verdict = {True: "met", False: "NOT met", None: "undecided"}[report["meets_target"]]
    rows = [
        [f"`{ARMS[arm]}`", spread_cell(s), ", ".join(m for m in report["loaded"][arm] if m != "torch") or "none"]
        for arm, s in seconds.items()
    ]
    return [
        Heading("Import weight of trainscope.Run"),
        Paragraph(f"{len(report['rounds'])} alternating rounds, each arm a fresh interpreter timing its own imports."),
        Table(
            "Import weight",
            ["arm", "seconds (median, min-max)", "model libraries loaded"],
            rows,
            "import_weight",
            align="lrl",
        ),  # fmt: skip
        Paragraph(
            f"trainscope.Run adds {added['median']:.2f} s (median; interval {added['low']:.2f} to {added['high']:.2f} s "
            f"at {added['confidence']:.1%}, order statistics of the rounds' differences): target <= "
            f"{report['target_s']} s {verdict}."
        ),
    ]


def main() -> None:
    parser = bench.driver_parser(__doc__, ROOT / "benchmarks" / "import_weight", "--child")
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    arms = {arm: (lambda i, imports=imports: child(imports)) for arm, imports in ARMS.items()}
    rounds = bench.alternate(arms, args.pairs)
    report = {"benchmark": "import_weight", "benchmark_version": 1, **figures(rounds)}
    bench.publish(Path(args.out), report, markdown(page(report)))


if __name__ == "__main__":
    main()
