"""Model building: the remote-code gate, sequence limits, FSDP wrap rules, the learning-rate schedule."""

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from trainscope.core.errors import UserError
from trainscope.workload import embedded, modeling
from trainscope.workload.settings import parse_settings

CUSTOM_CONFIG = """
from pathlib import Path
from transformers import BertConfig
Path({marker!r}).write_text("ran")  # transformers runs a copy of this file from its module cache
class CustomConfig(BertConfig):
    model_type = "custom-bert"
"""


def settings_for(*args):
    (settings,) = parse_settings(argv=list(args))
    return settings


def custom_model_dir(tmp_path):
    """A model folder whose configuration is code of its own (auto_map), as hub repos with custom code have."""
    folder = tmp_path / "custom"
    folder.mkdir()
    values = embedded.bundled_architecture("tiny-bert")
    values.update(model_type="custom-bert", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (folder / "config.json").write_text(json.dumps(values))
    (folder / "configuration_custom.py").write_text(CUSTOM_CONFIG.format(marker=str(tmp_path / "marker")))
    return folder


def test_code_in_a_model_runs_only_with_trust_remote_code(tmp_path):
    folder = custom_model_dir(tmp_path)
    with pytest.raises(UserError, match="pass --trust-remote-code only if you trust it"):
        modeling.sequence_limit(settings_for("--model", str(folder)))
    assert not (tmp_path / "marker").exists()
    assert modeling.sequence_limit(settings_for("--model", str(folder), "--trust-remote-code")) == 512
    assert (tmp_path / "marker").read_text() == "ran"


@pytest.mark.parametrize(
    "name,limit",
    [("roberta-base", 512), ("bert-base-uncased", 512), ("distilbert-base-uncased", 512), ("embedded:tiny-bert", 512)],
)
def test_sequence_limits_count_usable_positions(name, limit):
    # RoBERTa has 514 position embeddings, two of them taken by the padding offset
    assert modeling.sequence_limit(settings_for("--model", name, "--architecture-only")) == limit


def small(name: str):
    values = dict(embedded.bundled_architecture(name))
    model_type = values.pop("model_type")
    shrink = {"distilbert": {"n_layers": 2, "dim": 32, "hidden_dim": 64, "n_heads": 2}}.get(
        model_type, {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
    )
    return AutoModelForSequenceClassification.from_config(AutoConfig.for_model(model_type, **{**values, **shrink}))


@pytest.mark.parametrize(
    "name,layer",
    [
        ("roberta-base", "RobertaLayer"),
        ("bert-base-uncased", "BertLayer"),
        ("distilbert-base-uncased", "TransformerBlock"),
        ("tiny-bert", "BertLayer"),
    ],
)
def test_fsdp_shards_each_bundled_architecture_layer_by_layer(name, layer):
    model = small(name)
    assert modeling.transformer_layer_classes(model) == [layer]
    plugin = SimpleNamespace(transformer_cls_names_to_wrap=None)
    wrapped = modeling.fsdp_wrap_rule(model, SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))
    # the layer alone: BERT's and RoBERTa's _no_split_modules name the embeddings too, which Accelerate's FSDP2
    # prepare would shard twice (tests/test_gpu_path.py runs that prepare); DistilBERT declares none
    assert wrapped == [layer] == plugin.transformer_cls_names_to_wrap
    named = SimpleNamespace(transformer_cls_names_to_wrap=["BertSelfAttention"])  # the config's own choice is kept
    assert modeling.fsdp_wrap_rule(model, SimpleNamespace(state=SimpleNamespace(fsdp_plugin=named))) == [
        "BertSelfAttention"
    ]
    assert modeling.fsdp_wrap_rule(model, SimpleNamespace(state=SimpleNamespace())) is None  # not an FSDP run


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant_with_warmup"])
def test_the_schedule_matches_transformers_get_scheduler(kind):
    from transformers import get_scheduler

    ours_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ours = modeling.build_scheduler(settings_for("--lr-scheduler", kind), ours_optimizer, 20, 4)
    theirs = get_scheduler(kind, theirs_optimizer, num_warmup_steps=4, num_training_steps=20)
    for _ in range(22):
        assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr())
        ours_optimizer.step(), theirs_optimizer.step()
        ours.step(), theirs.step()


