"""Padding-free encoder layers (--unpad): the padded and the padding-free model trained side by side on the same
batches from the same seed, per-step losses compared; a planted inexact change (dropout drawn on the real tokens only)
caught by the same tolerance; unsupported models refused in one line.

The tolerance is make tune's for every exact change, in fp32 (trainscope.advice.changes.exact: 2^-18 relative, stated
there): the two models compute the same values and draw the same masks; only the order of floating-point sums may
differ (matmuls over the N real rows instead of B x T, the weight gradients' sums over the batch without the padding's
exact zeros). The planted change moves the first loss by about 1e-3 of itself, in fp32 and in bf16; in bf16 a rounding
tolerance (2^-8) would not see it, so exactness is judged in fp32 and bf16's attention is checked against the padded
model's kernel itself.
"""

import contextlib
import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F
import unpad_ddp_pair
from conftest import (
    ONE_THREAD,
    TINY,
    assert_ok,
    read_record,
    run_in_forked_ranks,
    run_in_process,
)
from unpad_ddp_pair import BATCH, LONGEST, STEPS, batches

from trainscope.advice import changes
from trainscope.core.errors import UserError
from trainscope.measure import flops, gap
from trainscope.workload import dropout_draws, modeling, unpad
from trainscope.workload.settings import parse_settings

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and the test workers share two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def settings_for(*args):
    (settings,) = parse_settings(argv=["--model", "embedded:tiny-bert", *args])
    return settings


def train_losses(model, data, settings, autocast=None) -> list[float]:
    """The training loop's own step (forward, fp32 cross-entropy, backward, AdamW) from one seed; the forward under
    autocast to `autocast` where given, as Accelerate's mixed precision runs it."""
    optimizer = modeling.build_optimizer(model, settings, torch.device("cpu"))
    torch.manual_seed(5)
    model.train()
    losses = []
    for batch in data:
        batch = dict(batch)
        labels = batch.pop("labels")
        with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
            logits = model(**batch).logits
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def side_by_side(*args, autocast=None):
    """(padded losses, padding-free losses, the padding-free model's record facts) of one build, trained twice."""
    tokenizer = modeling.build_tokenizer(settings_for())
    torch.manual_seed(0)
    padded, _ = modeling.build_model(settings_for(*args), ["a", "b", "c"], tokenizer)
    torch.manual_seed(0)
    free, facts = modeling.build_model(settings_for(*args, "--unpad"), ["a", "b", "c"], tokenizer)
    data = batches(padded.config.pad_token_id if hasattr(padded, "config") else 0)
    return (
        train_losses(padded, data, settings_for(), autocast),
        train_losses(free, data, settings_for(), autocast),
        facts,
    )


def assert_exact(padded, free):
    for step, (a, b) in enumerate(zip(padded, free), start=1):
        assert changes.exact(a, b), f"step {step}: padded {a!r}, padding-free {b!r}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_drawn_attention_is_the_padded_models_kernel_bit_for_bit(dtype):
    """Where the loop draws the attention's mask, the padding-free layer writes the attention out; in bf16 it must
    not lose precision the padded model's kernel keeps (sdpa's math path computes in fp32). From one seed, with
    dropout and a padding mask: the same output as sdpa's, bit for bit, so the same error against fp64 (the bf16
    attention written in bf16 steps had 1.5x sdpa's largest error here)."""
    if not dropout_draws.drawn_here(torch.float32, torch.device("cpu")):
        pytest.skip("torch draws the masks on this CPU: the layers call the model's own attention")
    torch.manual_seed(0)
    batch, heads, length, width, p = 4, 6, 64, 32, 0.1
    query, key, value = (torch.randn(batch, heads, length, width) for _ in range(3))
    mask = torch.zeros(batch, 1, 1, length)
    mask[1, ..., 50:] = mask[3, ..., 20:] = torch.finfo(torch.float32).min
    scale = width**-0.5
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        operands = [t.to(dtype) for t in (query, key, value)]
        torch.manual_seed(7)
        kernel = F.scaled_dot_product_attention(*operands, attn_mask=mask, dropout_p=p, scale=scale).transpose(1, 2)
        torch.manual_seed(7)
        drawn, _ = unpad._attention_drawn(*operands, mask, scale, p, "sdpa")
    assert drawn.dtype == kernel.dtype == dtype and torch.equal(drawn, kernel)
    torch.manual_seed(7)
    kept = dropout_draws.bernoulli((batch, heads, length, length), 1 - p, torch.float32, torch.device("cpu"))
    weights = F.softmax(query.double() @ key.double().transpose(-1, -2) * scale + mask.double(), -1)
    exact = (weights * kept.double() / (1 - p) @ value.double()).transpose(1, 2)
    assert (drawn.double() - exact).abs().max() <= (kernel.double() - exact).abs().max()


