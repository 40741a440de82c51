"""What a newcomer's first `make train` shows: no library boilerplate a person cannot act on."""

import json
import os
import shlex
import subprocess
import sys

import pytest
from conftest import ROOT, cpu_env, planned_launch

from trainscope.workload import modeling
from trainscope.workload.settings import Settings


def test_make_train_passes_what_accelerate_would_otherwise_print_a_block_about():
    planned = subprocess.run(["make", "-n", "train"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    line = next(line for line in planned.splitlines() if " launch " in line and "train.py" in line)
    command = shlex.split(line)
    assert command[1:3] == ["launch", "--quiet"] and "--num_processes" in command
    plan = planned_launch(command, cpu_env())
    assert plan is not None and plan[0] == "python"
    assert "were not passed" not in plan[-1], plan[-1]


def test_the_new_classifier_head_is_one_line_of_ours_not_transformers_load_report(capfd):
    settings = Settings()  # the embedded pretrained MiniLM-L6
    model, weights, _ = modeling._pretrained_model(settings, ["negative", "neutral", "positive"])
    printed = "".join(capfd.readouterr())
    assert weights == "pretrained" and "LOAD REPORT" not in printed and "Loading weights" not in printed
    assert "3-class head is new (starts from random values" in printed and "classifier.weight" in printed


HELP_EVERY_MODULE = """
import contextlib, io, runpy, sys
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as end:
        assert end.code in (0, None), (module, end.code)
    assert "usage:" in out.getvalue(), module
"""


def test_every_module_the_makefile_runs_answers_help():
    """`python -m MODULE --help` for every module a Make target runs (argparse formats each help string then: a bare
    % in one ends --help in a traceback)."""
    import re

    modules = sorted(set(re.findall(r"-m (trainscope[\w.]*)", (ROOT / "Makefile").read_text())))
    assert len(modules) >= 6, modules
    done = subprocess.run(
        [sys.executable, "-c", HELP_EVERY_MODULE, *modules], capture_output=True, text=True, env=cpu_env(), cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_link_to_a_heading_of_a_page_resolves():
    """Links like docs/tune.md#in-the-code-... from the code and the pages name a heading that exists (GitHub's
    anchors: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens)."""
    import re

    def slug(heading: str) -> str:
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    pages = [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    anchors = {
        p.name: {slug(line.lstrip("#")) for line in p.read_text().splitlines() if line.startswith("#")} for p in pages
    }
    sources = [*pages, *ROOT.glob("*.py"), *(ROOT / "trainscope").rglob("*.py"), ROOT / "Makefile"]
    broken = [
        (str(source.relative_to(ROOT)), link.group(0))
        for source in sources
        for link in re.finditer(r"([A-Za-z_]+\.md)#([a-z0-9_-]+)", source.read_text())
        if link.group(1) in anchors and link.group(2) not in anchors[link.group(1)]
    ]
    assert broken == []


def _planted_setup(tmp_path, failing: bool) -> subprocess.CompletedProcess:
    """`make setup` from scratch against planted Pythons and uv (none of them installs anything): a system Python
    without torch, a venv Python without torch, and installers that succeed or fail with a planted error."""
    venv, bin_dir = tmp_path / "venv", tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    venv_python = '#!/bin/sh\ncase "$2" in *"import torch"*) exit 1;; esac\n' + (
        'if [ "$3" = install ]; then echo "ERROR: planted pip failure" >&2; exit 1; fi\n' if failing else ""
    )
    system = bin_dir / "python3"
    system.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -c ]; then exit 1; fi\n'
        f"mkdir -p {venv}/bin && cat > {venv}/bin/python <<'END'\n{venv_python}END\nchmod +x {venv}/bin/python\n"
    )
    uv = bin_dir / "uv"
    uv.write_text(
        "#!/bin/sh\n" + ('echo "error: planted: no solution for nothing==9.9" >&2; exit 1\n' if failing else "")
    )
    for planted in (system, uv):
        planted.chmod(0o755)
    env = cpu_env(PATH=f"{bin_dir}:{os.environ['PATH']}")
    for inherited in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS"):  # under `make test` a sub-make would say its directory
        env.pop(inherited, None)
    return subprocess.run(
        ["make", "-B", "setup", f"PYTHON={system}", f"VENV={venv}", "GPU_SIGNS="],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )


def test_make_setup_says_in_a_few_short_lines_what_it_installs_and_where(tmp_path):
    """A fresh clone's `make setup` prints one short line a step (the installers' commands and output go to the log,
    or to the terminal under V=1), and a failing install still shows its error and fails."""
    made = _planted_setup(tmp_path, failing=False)
    assert made.returncode == 0, made.stderr
    lines = made.stdout.replace(str(tmp_path), "/tmp").splitlines()  # the test's long paths for a clone's .venv
    assert 1 <= len(lines) <= 5 and all(len(line) <= 100 for line in lines), lines
    assert any("torch==" in line for line in lines) and made.stderr == ""
    failed = _planted_setup(tmp_path / "failing", failing=True)
    assert failed.returncode != 0
    assert "error: planted: no solution" in failed.stderr and "ERROR: planted pip failure" in failed.stderr


HELP_AND_IMPORTS = """
import contextlib, io, json, runpy, sys
sys.argv = [sys.argv[1], "--help"]
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out):
        runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as end:
    assert end.code in (0, None), end.code
heavy = ("torch", "transformers", "accelerate", "datasets", "evaluate", "matplotlib", "numpy")
print(json.dumps({"help": out.getvalue(), "loaded": [name for name in heavy if name in sys.modules]}))
"""


@pytest.mark.parametrize("script", ["loaders_bench.py", "compare_dp.py", "report.py"])
def test_a_scripts_help_loads_no_torch_and_lists_its_own_flags(script):
    """--help answers before torch, transformers or accelerate load (over a second on 2 cores: docs/benchmarks.md),
    checked by what it imported rather than by a clock. The scripts that take train.py's flags list their own and
    point to train.py's --help instead of repeating its hundreds of lines."""
    done = subprocess.run(
        [sys.executable, "-c", HELP_AND_IMPORTS, script], capture_output=True, text=True, env=cpu_env(), cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout)
    assert answer["loaded"] == [] and answer["help"].startswith("usage:")
    if script != "report.py":
        assert "python train.py --help" in answer["help"] and "--results-dir" in answer["help"]
        assert "--learning-rate" not in answer["help"] and len(answer["help"].splitlines()) < 100


def test_the_command_line_lists_its_commands_and_refuses_another_in_one_line():
    """`trainscope --help` names its command; an unknown one (or none) is one line on stderr and exit status 2."""
    program = [sys.executable, "-m", "trainscope"]
    shown = subprocess.run([*program, "--help"], capture_output=True, text=True, cwd=ROOT)
    assert shown.returncode == 0 and "\n  tune " in shown.stdout
    for argv in (["bogus"], []):
        refused = subprocess.run([*program, *argv], capture_output=True, text=True, cwd=ROOT)
        assert refused.returncode == 2 and refused.stdout == ""
        assert len(refused.stderr.strip().splitlines()) == 1 and "usage: trainscope tune" in refused.stderr
