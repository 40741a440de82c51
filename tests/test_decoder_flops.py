"""Model FLOPs of decoder-only causal LMs (GPT-2, Llama) against torch's FlopCounterMode on a real training step."""

import pytest
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from trainscope.measure import attention, flops, shapes

BATCH = 2


def gpt2_config():
    return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=256)


def llama_config():
    return transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=172,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=256,
    )


MODELS = {
    "gpt2": (gpt2_config, transformers.GPT2LMHeadModel),
    "llama": (llama_config, transformers.LlamaForCausalLM),
}


def counted_step(name, attention, length, backend=SDPBackend.MATH, **counter):
    """FlopCounterMode's total for one training step (forward with labels, loss.backward()) of `name`'s tiny model
    with `attention` ("eager" or "sdpa"), BATCH x `length` tokens; SDPA restricted to `backend`; `counter`:
    FlopCounterMode's keywords."""
    make_config, model_class = MODELS[name]
    config = make_config()
    torch.manual_seed(0)
    model = model_class._from_config(config, attn_implementation=attention)
    model.train()
    assert model.config._attn_implementation == attention
    input_ids = torch.randint(0, config.vocab_size, (BATCH, length))
    with sdpa_kernel(backend), FlopCounterMode(display=False, **counter) as counter:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    return counter.get_total_flops(), config


@pytest.mark.parametrize("length", [32, 128])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_causal_lm_flops_agree_with_torchs_flop_counter(name, attention, length):
    """The formula (6 x matmul weights incl. the LM head x tokens + 12 L Q T per token, the full attention square)
    equals the counted step: both count the same matmuls, in integers. SDPA runs on its math backend, whose matmuls
    the counter counts: on a CPU the default fused kernel (_scaled_dot_product_flash_attention_for_cpu) has no FLOP
    formula in FlopCounterMode (test_cpu_fused_sdpa_attention_is_not_counted)."""
    counted, config = counted_step(name, attention, length)
    assert flops.causal_lm_training_flops(config, BATCH, length) == counted


def test_cpu_fused_sdpa_attention_is_not_counted_by_torch_and_is_by_trainscope():
    """Llama's SDPA without dropout on a CPU takes the fused flash kernel, which FlopCounterMode alone does not count
    (torch 2.11 to 2.13: no formula for `_scaled_dot_product_flash_attention_for_cpu` or its backward): the count is
    the math backend's count (the formula's) less its whole attention term. With trainscope's formulas for the fused
    kernels (the forward's two matmuls by torch's own formula, twice it backward, as math runs them) it is math's
    exactly. In `make test-oldest` too (torch 2.11, whose formula has no grouped-query attention)."""
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    counted, config = counted_step("llama", "sdpa", 64, backend=fused)
    math, _ = counted_step("llama", "sdpa", 64)  # the formula's count (test_causal_lm_flops_agree_with_torchs_...)
    _, b = flops.causal_lm_flops_coefficients(config)
    assert counted == math - b * BATCH * 64**2
    assert counted_step("llama", "sdpa", 64, backend=fused, custom_mapping=attention.flop_formulas())[0] == math


def test_decoder_shapes_with_grouped_query_attention_and_gated_mlp():
    gpt2 = shapes.decoder_shape(gpt2_config())
    assert gpt2 == shapes.DecoderShape(
        layers=2, hidden=64, query=64, key=64, value=64, mlp_matrices=2, intermediate=256, vocab=1000, lm_head=True
    )
    llama = shapes.decoder_shape(llama_config())
    assert llama == shapes.DecoderShape(
        layers=2, hidden=64, query=64, key=32, value=32, mlp_matrices=3, intermediate=172, vocab=1000, lm_head=True
    )
    # per layer: q, k, v, o 64 x (64 + 32 + 32) + 64 x 64; gate, up, down 3 x 64 x 172; the head 64 x 1000
    assert llama.matmul_weights() == 2 * (64 * 128 + 64 * 64 + 3 * 64 * 172) + 64 * 1000
    assert gpt2.matmul_weights() == 2 * (4 * 64 * 64 + 2 * 64 * 256) + 64 * 1000
    assert shapes.decoder_shape(transformers.GPT2Config(n_embd=64, n_head=4, n_inner=100)).intermediate == 100
    assert not shapes.decoder_shape(transformers.LlamaConfig(architectures=["LlamaModel"])).lm_head
    assert shapes.decoder_shape(transformers.BertConfig()) is None


