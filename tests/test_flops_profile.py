import json
import pickle
import time

import pytest
from conftest import ONE_THREAD, TINY, assert_ok, read_record, read_steps, run_in_process
from transformers import AutoConfig

from trainscope.measure import flops, shapes
from trainscope.measure.profiling import MemorySnapshot
from trainscope.workload import embedded


def test_flops_per_token_by_hand_for_bert_base_and_minilm():
    # BERT-base: N = 12 (4*768^2 + 2*768*3072) = 84,934,656; 6N = 509,607,936; 12*L*d*T = 14,155,776 at T=128
    assert flops.matmul_parameters(12, 768, 3072) == 84_934_656
    assert flops.training_flops_per_token(12, 768, 3072, 128) == 509_607_936 + 14_155_776
    # MiniLM-L6 (H384): N = 6 (4*384^2 + 2*384*1536) = 10,616,832; 6N = 63,700,992; 12*6*384*128 = 3,538,944
    assert flops.training_flops_per_token(6, 384, 1536, 128) == 63_700_992 + 3_538_944


def test_flops_read_the_model_configuration():
    minilm = AutoConfig.from_pretrained(embedded.minilm_dir())
    assert shapes.encoder_shape(minilm) == (6, 384, 1536)
    assert flops.training_flops(minilm, batch_size=32, sequence_length=128) == 32 * 128 * 67_239_936
    distilbert = AutoConfig.for_model(**embedded.bundled_architecture("distilbert-base-uncased"))
    assert shapes.encoder_shape(distilbert) == (6, 768, 3072)


