"""A dataset URL with credentials, served by a local HTTP server, through every script: the credentials
never reach the console or anything written."""

from conftest import ONE_THREAD, TINY, TOKEN, leaks, run_in_process

import loaders_bench


def test_train_py_trains_from_a_credential_url_and_writes_no_secret(served, tmp_path, capfd):
    """In this process, TensorBoard writing too (what it prints to Python's streams and to the file descriptors)."""
    runs = tmp_path / "runs"
    url = f"{served}/data.csv?token={TOKEN}"
    args = [*TINY, *ONE_THREAD, "--dataset", url, "--report-to", "tensorboard"]
    completed = run_in_process([*args, "--output-dir", str(runs), "--run-name", "remote"])
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert (runs / "remote" / "record.json").exists()
    printed = completed.stdout + completed.stderr + "".join(capfd.readouterr())  # Python's streams, the descriptors
    assert leaks(printed, runs) == []


def test_a_missing_credential_url_is_one_line_without_the_secret(served, tmp_path, capfd):
    """In this process (what it prints to Python's streams and to the file descriptors both checked)."""
    runs = tmp_path / "runs"
    completed = run_in_process([*TINY, "--dataset", f"{served}/missing.csv?token={TOKEN}", "--output-dir", str(runs)])
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines()[-1].startswith("error: cannot read dataset http://127.0.0.1:")
    printed = completed.stdout + completed.stderr + "".join(capfd.readouterr())  # Python's streams, the descriptors
    assert leaks(printed, runs) == [] and not runs.exists()


def test_loaders_bench_writes_no_secret(served, tmp_path, capfd):
    """loaders_bench.py in this process (compare_dp.py's run on a credential URL: tests/test_compare_dp.py)."""
    results = tmp_path / "results"
    completed = run_in_process(
        [
            "--model",
            "embedded:tiny-bert",
            "--threads",
            "1",
            "--dataset",
            f"{served}/data.csv?token={TOKEN}",
            "--results-dir",
            str(results),
            *("--workers", "0", "--repeats", "1", "--modes", "pretokenized", "on-the-fly"),
            *("--max-train-samples", "128"),
        ],
        main=loaders_bench.main,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    printed = completed.stdout + completed.stderr + "".join(capfd.readouterr())  # Python's streams, the descriptors
    assert any(results.iterdir()) and leaks(printed, results) == []
