import json

import pytest
from transformers import AutoConfig

from conftest import TINY, assert_ok, launch, read_record, read_steps
from trainscope import embedded, flops


def test_flops_per_token_by_hand_for_bert_base_and_minilm():
    # BERT-base: N = 12 (4*768^2 + 2*768*3072) = 84,934,656; 6N = 509,607,936; 12*L*d*T = 14,155,776 at T=128
    assert flops.matmul_parameters(12, 768, 3072) == 84_934_656
    assert flops.training_flops_per_token(12, 768, 3072, 128) == 509_607_936 + 14_155_776
    # MiniLM-L6 (H384): N = 6 (4*384^2 + 2*384*1536) = 10,616,832; 6N = 63,700,992; 12*6*384*128 = 3,538,944
    assert flops.training_flops_per_token(6, 384, 1536, 128) == 63_700_992 + 3_538_944


def test_flops_read_the_model_configuration():
    minilm = AutoConfig.from_pretrained(embedded.minilm_dir())
    assert flops.encoder_shape(minilm) == (6, 384, 1536)
    assert flops.training_flops(minilm, batch_size=32, sequence_length=128) == 32 * 128 * 67_239_936
    distilbert = AutoConfig.for_model(**{k: v for k, v in embedded.bundled_architecture(
        "distilbert-base-uncased").items()})
    assert flops.encoder_shape(distilbert) == (6, 768, 3072)


def test_peak_table_and_mfu():
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert flops.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3", "tf32") == 495.0
    assert flops.peak_tflops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5
    assert flops.mfu(494.5, "NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(0.5)
    # unknown device or precision: no MFU rather than a guess
    assert flops.mfu(1.0, "AMD EPYC 7B13", "fp32") is None
    assert flops.mfu(1.0, "Tesla V100-SXM2-16GB", "bf16") is None


def test_profile_writes_a_trace_with_the_stage_labels(runs):
    result = launch("train.py", [*TINY, "--output-dir", str(runs), "--run-name", "prof", "--profile",
                                 "--profile-wait", "1", "--profile-warmup", "1", "--profile-active", "2"],
                    launcher="python")
    assert_ok(result)
    traces = list((runs / "prof" / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert {"data", "forward", "backward", "optimizer"} <= names
    profile = read_record(runs / "prof")["summary"]["profile"]
    assert profile["top_operators"] and all(op["self_cpu_s"] >= 0 for op in profile["top_operators"])
    assert not {"forward", "backward"} & {op["name"] for op in profile["top_operators"]}
    assert "top operators by self time" in result.stdout


def test_records_carry_flops_and_say_mfu_is_unknown_on_this_cpu(runs):
    assert_ok(launch("train.py", [*TINY, "--output-dir", str(runs), "--run-name", "flops"], launcher="python"))
    summary = read_record(runs / "flops")["summary"]
    counts = summary["timing"]["per_rank"][0]["counts"]
    assert counts["steady"]["flops"] > 0
    assert summary["throughput"]["tflops_per_device"] > 0
    assert summary["mfu"] is None
    assert all(line["tflops_per_device"] > 0 for line in read_steps(runs / "flops"))