def test_a_wrong_draw_in_bf16_is_rejected_where_exactness_is_judged():
    """bf16's rounding hides a wrong draw (its losses within 2^-8 of the padded model's, step by step, as an exact
    change's may be): exactness is judged on the same pair in fp32, where the planted wrong draw is caught at the
    first step; the padding-free bf16 model itself trains as the padded one does, to bf16's rounding."""
    padded, free, _ = side_by_side(*DROPOUT, "--lora", autocast=torch.bfloat16)
    assert all(abs(a - b) <= 2.0**-8 * abs(a) for a, b in zip(padded, free))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(unpad.PaddedShapeDropout, "forward", lambda self, x: F.dropout(x, self.p, self.training))
        padded, wrong, _ = side_by_side(*DROPOUT, "--lora", autocast=torch.bfloat16)
        assert abs(padded[0] - wrong[0]) <= 2.0**-8 * abs(padded[0]) and padded != wrong
        padded, wrong, _ = side_by_side(*DROPOUT, "--lora")
    with pytest.raises(AssertionError, match="step 1"):
        assert_exact(padded, wrong)


@pytest.mark.parametrize(
    "variant",
    [[], ["--lora"], ["--gradient-checkpointing"], ["--attn-implementation", "eager"]],
    ids=["plain", "lora", "checkpointing", "eager-attention"],
)
def test_padding_free_layers_train_as_the_padded_model_does(variant):
    padded, free, facts = side_by_side(*DROPOUT, *variant)
    assert facts["unpad"]["layers"] == 2
    # hidden dropout twice per layer; LoRA's dropout on query and value
    assert facts["unpad"]["dropouts_drawn_padded"] == 2 * (4 if "--lora" in variant else 2)
    assert_exact(padded, free)
    assert len(set(padded)) == STEPS  # the model trains: the comparison is of losses that move


def test_the_layers_draw_their_masks_with_the_checked_loop_where_torch_draws_that_way(monkeypatch):
    """trainscope.workload.dropout_draws: each layer's attention mask (B, H, T, T) and its two hidden masks (B, T, width),
    drawn by the loop, and the run the padded model's (on an Intel CPU with MKL torch draws them: skipped)."""
    if not dropout_draws._load()["dtypes"]:
        pytest.skip("torch's bernoulli_ takes MKL's path on this CPU: the layers draw with it")
    shapes, fill = [], dropout_draws._fill
    monkeypatch.setattr(
        dropout_draws, "_fill", lambda library, shape, *rest: shapes.append(tuple(shape)) or fill(library, shape, *rest)
    )
    padded, free, _ = side_by_side(*DROPOUT)
    assert_exact(padded, free)
    heads = sum(1 for shape in shapes if len(shape) == 4)
    assert len(shapes) == STEPS * 2 * 3 and heads == STEPS * 2
    assert all(shape[0] == BATCH and shape[-1] == shape[-2] <= LONGEST for shape in shapes if len(shape) == 4)