def test_coefficients_sum_over_variable_length_batches():
    config = llama_config()
    a, b = flops.causal_lm_flops_coefficients(config)
    assert a == 6 * shapes.decoder_shape(config).matmul_weights() and b == 12 * 2 * 64
    batches = [(2, 32), (3, 100), (1, 7)]
    total = sum(flops.causal_lm_training_flops(config, n, t) for n, t in batches)
    assert total == a * sum(n * t for n, t in batches) + b * sum(n * t * t for n, t in batches)
    assert flops.causal_lm_flops_coefficients(transformers.BertConfig()) is None
    assert flops.causal_lm_training_flops(transformers.BertConfig(), 2, 32) is None


def test_decoders_are_not_encoders_and_encoders_unchanged():
    assert shapes.encoder_shape(gpt2_config()) is None
    assert shapes.encoder_shape(llama_config()) is None
    assert shapes.encoder_shape(transformers.MistralConfig()) is None
    bert = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128)
    assert shapes.encoder_shape(bert) == (2, 64, 128)
    assert flops.training_flops(bert, 2, 32) == 2 * 32 * flops.training_flops_per_token(2, 64, 128, 32)
    assert shapes.encoder_shape(transformers.DistilBertConfig(n_layers=3, dim=64, hidden_dim=128)) == (3, 64, 128)
    assert shapes.encoder_shape(transformers.BertConfig(is_decoder=True)) is None


# ---------------------------------------------------------------- the model as it trains (trainscope.measure.trained_flops)


def frozen_but_last_layer(model):
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    for parameter in layers[-1].parameters():
        parameter.requires_grad_(True)
    return model


def with_lora(targets, task="CAUSAL_LM"):
    import peft

    return lambda model: peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, task_type=task))


WALKED = {  # model class, what trains, the labels its loss takes
    "llama, LoRA q and v": (transformers.LlamaForCausalLM, llama_config, with_lora(["q_proj", "v_proj"]), "lm"),
    "llama, the last layer only": (transformers.LlamaForCausalLM, llama_config, frozen_but_last_layer, "lm"),
    "gpt2, LoRA on c_attn": (transformers.GPT2LMHeadModel, gpt2_config, with_lora(["c_attn"]), "lm"),
    "gpt2 sequence classifier": (transformers.GPT2ForSequenceClassification, gpt2_config, lambda m: m, "class"),
    "llama sequence classifier, LoRA": (
        transformers.LlamaForSequenceClassification,
        llama_config,
        with_lora(["q_proj", "v_proj"], "SEQ_CLS"),
        "class",
    ),
}


@pytest.mark.parametrize("case", list(WALKED))
def test_the_walked_flops_of_the_model_as_it_trains_equal_the_counted_step(case):
    """What trains (LoRA's adapters, frozen layers below the one that trains) and the head the built model has (an LM
    head, a classifier on every position; GPT-2's LM head counted from config.architectures made a sequence classifier
    3.78x FlopCounterMode's), at two lengths: the walk equals FlopCounterMode's count of one training step exactly.
    Counted as trained: 1.51x for a LoRA Llama and 1.50x with only its last layer training."""
    from trainscope.measure.trained_flops import walk

    model_class, make_config, training, labels = WALKED[case]
    config = make_config()
    config.pad_token_id = 0
    torch.manual_seed(0)
    model = training(model_class._from_config(config, attn_implementation="eager"))
    model.train()
    walked = walk(model, model.config)
    for length in (16, 96):
        ids = torch.randint(1, config.vocab_size, (BATCH, length))
        target = ids if labels == "lm" else torch.zeros(BATCH, dtype=torch.long)
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids, labels=target).loss.backward()
        model.zero_grad(set_to_none=True)
        assert walked.micro_batch(BATCH, length) == counter.get_total_flops()
