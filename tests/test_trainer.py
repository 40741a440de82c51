"""trainscope.TrainscopeCallback on a transformers.Trainer run written as the Trainer's documentation writes one
(tests/public_loops/hf_trainer.py): gradient accumulation 2 with a short last window, evaluation on, each figure of
the record against the run's own count (torch's optimizer step hook, what the Trainer's loader fed, FlopCounterMode
on the model as trained, the wall clock), the Trainer's own figures beside; LoRA through peft; two DDP ranks."""

import ast
import json

import pytest
from conftest import ROOT, assert_ok, read_record, read_steps, run_in_forked_ranks, run_in_process
from public_loops import hf_trainer
from test_conformance import FLOPS_TOLERANCE, counted


def trainer_run(tmp_path, *args):
    result = run_in_process(["--output-dir", str(tmp_path / "runs"), "--truth", str(tmp_path / "truth"), *args],
                            main=hf_trainer.main)  # fmt: skip
    assert_ok(result)
    return read_record(tmp_path / "runs" / "hf_trainer"), json.loads((tmp_path / "truth.0").read_text()), result


def test_a_trainer_with_the_callback_records_what_its_loop_did(tmp_path):
    """72 rows in batches of 8 are 9 micro-batches an epoch, windows of 2, 2, 2, 2 and the short 1: 10 optimizer
    steps of 18 micro-batches over two epochs, with evaluations every 3 steps. The BERT's FLOPs are its layers walked
    as they train, exactly FlopCounterMode's count on SDPA's math backend (the encoder formula without the walk is
    within 0.7%: only equality tells them apart); the record names the attention kernels torch picked."""
    record, truth, result = trainer_run(tmp_path)
    summary = record["summary"]
    assert record["status"] == "complete"
    assert record["instrument"]["api"] == "trainscope.TrainscopeCallback (transformers.Trainer)"
    assert summary["optimizer_steps"] == truth["optimizer_steps"] == 10  # torch's own count
    assert counted(record, "micro_batches") == sum(truth["shapes"].values()) == 18
    assert counted(record, "samples") == truth["samples"] == 2 * 72
    assert counted(record, "tokens") == truth["tokens"]  # the attention masks' real tokens
    assert record["instrument"]["flops_basis"].startswith("formula: the model's layers as they train")
    assert counted(record, "flops") == truth["flops"]
    kernels = record["environment"]["sdpa_kernels"]  # attention dropout 0.1 keeps training off the fused CPU kernel
    assert (kernels["training"], kernels["evaluation"], kernels["attention_dropout"]) == (
        "MATH",
        "FLASH_ATTENTION",
        0.1,
    )
    lines = read_steps(tmp_path / "runs" / "hf_trainer")
    assert [line["micro_batches"] for line in lines] == [4, 4, 3, 4, 3]  # each epoch's short window in lines 3 and 5
    # every stage bounded by the Trainer's events and methods, summing to the run's wall time within the clock
    run = summary["timing"]["across_ranks"]["run"]
    assert all(run["seconds"][stage]["median"] > 0 for stage in ("data", "forward", "backward", "optimizer", "eval"))
    assert sum(s["median"] for s in run["seconds"].values()) == pytest.approx(run["wall_s"]["median"], rel=1e-6)
    assert 0 < run["wall_s"]["median"] <= truth["wall_s"]
    assert [v["step"] for v in summary["validation"]] == [3, 6, 9, 10]  # the Trainer's evaluations, with its scores
    assert all("eval_loss" in v for v in summary["validation"])
    # the Trainer's own figures beside: its samples/s over the whole train() call, its FLOPs of 6 N x positions
    trainer = record["notes"]["trainer_metrics"]
    assert trainer["train_samples_per_second"] > 0 and trainer["total_flos"] > 0
    assert "stage        seconds" in result.stdout


def test_a_lora_trainer_counts_the_flops_of_what_trains(tmp_path):
    record, truth, _ = trainer_run(tmp_path, "--lora")
    assert record["instrument"]["flops_basis"].startswith("formula: the model's layers as they train")
    # on the Llama's default attention, the fused CPU kernel (transformers 5.17's rotary embedding adds a matmul that
    # FlopCounterMode counts and the walk does not: within 0.001%)
    assert counted(record, "flops") == pytest.approx(truth["flops"], rel=FLOPS_TOLERANCE)
    assert record["environment"]["sdpa_kernels"]["training"] == "FLASH_ATTENTION"
    assert record["summary"]["model_flops"]["head"] == "an LM head on every position"
    # the Trainer's own total_flos counts every weight of the model (6 N), frozen ones included
    assert record["notes"]["trainer_metrics"]["total_flos"] > counted(record, "flops")


def test_a_trainer_that_fails_leaves_a_failed_record_with_its_error(tmp_path):
    """The Trainer's own exception ends the run: the record says failed, with the error's line and the step reached
    (the exception goes on to the script, as the Trainer raised it)."""
    with pytest.raises(ValueError, match="a planted fault"):
        run_in_process(
            ["--output-dir", str(tmp_path / "runs"), "--truth", str(tmp_path / "truth"), "--epochs", "1",
             "--fail-at", "5"],
            main=hf_trainer.main,
        )  # fmt: skip
    record = read_record(tmp_path / "runs" / "hf_trainer")
    assert record["status"] == "failed" and record["error"] == "a planted fault in training batch 5"
    # Accelerate's loader collates one batch ahead: the fifth while the second window's are fetched, after step 1
    assert record["failed_at_step"] == 1


def test_a_trainer_on_two_ddp_ranks_has_the_communication_block(tmp_path, capfd):
    args = ["--output-dir", str(tmp_path / "runs"), "--truth", str(tmp_path / "truth"), "--epochs", "1"]
    assert run_in_forked_ranks(args, main=hf_trainer.main) == 0, capfd.readouterr().err[-3000:]
    record = read_record(tmp_path / "runs" / "hf_trainer")
    truths = [json.loads((tmp_path / f"truth.{rank}").read_text()) for rank in (0, 1)]
    summary = record["summary"]
    assert summary["world_size"] == 2 and summary["optimizer_steps"] == truths[0]["optimizer_steps"]
    assert counted(record, "samples") == sum(t["samples"] for t in truths)
    assert summary["communication"] is not None and summary["communication"].get("per_rank")


def test_the_callback_drives_the_run_through_the_public_api_and_walks_no_stack():
    """trainer.py reaches trainscope.Run, the Trainer and its Accelerator by their public names only: no `_`
    attribute of any object but the callback's own (the dunder protocols of a context manager aside), no private
    keyword, no stack walk to find its Trainer (it is given it)."""
    tree = ast.parse((ROOT / "trainscope" / "trainer.py").read_text())
    private = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not (node.attr.startswith("__") and node.attr.endswith("__"))
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    ]
    assert private == []
    keywords = [k.arg for node in ast.walk(tree) if isinstance(node, ast.Call) for k in node.keywords if k.arg]
    assert not [k for k in keywords if k.startswith("_")]
    modules = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert not {"inspect", "sys", "traceback"} & modules
    assert not {"stack", "currentframe", "_getframe", "f_back", "f_locals"} & names


def test_a_callback_without_its_trainer_says_how_in_one_line():
    import trainscope

    with pytest.raises(trainscope.UserError, match=r"trainer.add_callback\(trainscope.TrainscopeCallback\(trainer\)\)"):
        trainscope.TrainscopeCallback()