def test_the_profilers_gap_table_files_the_padding_free_draw_under_dropout():
    """The loop's draw is no aten operator and the mask's multiply a generic one: inside the layer's span the gap
    table (trainscope.measure.gap) counts them as dropout, as it counts the padded model's aten::dropout."""
    layout = unpad.Layout()
    layout.set(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    dropout = unpad.PaddedShapeDropout(0.1, layout).train()
    real = torch.randn(1, 5, 256)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with torch.profiler.record_function("ProfilerStep#1"):
            for _ in range(3):
                dropout(real)
    found = gap.categorize(profile.events(), on_device=False)
    # every operator of the draw and of the mask's multiply is dropout's, counted by calls (their times are tens of
    # microseconds, too small to compare): left out are the scalar's conversion for the division (copies, as in the
    # padded model's aten::dropout) and the profiler's own step span
    assert found["categories"]["dropout"] > 0 and found["calls"]["other operators"] <= 1, found["calls"]


def test_dropout_drawn_on_real_tokens_only_is_caught(monkeypatch):
    """The planted inexact change: masks drawn for the real rows' shape, not the padded one."""
    monkeypatch.setattr(unpad.PaddedShapeDropout, "forward", lambda self, x: F.dropout(x, self.p, self.training))
    padded, free, _ = side_by_side(*DROPOUT)
    with pytest.raises(AssertionError, match="step 1"):
        assert_exact(padded, free)


def test_roberta_runs_padding_free():
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from trainscope.workload import embedded

    values = dict(embedded.bundled_architecture("roberta-base"))
    values.pop("model_type")
    values.update(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        vocab_size=1000,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    torch.manual_seed(0)
    padded = AutoModelForSequenceClassification.from_config(AutoConfig.for_model("roberta", num_labels=3, **values))
    free = copy.deepcopy(padded)
    unpad.apply(free)
    data = batches(padded.config.pad_token_id)
    assert_exact(train_losses(padded, data, settings_for()), train_losses(free, data, settings_for()))


def test_other_models_and_left_padding_are_refused_in_one_line():
    tokenizer = modeling.build_tokenizer(settings_for())
    with pytest.raises(UserError, match=r"^--unpad supports the BERT family \(bert, roberta.*not distilbert$"):
        modeling.build_model(
            settings_for("--model", "distilbert-base-uncased", "--architecture-only", "--unpad"), ["a", "b"], tokenizer
        )
    tokenizer.padding_side = "left"
    with pytest.raises(UserError, match="right padding"):
        modeling.build_model(settings_for("--unpad"), ["a", "b"], tokenizer)


def test_a_padding_free_run_counts_the_work_its_kernels_did(runs):
    """train.py --unpad: the record says so; its counted FLOPs are the real tokens' 6N plus attention on the padded
    layout, beside the FLOPs on real tokens; the layer probed at the run's shapes is the padding-free one."""
    result = run_in_process(
        [*TINY, *ONE_THREAD, *DROPOUT, "--unpad", "--max-steps", "4", "--output-dir", str(runs), "--run-name", "unpad"]
    )
    assert_ok(result)
    record = read_record(runs / "unpad")
    assert record["model"]["unpad"]["layers"] == 2 and record["settings"]["unpad"] is True
    throughput = record["summary"]["throughput"]
    weights, attention = 6 * flops.matmul_parameters(2, 32, 64), 12 * 2 * 32
    head = record["summary"]["model_flops"]["per_sample"] * throughput["samples"]  # the classifier's, per sequence
    assert throughput["flops"] == weights * throughput["tokens"] + attention * throughput["padded_squares"] + head
    assert throughput["real_flops"] == weights * throughput["tokens"] + attention * throughput["squares"] + head
    assert 0 < throughput["padding_flops_share"] < 1
    assert throughput["padding_flops_share"] == pytest.approx(1 - throughput["real_flops"] / throughput["flops"])
    shapes = record["summary"]["measured_peak"]["run_shapes"]
    mean_real = throughput["tokens"] / throughput["samples"]
    assert shapes["layer"]["unpad"] and shapes["length"] == -(-int(mean_real) // 8) * 8
    assert "on real tokens" in result.stdout


def pair_writing_where_told(args: list[str]) -> None:
    """tests/unpad_ddp_pair.py's main on a forked rank, writing where PAIR_OUT says."""
    unpad_ddp_pair.main(os.environ["PAIR_OUT"], args)


def test_two_processes_train_padding_free_as_padded(tmp_path):
    """DDP over gloo, 2 processes, the run's own builders and training step: per-step losses (the mean over both
    ranks) agree within the exactness tolerance."""
    out = tmp_path / "losses.json"
    args = ["--model", "embedded:tiny-bert", *DROPOUT]
    assert run_in_forked_ranks(args, main=pair_writing_where_told, PAIR_OUT=str(out)) == 0
    losses = json.loads(out.read_text())
    assert losses["world_size"] == 2 and len(losses["padded"]) == STEPS
    assert_exact(losses["padded"], losses["unpad"])
    assert len(set(losses["padded"])) == STEPS