@pytest.mark.parametrize("model", ["embedded:tiny-bert", "embedded:minilm-l6"])
def test_dropout_overrides_reach_the_built_model(model):
    """--hidden-dropout / --attention-dropout set the configuration before the model is built (from its
    configuration, or from pretrained weights)."""
    tokenizer = modeling.build_tokenizer(settings_for("--model", model))
    built, facts = modeling.build_model(
        settings_for("--model", model, "--hidden-dropout", "0.25", "--attention-dropout", "0"), ["a", "b"], tokenizer
    )
    assert facts["dropout"] == {"hidden": 0.25, "attention": 0.0}
    assert facts["dropout_overrides"] == {"hidden_dropout_prob": 0.25, "attention_probs_dropout_prob": 0.0}
    assert {m.p for m in built.modules() if isinstance(m, torch.nn.Dropout)} == {0.25, 0.0}
    _, plain = modeling.build_model(settings_for("--model", model), ["a", "b"], tokenizer)
    assert plain["dropout_overrides"] is None


def test_a_dropout_override_the_model_cannot_take_is_one_line():
    config = SimpleNamespace(model_type="odd", hidden_dropout_prob=0.1)
    with pytest.raises(UserError, match="--attention-dropout: the odd configuration has none of"):
        modeling.dropout_overrides(config, settings_for("--attention-dropout", "0"))


@pytest.mark.parametrize(
    "implementation,defaults",
    [("fused", {"fused": True}), ("foreach", {"foreach": True}), ("for-loop", {"foreach": False})],
)
def test_the_optimizer_implementation_is_chosen_and_recorded(implementation, defaults):
    model = torch.nn.Linear(4, 2)
    optimizer = modeling.build_optimizer(
        model, settings_for("--optimizer-implementation", implementation), torch.device("cpu")
    )
    assert all(optimizer.defaults[k] == v for k, v in defaults.items())
    facts = modeling.optimizer_facts(optimizer)
    assert facts["fused"] is (implementation == "fused") and facts["foreach"] is (implementation == "foreach")


def test_the_fused_optimizer_updates_as_the_foreach_one():
    """--optimizer-implementation fused (the default) against foreach: the same parameters, the same gradients on each
    of 10 steps (both parameter groups, weight decay on), parameters equal within fp32 rounding.

    Tolerance: a step evaluates AdamW's formula element by element in about a dozen fp32 operations, which the two
    implementations may associate differently; each operation rounds to within u = 2^-24 of its result. The decay and
    the subtraction round the parameter (at most 2u |p|); the step lr x m_hat / (sqrt(v_hat) + eps) comes out within
    about 12u of itself, and |m_hat / sqrt(v_hat)| <= (1 - beta1) / sqrt(1 - beta2) ~ 3.2 (Kingma and Ba, section 2.1),
    so within 40u lr. Over k steps (first order): |difference| <= k u (2 |p| + 40 lr)."""
    model = small("tiny-bert")
    twin = copy.deepcopy(model)
    initial = copy.deepcopy(model)
    optimizers = [
        modeling.build_optimizer(
            m, settings_for("--optimizer-implementation", name, "--learning-rate", "3e-3"), torch.device("cpu")
        )
        for m, name in ((model, "fused"), (twin, "foreach"))
    ]
    assert optimizers[0].defaults["fused"] and optimizers[1].defaults["foreach"]
    generator = torch.Generator().manual_seed(0)
    steps, lr, u = 10, 3e-3, 2.0**-24
    for _ in range(steps):
        for a, b in zip(model.parameters(), twin.parameters()):
            a.grad = torch.randn(a.shape, generator=generator) * 0.1
            b.grad = a.grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    for (name, a), b, before in zip(model.named_parameters(), twin.parameters(), initial.parameters()):
        bound = steps * u * (2 * a.detach().abs() + 40 * lr)
        assert bool(((a - b).abs() <= bound).all()), f"{name}: {float((a - b).abs().max())} apart"
        assert float((a - before).abs().max()) > lr  # the steps moved it: the comparison is of updates