def counted_step(flags, batch=8, length=64, layers=None):
    """torch.utils.flop_counter.FlopCounterMode's count of one training step (forward, loss, backward) of the model
    `flags` build (its first `layers` encoder layers where given), on fake tensors of (batch x length), and the model
    (its parameters fake)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from trainscope.predict import trace
    from trainscope.workload import modeling
    from trainscope.workload.modeling import classification_loss
    from trainscope.workload.settings import parse_settings

    (settings,) = parse_settings(argv=flags)
    config = modeling.model_config(settings, ["a", "b", "c"])
    if layers:
        config.num_hidden_layers = layers  # DistilBERT's n_layers through its attribute map
    with torch.device("meta"):
        model = modeling.build_architecture(settings, ["a", "b", "c"], config=config)
    fake_mode = FakeTensorMode()
    trace._fake_parameters(model, fake_mode, torch.device("cpu"))
    model.train()  # attention dropout in training: SDPA's math path, whose matmuls the counter counts
    with fake_mode:
        inputs = {
            name: torch.zeros(batch, length, dtype=torch.long)
            for name in ("input_ids", "attention_mask", "token_type_ids")
        }
        with FlopCounterMode(display=False) as counter:
            logits = model(**inputs).logits
            classification_loss(logits, torch.zeros(batch, dtype=torch.long)).backward()
    return counter.get_total_flops(), config, model, settings


def head_flops_at_most(config, batch, labels=3):
    """The classification head's matmuls, which the model FLOPs leave out (they count the encoder's): a d x d layer
    (BERT's pooler, RoBERTa's dense, DistilBERT's pre_classifier) and a d x labels one on each sequence's first
    position, forward 2 x weights x batch and at most twice that backward."""
    hidden = shapes.encoder_shape(config)[1]
    return 6 * batch * (hidden * hidden + hidden * labels)


ROBERTA = ["--model", "roberta-base", "--architecture-only", "--tokenizer", "embedded:minilm-l6"]


@pytest.mark.parametrize(
    "batch,length,layers",
    [(8, 64, None), (2, 512, 2)],
    ids=["8x64", "2x512-2-layers"],
)
@pytest.mark.parametrize(
    "flags",
    [
        ["--model", "embedded:minilm-l6"],
        ["--model", "embedded:minilm-l6", "--lora"],
        ["--model", "embedded:minilm-l6", "--gradient-checkpointing"],
        ["--model", "embedded:minilm-l6", "--lora", "--gradient-checkpointing"],
        [*ROBERTA, "--lora"],
        ["--model", "distilbert-base-uncased", "--architecture-only", "--lora"],
    ],
    ids=["minilm", "minilm-lora", "minilm-ckpt", "minilm-lora-ckpt", "roberta-lora", "distilbert-lora"],
)
def test_model_flops_agree_with_torchs_flop_counter_for_full_fine_tuning_lora_and_checkpointing(
    flags, batch, length, layers
):
    """The second instrument: FlopCounterMode counts what the step's matmuls execute (on fake tensors: no arithmetic
    runs). Compared: the model FLOPs trainscope records for the step (`training_flops`, what trains read by
    `training_of`) plus the recomputation it records apart (`recomputed_flops`), against the counter's total. The
    tolerance, fixed before measuring: 1%, the agreement docs/peak.md states. The counter also counts the
    classification head, which the formula leaves out (it counts the encoder's matmuls), so the formula lies between
    the count less the head's matmuls and the count: the bracket that says the 1% is the head's, not a miscount.

    Two shapes: 8 sequences of 64, the model's every layer; and 2 of 512, the long sequence where attention's T^2
    terms weigh most, on the model's first two layers, so that what autograd skips in the first layer where nothing
    below it trains (LoRA: the projections' input gradients and the keys' attention gradient, 2 d T per token) is
    in one layer of two, not of six or twelve: a miscount of it shows at 1% (counting the keys' gradient was +2.3%
    for MiniLM with LoRA there, +0.72% on all six layers). The recomputation of a checkpointed step is a
    forward (not model FLOPs, as PaLM's MFU); LoRA's frozen weights have no weight gradients."""
    counted, config, model, settings = counted_step(flags, batch, length, layers)
    training = flops.training_of(model, settings.gradient_checkpointing)
    model_flops = flops.training_flops(config, batch, length, training)
    recomputed = flops.recomputed_flops(config, batch * length, batch * length * length, training)
    assert (model_flops + recomputed) == pytest.approx(counted, rel=0.01)
    assert counted - head_flops_at_most(config, batch) <= model_flops + recomputed <= counted
    assert (recomputed > 0) == settings.gradient_checkpointing
    if settings.gradient_checkpointing:
        forward = flops.training_flops(config, batch, length, flops.FULL) / 3
        assert recomputed == pytest.approx(forward, rel=0.02)
    if settings.lora:
        assert training.trained_share == 0 and training.adapter_weights > 0
        assert model_flops < 0.75 * flops.training_flops(config, batch, length)  # 6N was the full fine-tuning's


@pytest.mark.parametrize("flags", [[], ["--lora"]], ids=["full", "lora"])
def test_padding_free_flops_agree_with_torchs_flop_counter_on_a_padded_batch(flags):
    """--unpad (trainscope.workload.unpad) built as train.py builds it (modeling.build_model), one training step on a batch of
    4 sequences of 128, 80, 33 and 12 real tokens padded to 128, counted by FlopCounterMode on real tensors (the
    layers' index of the real tokens has a data-dependent shape). Compared: the FLOPs train.py records for the step
    with --unpad (`padding_free_training_flops`: the token-wise matmuls on the real tokens, attention on the padded
    layout), within 1% (fixed before measuring), and between the count less the classification head's matmuls and
    the count. Neither the padded step's FLOPs nor those on real tokens alone (attention on each sequence's own
    length) are within 1% of the count: the batch's padding is large enough to tell them apart."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from trainscope.workload import modeling
    from trainscope.workload.modeling import classification_loss
    from trainscope.workload.settings import parse_settings

    (settings,) = parse_settings(argv=["--model", "embedded:minilm-l6", "--unpad", *flags])
    lengths, threads = [128, 80, 33, 12], torch.get_num_threads()
    batch, length, tokens = len(lengths), max(lengths), sum(lengths)
    torch.set_num_threads(1)  # the test workers share two cores
    try:
        torch.manual_seed(0)
        model, facts = modeling.build_model(settings, ["a", "b", "c"], modeling.build_tokenizer(settings))
        assert facts["unpad"]["layers"] == 6
        model.train()  # attention dropout: the math path's (or trainscope's drawn) matmuls, which the counter counts
        mask = (torch.arange(length) < torch.tensor(lengths)[:, None]).long()
        with FlopCounterMode(display=False) as counter:
            logits = model(input_ids=mask * 1000, attention_mask=mask, token_type_ids=0 * mask).logits
            classification_loss(logits, torch.zeros(batch, dtype=torch.long)).backward()
    finally:
        torch.set_num_threads(threads)
    counted, config = counter.get_total_flops(), model.config
    training = flops.training_of(model, settings.gradient_checkpointing)
    padding_free = flops.padding_free_training_flops(config, batch, length, tokens, training)
    assert padding_free == pytest.approx(counted, rel=0.01)
    assert counted - head_flops_at_most(config, batch) <= padding_free <= counted
    padded = flops.training_flops(config, batch, length, training)
    real = flops.real_training_flops(shapes.encoder_shape(config), tokens, sum(n * n for n in lengths), training)
    assert padded != pytest.approx(counted, rel=0.01) and real != pytest.approx(counted, rel=0.01)


def test_a_lora_checkpointed_run_records_its_model_flops_and_what_the_hardware_executed(runs):
    result = run_in_process(
        [
            *TINY,
            *ONE_THREAD,
            "--output-dir",
            str(runs),
            "--run-name",
            "lora",
            "--max-steps",
            "4",
            "--lora",
            "--gradient-checkpointing",
        ]
    )
    assert_ok(result)
    from trainscope.core.record_view import RunView

    summary = read_record(runs / "lora")["summary"]
    counted = RunView({"summary": summary}).model_flops
    assert counted["trained_share"] == 0 and counted["adapter_weights"] > 0 and counted["recomputed"]
    training = flops.Training(counted["trained_share"], counted["adapter_weights"], counted["input_gradient"], True)
    shape = summary["timing"]["per_rank"][0]["counts"]["steady"]
    # the layers walked as they train (trainscope.measure.trained_flops) give the encoder formula's coefficients,
    # derived apart from them; the head adds its work once per sequence
    a, b = flops.flops_coefficients(2, 32, 64, training)["model"]  # embedded:tiny-bert
    assert (counted["per_token"], counted["per_square"]) == (a, b) and counted["per_sample"] > 0
    head = counted["per_sample"] * shape["samples"]
    assert shape["flops"] == a * shape["padded_tokens"] + b * shape["padded_squares"] + head
    full = flops.flops_coefficients(2, 32, 64)["model"]
    assert shape["flops"] < full[0] * shape["padded_tokens"] + full[1] * shape["padded_squares"]
    measured = summary["measured_peak"]
    assert counted["recomputed_tflops_per_device"] > 0
    assert measured["executed_tflops"] == pytest.approx(
        measured["achieved_tflops"] + counted["recomputed_tflops_per_device"]
    )


@pytest.mark.parametrize(
    "name,precision,peak",
    [
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA L40", "bf16", 181.05),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L40S", "tf32", 183.0),
        ("NVIDIA L40S", "fp16", 362.05),
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA A10G", "bf16", None),
        ("NVIDIA A100-PCIE-40GB", "bf16", 312.0),
        ("NVIDIA A100 80GB PCIe", "tf32", 156.0),
        ("NVIDIA A100-SXM4-40GB", "fp32", 19.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 NVL", "bf16", 835.5),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA B200", "tf32", 1125.0),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("Tesla V100-SXM2-16GB", "bf16", None),
        ("Tesla V100-SXM2-32GB", "fp16", 125.0),
        ("Tesla V100-SXM2-16GB", "fp32", 15.7),
        ("Tesla V100-PCIE-16GB", "fp16", 112.0),
        ("Tesla V100-PCIE-32GB", "fp32", 14.0),
        ("Tesla V100-FHHL-16GB", "fp16", None),  # the 150 W card: no figure in the table, so no MFU
        ("AMD EPYC 7B13", "fp32", None),
        # another part than the full card: a MIG slice, a laptop part, a D variant (no peak known for them here)
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16", None),
        ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "tf32", None),
        ("NVIDIA GeForce RTX 4090 Laptop GPU", "bf16", None),
        ("NVIDIA GeForce RTX 4090 D", "bf16", None),
    ],
)
def test_peaks_come_from_an_exact_table_never_a_substring(name, precision, peak):
    assert flops.peak_tflops(name, precision) == peak


