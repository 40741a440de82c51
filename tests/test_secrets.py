"""A dataset URL with credentials, served by a local HTTP server, through every script: the credentials
never reach the console or anything written."""

import http.server
import sys
import threading
from pathlib import Path

import pytest
from conftest import ONE_THREAD, ROOT, TINY, cpu_env, launch, run_command

PASSWORD, TOKEN = "s3cretpass-7781", "tok-55419203"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An HTTP server on localhost with a small labelled CSV; the URL carries user:password@ and a token."""
    root = tmp_path_factory.mktemp("served")
    rows = "".join(
        f"tweet number {i} is {'good' if i % 2 else 'bad'},{'good' if i % 2 else 'bad'}\n" for i in range(400)
    )
    (root / "data.csv").write_text("text,label\n" + rows)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://reader:{PASSWORD}@127.0.0.1:{server.server_address[1]}"
    yield base
    server.shutdown()


def leaks(completed, folder: Path) -> list[str]:
    """Where either secret shows: the console, or any file under `folder`."""
    found = [f"console ({secret})" for secret in (PASSWORD, TOKEN) if secret in completed.stdout + completed.stderr]
    for path in folder.rglob("*") if folder.exists() else []:
        if path.is_file():
            content = path.read_bytes()
            found += [f"{path} ({secret})" for secret in (PASSWORD, TOKEN) if secret.encode() in content]
    return found


def test_train_py_trains_from_a_credential_url_and_writes_no_secret(served, tmp_path):
    runs = tmp_path / "runs"
    url = f"{served}/data.csv?token={TOKEN}"
    completed = launch(
        "train.py",
        [
            *TINY,
            *ONE_THREAD,
            "--dataset",
            url,
            "--report-to",
            "tensorboard",
            "--output-dir",
            str(runs),
            "--run-name",
            "remote",
        ],
        launcher="python",
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert (runs / "remote" / "record.json").exists()
    assert leaks(completed, runs) == []


def test_a_missing_credential_url_is_one_line_without_the_secret(served, tmp_path):
    runs = tmp_path / "runs"
    completed = launch(
        "train.py",
        [*TINY, "--dataset", f"{served}/missing.csv?token={TOKEN}", "--output-dir", str(runs)],
        launcher="python",
    )
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines()[-1].startswith("error: cannot read dataset http://127.0.0.1:")
    assert leaks(completed, runs) == [] and not runs.exists()


@pytest.mark.parametrize(
    "script,args",
    [
        ("compare_dp.py", ["--steps", "4", "--rounds", "1", "--max-train-samples", "320"]),
        (
            "loaders_bench.py",
            ["--workers", "0", "--repeats", "1", "--modes", "pretokenized", "on-the-fly", "--max-train-samples", "128"],
        ),
    ],
)
def test_the_other_scripts_write_no_secret(served, tmp_path, script, args):
    results = tmp_path / "results"
    completed = run_command(
        [
            sys.executable,
            str(ROOT / script),
            "--model",
            "embedded:tiny-bert",
            "--threads",
            "1",
            "--dataset",
            f"{served}/data.csv?token={TOKEN}",
            "--results-dir",
            str(results),
            *args,
        ],
        env=cpu_env(),
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert any(results.iterdir()) and leaks(completed, results) == []
