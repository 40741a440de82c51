import json

import pytest

from trainscope.records import (
    SCHEMA_VERSION, RunRecord, read_record, read_steps, scrub, secret_values, write_json_atomic,
)
from trainscope.summary import combine_ranks, throughput
from trainscope.timing import stage_table


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    write_json_atomic(tmp_path / "r.json", {"a": 1})
    write_json_atomic(tmp_path / "r.json", {"a": 2})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_failed_write_keeps_the_previous_record(tmp_path):
    write_json_atomic(tmp_path / "r.json", {"a": 1})
    class Unwritable:
        def __str__(self):
            raise RuntimeError("cannot be written")

    with pytest.raises(RuntimeError):
        write_json_atomic(tmp_path / "r.json", {"a": Unwritable()})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_secrets_from_the_environment_are_scrubbed(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    monkeypatch.setenv("MY_SERVICE_PASSWORD", "correct-horse-battery")
    monkeypatch.setenv("SHORT_TOKEN", "abc")  # too short to be told from ordinary words
    assert "hf_abcdefghijklmnop" in secret_values()
    assert "abc" not in secret_values()
    record = RunRecord(tmp_path / "run")
    record.update(settings={"dataset": "https://x:hf_abcdefghijklmnop@host/d.csv", "note": "correct-horse-battery"})
    record.append_step({"step": 1, "msg": "hf_abcdefghijklmnop"})
    text = (tmp_path / "run" / "record.json").read_text() + (tmp_path / "run" / "steps.jsonl").read_text()
    assert "hf_abcdefghijklmnop" not in text and "correct-horse-battery" not in text
    assert scrub({"k": ["a hf_abcdefghijklmnop b"]}) == {"k": ["a *** b"]}


def test_record_round_trip_and_schema_checks(tmp_path):
    record = RunRecord(tmp_path / "run")
    record.update(status="running")
    assert read_record(tmp_path / "run") == {"schema_version": SCHEMA_VERSION, "status": "running"}
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "record.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a trainscope run record"):
        read_record(tmp_path / "foreign")
    (tmp_path / "foreign" / "record.json").write_text('{"schema_')
    with pytest.raises(ValueError, match="not a readable run record"):
        read_record(tmp_path / "foreign")


def test_truncating_steps_for_a_resumed_run(tmp_path):
    record = RunRecord(tmp_path / "run")
    record.update(status="running")
    for step in range(1, 8):
        record.append_step({"step": step, "loss": 1.0 / step})
    record.truncate_steps(after_step=4)
    assert [line["step"] for line in read_steps(tmp_path / "run")] == [1, 2, 3, 4]


def rank(wall, forward, samples, tokens, steps=10, eval_s=0.0):
    table = stage_table({"forward": forward, "eval": eval_s}, wall)
    return {"timing": {"steady": table}, "counts": {"steady": {"samples": samples, "tokens": tokens,
                                                                "optimizer_steps": steps}}}


def test_ranks_combine_into_median_and_max_and_global_throughput():
    per_rank = [rank(10.0, 4.0, 100, 1000), rank(12.0, 8.0, 100, 1100), rank(11.0, 5.0, 100, 900)]
    combined = combine_ranks(per_rank, "steady")
    assert combined["seconds"]["forward"] == {"median": 5.0, "max": 8.0}
    assert combined["wall_s"] == {"median": 11.0, "max": 12.0}
    speed = throughput(per_rank, "steady")
    assert speed["samples_per_s"] == pytest.approx(300 / 12.0)  # everybody's samples over the slowest rank
    assert speed["tokens_per_s"] == pytest.approx(3000 / 12.0)
    assert speed["step_s"] == pytest.approx(1.2)


def test_throughput_leaves_evaluation_time_out():
    speed = throughput([rank(10.0, 4.0, 100, 1000, eval_s=5.0)], "steady")
    assert speed["samples_per_s"] == pytest.approx(100 / 5.0)