@pytest.mark.parametrize(
    "name,why",
    [
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "MIG slice"),
        ("NVIDIA GeForce RTX 4090 Laptop GPU", "laptop part"),
        ("NVIDIA GeForce RTX 4090 D", "D variant"),
    ],
)
def test_a_variant_without_a_peak_says_why_in_its_warning(name, why):
    from trainscope.measure import health

    record = {
        "settings": {},
        "environment": {"device": "cuda:0", "device_name": name, "effective_precision": "bf16"},
        "summary": {"mfu": None},
    }
    (warning,) = health.check(record)
    assert warning["code"] == "mfu_unknown" and why in warning["message"] and "not computed" in warning["message"]
    assert flops.variant_reason("NVIDIA H100 80GB HBM3") is None and flops.variant_reason("AMD EPYC 7B13") is None


def test_mfu_is_none_rather_than_a_guess():
    assert flops.mfu(494.75, "NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(0.5)
    assert flops.mfu(1.0, "AMD EPYC 7B13", "fp32") is None
    assert flops.mfu(None, "NVIDIA H100 80GB HBM3", "bf16") is None


def test_profile_writes_a_trace_with_the_stage_labels_and_says_which_steps(runs):
    result = run_in_process(
        [
            *TINY,
            *ONE_THREAD,
            "--output-dir",
            str(runs),
            "--run-name",
            "prof",
            "--profile",
            "--profile-wait",
            "1",
            "--profile-warmup",
            "1",
            "--profile-active",
            "2",
        ]
    )
    assert_ok(result)
    traces = list((runs / "prof" / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1
    names = {event.get("name") for event in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"data", "forward", "backward", "optimizer"} <= names
    record = read_record(runs / "prof")
    profile = record["summary"]["profile"]
    assert profile["window"] == {"first_step": 3, "last_step": 4}
    assert profile["top_operators"] and not {"forward", "backward"} & {op["name"] for op in profile["top_operators"]}
    assert "profiler_on" in [w["code"] for w in record["warnings"]]
    assert "top operators by self time" in result.stdout
    # every operator's self time in one gap category: they add up to the traced steps, the matmuls' FLOPs counted
    breakdown = profile["breakdown"]
    assert sum(breakdown["categories"].values()) == pytest.approx(breakdown["window_s"], rel=1e-6)
    assert breakdown["matmul_flops"] > 0 and breakdown["categories"]["matmul"] > 0
    assert breakdown["categories"]["optimizer"] > 0 and breakdown["categories"]["layer norm"] > 0


def test_records_carry_flops_and_their_share_of_the_machines_measured_peak_not_a_datasheet_mfu(runs):
    result = run_in_process([*TINY, *ONE_THREAD, "--output-dir", str(runs), "--run-name", "flops", "--max-steps", "4"])
    assert_ok(result)
    record = read_record(runs / "flops")
    summary, environment = record["summary"], record["environment"]
    assert summary["timing"]["per_rank"][0]["counts"]["steady"]["flops"] > 0
    assert summary["throughput"]["tflops_per_device"] > 0 and summary["mfu"] is None  # no datasheet for a CPU
    assert all(line["tflops_per_device"] > 0 for line in read_steps(runs / "flops"))
    # the machine's own measured peak: every precision the CPU runs, at the model's shapes and the square, 1 thread
    machine = environment["machine_peak"]
    assert {"fp32", "bf16"} <= set(machine["precisions"]) and machine["key"]["threads"] == 1
    fp32 = machine["precisions"]["fp32"]
    assert [r["shape"] for r in fp32["rates"]][-1] == [256, 256, 256]  # the tests' small square (conftest)
    sized = machine["sized_at"]  # the run's mean micro-batch and its mean padded length: Q/K/V/O's shape
    assert sized["batch"] == 16 and [r["shape"] for r in fp32["rates"]][0] == [16 * sized["length"], 32, 32]
    measured = summary["measured_peak"]
    assert measured["precision"] == "fp32" and measured["peak_tflops"] == fp32["peak_tflops"]
    assert measured["share"] == pytest.approx(summary["throughput"]["tflops_per_device"] / fp32["peak_tflops"])
    assert measured["gap_estimate"]["floor_share"] == pytest.approx(measured["share"])  # the same figure, two ways
    # the useful work beside it: the FLOPs on real tokens (each sequence's own length in the attention term), below
    # the padded count by no more than flops.padding_flops_share's bound from the token counts alone (Jensen)
    throughput = summary["throughput"]
    head = summary["model_flops"]["per_sample"] * throughput["samples"]  # the classifier's, once per sequence
    assert throughput["real_flops"] == head + flops.real_training_flops(
        (2, 32, 64), throughput["tokens"], throughput["squares"]
    )
    bound = flops.padding_flops_share(
        {"layers": 2, "hidden": 32, "intermediate": 64},
        throughput["tokens"],
        throughput["padded_tokens"],
        throughput["samples"],
        throughput["padded_squares"],
    )
    assert 0 < throughput["padding_flops_share"] <= bound
    assert throughput["real_tflops_per_device"] == pytest.approx(
        throughput["tflops_per_device"] * (1 - throughput["padding_flops_share"])
    )
    assert measured["real_share"] == pytest.approx(throughput["real_tflops_per_device"] / fp32["peak_tflops"])
    assert measured["gap_estimate"]["padding_floor_s"] == pytest.approx(
        measured["gap_estimate"]["floor_s"] * throughput["padding_flops_share"]
    )
    assert environment["cpu_bf16"]["speedup"] == pytest.approx(
        machine["precisions"]["bf16"]["peak_tflops"] / fp32["peak_tflops"]
    )
    shapes = measured["run_shapes"]  # the run's own shapes: batch x its mean padded length, and one layer there
    assert shapes["batch"] == 16 and shapes["length"] % 8 == 0 and shapes["tflops"] > 0
    assert shapes["layer"]["categories"]["matmul"] > 0 and shapes["layer"]["length"] == shapes["length"]
    line = next(line for line in result.stdout.splitlines() if "measured fp32 matmul peak" in line)
    from trainscope.run.table import percent  # three significant digits: 7.93%, 0.0183%

    assert (
        f"{percent(measured['share'])} of this machine's measured fp32 matmul peak, {percent(measured['real_share'])} "
        "on real tokens" in line
    )
    assert measured["key_id"] in line and "MFU" not in result.stdout


class FakeAllocator:
    """torch.cuda.memory's snapshot calls, recorded; taking the snapshot can be given a planted cost."""

    def __init__(self, take_s: float = 0.0):
        self.calls, self.take_s = [], take_s

    def _record_memory_history(self, **kwargs):
        self.calls.append(("stop" if kwargs.get("enabled", True) is None else "start"))
        self.options = self.options if kwargs.get("enabled", True) is None else kwargs

    def _snapshot(self):
        time.sleep(self.take_s)
        self.calls.append("take")
        return {"segments": [], "device_traces": [[{"action": "alloc"}]]}


def test_the_memory_snapshot_covers_a_window_after_warmup_and_is_written_after_the_loop(tmp_path):
    allocator, path = FakeAllocator(), tmp_path / "snap.pickle"
    snapshot = MemorySnapshot(path, after_step=2, steps=3, backend=allocator)
    for step in range(1, 11):
        snapshot.step_finished(step)
        if step == 2:
            assert allocator.calls == ["start"]
    assert allocator.calls == ["start", "take", "stop"] and not path.exists()  # nothing pickled inside the loop
    # C++ frames symbolized at _snapshot() take minutes: Python frames only
    assert allocator.options == {"max_entries": 100_000, "stacks": "python"}
    assert [step for step in range(1, 11) if snapshot.covers(step)] == [3, 4, 5]
    assert snapshot.finish(10) == {"first_step": 3, "last_step": 5, "path": str(path)}
    assert pickle.loads(path.read_bytes())["device_traces"] == [[{"action": "alloc"}]]


TAKE_S = 3.0


def test_the_snapshot_window_and_taking_the_snapshot_stay_out_of_the_steady_figures(runs, monkeypatch):
    """A planted TAKE_S to take the snapshot lands in the `snapshot` phase with the window's steps; steady
    throughput never sees it. (On CUDA the recording also slows the window's steps: make gpu-check runs it.)
    Steady figures that took the snapshot in would exceed TAKE_S: the steps are made tiny (4 samples of at most 32
    tokens) so that TAKE_S stands several times above the 7 steady steps' wall time on a loaded machine."""
    import trainscope.run.metrics as run_metrics

    monkeypatch.setattr(
        run_metrics,
        "build_memory_snapshot",
        lambda settings, run_dir, device, rank: MemorySnapshot(
            run_dir / "memory" / "snapshot_rank0.pickle", settings.timing_warmup_steps, 3, backend=FakeAllocator(TAKE_S)
        ),
    )
    assert_ok(
        run_in_process(
            [*TINY, *ONE_THREAD, "--per-device-batch-size", "4", "--max-seq-length", "32", "--max-steps", "12"]
            + ["--output-dir", str(runs), "--run-name", "snap"]
        )
    )
    summary = read_record(runs / "snap")["summary"]
    counts = summary["timing"]["per_rank"][0]["counts"]
    assert (
        counts["warmup"]["optimizer_steps"],
        counts["snapshot"]["optimizer_steps"],
        counts["steady"]["optimizer_steps"],
    ) == (2, 3, 7)
    across = summary["timing"]["across_ranks"]
    assert across["snapshot"]["wall_s"]["median"] >= TAKE_S > across["steady"]["wall_s"]["median"]
    assert summary["throughput"]["optimizer_steps"] == 7 and summary["memory_snapshot"]["first_step"] == 3
    assert (runs / "snap" / "memory" / "snapshot_rank0.pickle").exists()


def test_a_run_shorter_than_the_window_still_writes_what_it_recorded(tmp_path):
    allocator = FakeAllocator()
    snapshot = MemorySnapshot(tmp_path / "snap.pickle", after_step=0, steps=5, backend=allocator)
    for step in range(0, 3):
        snapshot.step_finished(step)
    assert snapshot.finish(2) == {"first_step": 1, "last_step": 2, "path": str(tmp_path / "snap.pickle")}
    assert allocator.calls == ["start", "take", "stop"] and (tmp_path / "snap.pickle").exists()
