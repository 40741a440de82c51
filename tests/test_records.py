import json
import os

import pytest

from trainscope.core.record_view import RunView
from trainscope.core.records import (
    SCHEMA_VERSION,
    RunRecord,
    read_record,
    read_steps,
    redact,
    scrub,
    secret_values,
    write_json_atomic,
    write_text_atomic,
)
from trainscope.measure.summary import throughput
from trainscope.measure.timing import stage_table


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    write_json_atomic(tmp_path / "r.json", {"a": 1})
    write_json_atomic(tmp_path / "r.json", {"a": 2})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_written_file_gets_the_permissions_the_umask_gives(tmp_path):
    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "r.json", {"a": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600


def test_failed_write_keeps_the_previous_record(tmp_path):
    write_json_atomic(tmp_path / "r.json", {"a": 1})

    class Unwritable:
        def __str__(self):
            raise RuntimeError("cannot be written")

    with pytest.raises(RuntimeError):
        write_json_atomic(tmp_path / "r.json", {"a": Unwritable()})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("https://user:hunter2@host.example/data.csv?token=abc", "https://host.example/data.csv"),
        ("cannot read 'https://u:p@h/x.csv?sig=1#frag' here", "cannot read 'https://h/x.csv' here"),
        ("s3://bucket/key.parquet?X-Amz-Signature=zz", "s3://bucket/key.parquet"),
        ("memory://bucket/tweets.csv", "memory://bucket/tweets.csv"),
        ("/local/path.csv and plain words", "/local/path.csv and plain words"),
    ],
)
def test_urls_lose_credentials_queries_and_fragments(text, expected):
    assert redact(text, secrets=[]) == expected


def test_secrets_from_the_environment_are_scrubbed_from_everything_written(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    monkeypatch.setenv("MY_SERVICE_PASSWORD", "correct-horse-battery")
    monkeypatch.setenv("SHORT_TOKEN", "abc")  # too short to be told from ordinary words
    assert "hf_abcdefghijklmnop" in secret_values() and "abc" not in secret_values()
    record = RunRecord(tmp_path / "run")
    record.update(
        settings={"dataset": "https://x:pw@host/d.csv?sig=hf_abcdefghijklmnop", "note": "correct-horse-battery"}
    )
    record.append_step({"step": 1, "msg": "hf_abcdefghijklmnop"})
    write_text_atomic(tmp_path / "notes.md", "see https://x:pw@host/d.csv")
    text = "".join(p.read_text() for p in tmp_path.rglob("*") if p.is_file())
    for secret in ("hf_abcdefghijklmnop", "correct-horse-battery", "x:pw@", "sig="):
        assert secret not in text
    assert scrub({"k": ["a hf_abcdefghijklmnop b"]}) == {"k": ["a *** b"]}


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"hello": 1}', "not a trainscope run record"),
        ('{"schema_', "not a readable run record"),
        ('{"schema_version": "2"}', "schema_version '2' is not one this trainscope reads"),
        ('{"schema_version": 9}', "schema_version 9 is not one this trainscope reads"),
        (
            '{"schema_version": 2, "status": "complete", "run_name": "x", "settings": {}, "environment": {}}',
            "marked complete but lacks summary",
        ),
        (
            '{"schema_version": 2, "status": "complete", "run_name": "x", "settings": {}, "environment": {}, '
            '"summary": {"world_size": 1}}',
            "lacks summary.timing",
        ),
    ],
)
def test_records_we_cannot_read_are_refused_in_one_line_naming_the_file(tmp_path, content, message):
    (tmp_path / "record.json").write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        read_record(tmp_path)
    assert str(tmp_path / "record.json") in str(error.value) and "\n" not in str(error.value)


def test_both_schemas_are_readable(tmp_path):
    for version in (1, SCHEMA_VERSION):
        (tmp_path / str(version)).mkdir()
        (tmp_path / str(version) / "record.json").write_text(
            json.dumps({"schema_version": version, "status": "running"})
        )
        assert read_record(tmp_path / str(version))["schema_version"] == version


def test_a_truncated_last_step_line_is_skipped_with_a_warning(tmp_path):
    record = RunRecord(tmp_path)
    for step in (1, 2, 3):
        record.append_step({"step": step, "loss": 1.0 / step})
    with open(tmp_path / "steps.jsonl", "a") as handle:
        handle.write('{"step": 4, "lo')  # a run killed while writing
    problems = []
    assert [line["step"] for line in read_steps(tmp_path, problems)] == [1, 2, 3]
    assert len(problems) == 1 and "steps.jsonl:4" in problems[0]


def test_step_lines_are_appended_whole(tmp_path):
    record = RunRecord(tmp_path)
    line = {"step": 1, "payload": "x" * 100_000}
    record.append_step(line)
    record.append_step({**line, "step": 2})
    assert [json.loads(text)["step"] for text in (tmp_path / "steps.jsonl").read_text().splitlines()] == [1, 2]


def test_truncating_steps_for_a_resumed_run(tmp_path):
    record = RunRecord(tmp_path / "run")
    record.update(status="running")
    for step in range(1, 8):
        record.append_step({"step": step, "loss": 1.0 / step})
    record.truncate_steps(after_step=4)
    assert [line["step"] for line in read_steps(tmp_path / "run")] == [1, 2, 3, 4]


def rank(wall, forward, samples, tokens, steps=10, eval_s=0.0):
    table = stage_table({"forward": forward, "eval": eval_s}, wall)
    return {
        "timing": {"steady": table},
        "counts": {"steady": {"samples": samples, "tokens": tokens, "optimizer_steps": steps}},
    }


def test_global_throughput_is_every_rank_over_the_slowest_and_leaves_evaluation_out():
    per_rank = [rank(10.0, 4.0, 100, 1000), rank(12.0, 8.0, 100, 1100, eval_s=2.0), rank(11.0, 5.0, 100, 900)]
    speed = throughput(per_rank, "steady")
    assert speed["samples_per_s"] == pytest.approx(300 / 11.0)  # slowest training time: 11 (12 less 2 of eval)
    assert speed["tokens_per_s"] == pytest.approx(3000 / 11.0)
    assert speed["step_s"] == pytest.approx(1.1)


def test_peak_memory_prefers_the_device_allocator():
    def peak(memory):
        return RunView({"summary": {"memory": memory}}).peak_memory

    assert peak({"peak_rss_gib": {"max": 3.0}}) == (3.0, "peak RSS")
    assert peak({"peak_rss_gib": {"max": 3.0}, "max_allocated_gib": {"max": 1.5}}) == (1.5, "max allocated")
    assert peak({}) == (None, "unknown")  # a partial record without memory figures
