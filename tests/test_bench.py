"""The benchmark harness: alternating order, verdicts from the spread, results files with provenance."""

import json
import os
import subprocess
import sys

import pytest

from trainscope import bench, provenance


def test_rounds_alternate_the_order_of_the_arms():
    order = []
    arms = {name: (lambda i, name=name: order.append((i, name)) or {"x": 1.0}) for name in ("a", "b", "c")}
    rounds = bench.alternate(arms, 4, log=lambda line: None)
    assert [name for _, name in order] == list("abc" "cba" "abc" "cba")
    assert len(rounds) == 4 and set(rounds[0]) == {"a", "b", "c"}


@pytest.mark.parametrize("ratios,verdict", [
    ([1.02, 1.05, 1.01, 1.03, 1.04], "faster"),
    ([0.97, 0.99, 0.95, 0.98, 0.96], "slower"),
    ([0.985, 1.016, 0.994, 1.004, 1.001], "within noise"),  # what a median of 1.0037 hid
    ([1.5, 1.6], "too few pairs"),
])
def test_the_verdict_comes_from_the_spread_not_the_median(ratios, verdict):
    comparison = bench.compare(ratios)
    assert comparison["verdict"] == verdict
    assert comparison["min_ratio"] == min(ratios) and comparison["max_ratio"] == max(ratios)


def test_pair_ratios_pair_each_round():
    rounds = [{"new": {"s": 12.0}, "old": {"s": 10.0}}, {"new": {"s": 9.0}, "old": {"s": 10.0}}]
    assert bench.pair_ratios(rounds, "new", "old", "s") == [1.2, 0.9]


def test_results_files_carry_provenance_and_are_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("SOME_API_KEY", "key-value-that-is-secret")
    data = tmp_path / "input.json"
    data.write_text("{}")
    paths = bench.write_results(tmp_path / "out", {"url": "https://u:p@h/x?sig=key-value-that-is-secret"},
                                ["# A result"], inputs=[data])
    report = json.loads(paths[0].read_text())
    block = report["provenance"]
    assert len(block["commit"]) == 40 and isinstance(block["dirty"], bool)
    assert block["machine"]["usable_cores"] >= 1 and block["machine"]["torch_threads"] >= 1
    assert block["packages"]["torch"] and block["date"]
    assert block["inputs"] == [{"path": str(data), "sha256": provenance.sha256(data)}]
    text = paths[0].read_text() + paths[1].read_text()
    assert "key-value-that-is-secret" not in text and "u:p@" not in text
    assert "## Provenance" in paths[1].read_text()


def test_outputs_do_not_make_the_tree_dirty_but_code_does():
    output = provenance.ROOT / "benchmarks" / f".probe-{os.getpid()}.json"
    code = provenance.ROOT / "trainscope" / f"_probe_{os.getpid()}.py"
    try:
        output.write_text("{}")
        assert f"benchmarks/{output.name}" not in provenance.git_state()["changed"]
        code.write_text("")
        state = provenance.git_state()
        assert state["dirty"] and f"trainscope/{code.name}" in state["changed"]
    finally:
        output.unlink(missing_ok=True)
        code.unlink(missing_ok=True)


def test_the_command_of_a_launched_run_is_its_launchers():
    code = "from trainscope import provenance; print(provenance.launch_command())"
    direct = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert direct.startswith("python -c")
    # a parent process that is a launcher names the command
    parent = subprocess.Popen(["sleep", "30"])
    try:
        assert provenance.launch_command(pid=parent.pid).startswith("python")  # `sleep` is not a launcher
    finally:
        parent.kill()
