"""What a newcomer's first `make train` shows: no library boilerplate a person cannot act on."""

import shlex
import subprocess

from conftest import ROOT, cpu_env, planned_launch

from trainscope import modeling
from trainscope.settings import Settings


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
