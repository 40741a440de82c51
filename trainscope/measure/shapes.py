"""A model's shape read from its config: a BERT-like encoder's (layers, hidden, intermediate), a decoder-only causal
LM's layout, and the shape facts a run record keeps. No torch: the FLOPs count (trainscope.measure.flops) reads it."""

import dataclasses


def encoder_shape(config) -> tuple[int, int, int] | None:
    """(layers, hidden, intermediate) of a BERT-like config, or None when it is not one (a decoder-only causal LM's
    config has the same attribute names, but not the encoder's layout: `is_decoder_config`, `decoder_shape`)."""
    if is_decoder_config(config):
        return None
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layers", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "dim", None)
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", None)
    if not (layers and hidden and intermediate):
        return None
    return int(layers), int(hidden), int(intermediate)


# Decoder-only causal LMs, by config.model_type: the MLP's matrices (2: up and down; 3: gated, gate, up and down) and
# the config attribute of the MLP's width (None: GPT-2 and GPT-J's n_inner, 4 x hidden where unset).
DECODER_LAYOUTS = {
    "gpt2": (2, "n_inner"),
    "gptj": (2, "n_inner"),
    "gpt_neox": (2, "intermediate_size"),
    "opt": (2, "ffn_dim"),
    "phi": (2, "intermediate_size"),
    "llama": (3, "intermediate_size"),
    "mistral": (3, "intermediate_size"),
    "qwen2": (3, "intermediate_size"),
    "qwen3": (3, "intermediate_size"),
    "gemma": (3, "intermediate_size"),
    "gemma2": (3, "intermediate_size"),
    "phi3": (3, "intermediate_size"),
}
# Decoders whose layout is not modelled here (mixtures of experts, parallel or other blocks): no decoder shape, and
# not mistaken for an encoder although their configs name num_hidden_layers, hidden_size and intermediate_size.
OTHER_DECODERS = {"mixtral", "qwen2_moe", "qwen3_moe", "olmo", "olmo2", "starcoder2", "stablelm", "cohere", "falcon"}
# Architectures (config.architectures) with a hidden x vocab LM head on every position.
LM_HEAD_SUFFIXES = ("ForCausalLM", "LMHeadModel", "DoubleHeadsModel")


def is_decoder_config(config) -> bool:
    """A decoder-only causal LM's config (by its model_type), or any config marked is_decoder."""
    model_type = getattr(config, "model_type", None)
    return model_type in DECODER_LAYOUTS or model_type in OTHER_DECODERS or bool(getattr(config, "is_decoder", False))


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """The matmul shapes of a decoder-only causal LM (per layer: the query, key and value projections' output widths,
    grouped-query attention's key and value narrower, the output projection query x hidden, the MLP's matrices)."""

    layers: int
    hidden: int
    query: int  # heads x head dimension
    key: int  # key-value heads x head dimension
    value: int
    mlp_matrices: int  # 2 (up, down) or 3 (gated: gate, up, down)
    intermediate: int
    vocab: int
    lm_head: bool  # a hidden x vocab head on every position (False: config.architectures names none, e.g. ...Model)

    def matmul_weights(self) -> int:
        """Weights of the matrix multiplications: the layers' and the LM head's (no embeddings, norms or biases)."""
        attention = self.hidden * (self.query + self.key + self.value) + self.query * self.hidden
        mlp = self.mlp_matrices * self.hidden * self.intermediate
        return self.layers * (attention + mlp) + (self.hidden * self.vocab if self.lm_head else 0)


def decoder_shape(config) -> DecoderShape | None:
    """The shape of a decoder-only causal LM's config (`DECODER_LAYOUTS`), or None when it is not one modelled here
    (an encoder, a mixture of experts, OPT with a word_embed_proj_dim other than its hidden size)."""
    layout = DECODER_LAYOUTS.get(getattr(config, "model_type", None))
    if layout is None:
        return None
    mlp_matrices, width_name = layout
    layers, hidden = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    heads, vocab = getattr(config, "num_attention_heads", None), getattr(config, "vocab_size", None)
    if not (layers and hidden and heads and vocab):
        return None
    if getattr(config, "word_embed_proj_dim", None) not in (None, hidden):
        return None  # OPT-350m's project_in and project_out around the stack, and its head on the projected width
    intermediate = getattr(config, width_name, None) or (4 * hidden if width_name == "n_inner" else None)
    if not intermediate:
        return None
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    architectures = getattr(config, "architectures", None) or []
    lm_head = not architectures or any(name.endswith(LM_HEAD_SUFFIXES) for name in architectures)
    return DecoderShape(
        layers=int(layers),
        hidden=int(hidden),
        query=int(heads * head_dim),
        key=int(kv_heads * head_dim),
        value=int(kv_heads * head_dim),
        mlp_matrices=mlp_matrices,
        intermediate=int(intermediate),
        vocab=int(vocab),
        lm_head=lm_head,
    )


def shape_facts(config) -> dict | None:
    """The encoder's shape for the run record ({layers, hidden, intermediate}), or None."""
    shape = encoder_shape(config)
    return dict(zip(("layers", "hidden", "intermediate"), shape)) if shape else None
