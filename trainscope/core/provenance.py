"""Where a figure came from: commit (and whether the tree was dirty), exact command, date, machine,
threads, package versions, and the sha256 of every input a report or result read: `collect()` stamps every
output (docs/trust.md#provenance-everywhere).
"""

import hashlib
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from trainscope.core import environment
from trainscope.core.paths import ROOT

# Outputs, not code: a results folder changed by the benchmark being run does not make the tree dirty.
OUTPUT_FOLDERS = ("benchmarks/", "reports/")
LAUNCHERS = ("accelerate", "torchrun")


def _git(*args: str) -> str | None:
    try:
        result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def git_state() -> dict:
    """{commit, dirty, changed}: HEAD and the code paths that differ from it (outputs excluded)."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "changed": []}
    status = _git("status", "--porcelain", "--untracked-files=normal") or ""
    changed = [line[3:] for line in status.splitlines() if line[3:] and not line[3:].startswith(OUTPUT_FOLDERS)]
    return {"commit": commit.strip(), "dirty": bool(changed), "changed": changed}


def launch_command(pid: int | None = None) -> str:
    """The command line that started this run: the `accelerate launch ...` (or torchrun) parent when
    there is one, else this interpreter's own command line."""
    parent = _cmdline(os.getppid() if pid is None else pid) or []
    for index, part in enumerate(parent[:3]):
        if Path(part).name in LAUNCHERS:
            return shlex.join([Path(part).name, *parent[index + 1 :]])
    own = getattr(sys, "orig_argv", [sys.executable, *sys.argv])
    return shlex.join(["python" if "python" in Path(own[0]).name else own[0], *own[1:]])


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part] or None


def machine() -> dict:
    """What the figures ran on: device, usable cores and the threads this process uses."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return {
        "device_name": environment.device_name(device),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cpu": environment.device_name(torch.device("cpu")),
        "cpu_capability": environment.cpu_capability(),
        "usable_cores": environment.usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def collect(inputs=(), command: str | None = None) -> dict:
    """The provenance block: commit, dirty, command, date, machine, packages, input digests."""
    return {
        **git_state(),
        "command": command or launch_command(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "packages": environment.package_versions(),
        "inputs": [{"path": str(p), "sha256": sha256(Path(p))} for p in inputs],
    }


def markdown(block: dict, machine_label: str = "machine") -> list[str]:
    """The provenance block as Markdown lines (the footer of every results file); `machine_label` names its machine
    line (a report says it was built there, not measured)."""
    m = block["machine"]
    commit = (block["commit"] or "unknown")[:12] + (
        " (dirty: " + ", ".join(block["changed"][:5]) + ")" if block["dirty"] else " (clean)"
    )
    packages = ", ".join(f"{k} {v}" for k, v in block["packages"].items() if v)
    lines = [
        "## Provenance",
        "",
        f"- commit: {commit}",
        f"- command: `{block['command']}`",
        f"- date: {block['date']}",
        f"- {machine_label}: {m['device_name']} x {max(m['device_count'], 1)}, CPU {m['cpu']} ({m['cpu_capability']}), "
        f"{m['usable_cores']} usable cores, {m['torch_threads']} torch threads in the measuring process",
        f"- packages: {packages}",
    ]
    if block["inputs"]:
        lines.append(f"- inputs ({len(block['inputs'])} files, sha256): see the JSON")
    return lines
