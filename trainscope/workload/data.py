"""Data: a name or path -> labelled, tokenized, cached train/validation/test splits -> DataLoaders.

Every script builds its data here, so a loader sweep or a DataParallel comparison measures exactly
what train.py trains on.
"""

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import datasets
import numpy as np
import torch
from datasets import ClassLabel, Dataset, DatasetDict
from datasets.arrow_writer import SchemaInferenceError
from datasets.fingerprint import Hasher
from transformers import DataCollatorWithPadding

from trainscope.core.errors import UserError
from trainscope.core.records import redact
from trainscope.workload import embedded, hub
from trainscope.workload.settings import EMBEDDED_DATASET

TEXT_COLUMNS = ("text", "sentence", "content", "review", "tweet", "document", "comment", "body")
TEXT_PAIRS = (
    ("sentence1", "sentence2"),
    ("question", "sentence"),
    ("premise", "hypothesis"),
    ("question1", "question2"),
)
LABEL_COLUMNS = ("label", "labels", "sentiment", "class", "target", "category")
VALIDATION_SPLITS = ("validation", "valid", "dev", "val")
FILE_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
INDEX_COLUMN_PREFIX = "__index_level_"  # pandas' index, written into parquet files: never text or label
TOKENIZATION_VERSION = 1  # bump when tokenize() changes, so cached splits are rebuilt


@dataclass
class ClassificationData:
    """Tokenized splits with their provenance, ready for `build_dataloaders`."""

    train: Dataset
    validation: Dataset
    test: Dataset
    label_names: list[str]
    text_columns: list[str]
    label_column: str
    provenance: dict = field(default_factory=dict)

    def record_facts(self) -> dict:
        """The run record's `data` block."""
        return {
            "labels": self.label_names,
            "text_columns": self.text_columns,
            "label_column": self.label_column,
            **self.provenance,
        }


# ---------------------------------------------------------------- loading


def _builder_for(path: str, encoding: str) -> tuple[str, dict]:
    """The datasets builder for a file and its options; text formats take an encoding."""
    suffix = Path(urlparse(path).path).suffix.lower()
    if suffix not in FILE_BUILDERS:
        raise UserError(f"cannot read {redact(path)!r}: supported files are {', '.join(FILE_BUILDERS)}")
    builder = FILE_BUILDERS[suffix]
    kwargs = {"encoding": encoding} if builder in ("csv", "json") else {}
    if suffix == ".tsv":
        kwargs["sep"] = "\t"
    return builder, kwargs


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).suffix.lower() in FILE_BUILDERS


def load_raw(settings) -> tuple[DatasetDict, dict]:
    """Load the source named by --dataset; return its splits and a description for the record."""
    name, config = settings.dataset, settings.dataset_config
    if name == EMBEDDED_DATASET:
        path = embedded.tweets_csv()
        raw = datasets.load_dataset("csv", data_files=str(path), encoding=embedded.TWEETS_ENCODING)
        return raw, {"kind": "embedded", "name": name, "path": str(path)}
    if name.startswith("embedded:"):
        raise UserError(f"unknown embedded dataset {name!r}: the embedded dataset is {EMBEDDED_DATASET}")
    if "://" in name:  # fsspec URL: s3://, gs://, https://, ...
        builder, kwargs = _builder_for(name, settings.data_encoding)
        raw = _load(builder, data_files=name, **kwargs)
        return raw, {"kind": "url", "name": redact(name)}
    local = Path(name).expanduser()
    if local.is_file():
        builder, kwargs = _builder_for(str(local), settings.data_encoding)
        raw = _load(builder, data_files=str(local), **kwargs)
        return raw, {"kind": "file", "name": str(local)}
    if local.is_dir():
        if (local / "dataset_dict.json").exists() or (local / "state.json").exists():
            raw = datasets.load_from_disk(str(local))
        else:
            raw = _load(str(local), config)
        return raw, {"kind": "directory", "name": str(local), "config": config}
    if Path(name).suffix.lower() in FILE_BUILDERS:
        raise UserError(f"no such dataset file: {name}")
    if config is None and local.parent.is_dir() and str(local.parent) not in ("", "."):
        # `some/dir/config` with a local dataset directory: the local twin of hub `name/config`.
        return _load(str(local.parent), local.name), {
            "kind": "directory",
            "name": str(local.parent),
            "config": local.name,
        }
    if _looks_like_path(name):
        raise UserError(f"no such dataset file or directory: {name}")
    return _load_from_hub(name, config)


def _load_from_hub(name: str, config: str | None) -> tuple[DatasetDict, dict]:
    candidates = [(name, config)]
    parts = name.split("/")
    if config is None and len(parts) == 3:
        candidates = [("/".join(parts[:2]), parts[2])]
    elif config is None and len(parts) == 2:
        candidates.append((parts[0], parts[1]))  # glue/sst2 = dataset glue, configuration sst2
    errors = []
    with hub.offline_if_unreachable() as offline:
        for repo, repo_config in candidates:
            try:
                raw = datasets.load_dataset(repo, repo_config)
                return raw, {"kind": "hub", "name": repo, "config": repo_config, "offline": offline}
            except (FileNotFoundError, ConnectionError, ValueError) as error:
                errors.append(f"{repo}{'/' + repo_config if repo_config else ''}: {str(error).splitlines()[0]}")
    where = "in the local Hugging Face cache (the Hub is unreachable)" if offline else "on the Hub"
    raise UserError(
        f"dataset {name!r} was not found {where} ({'; '.join(errors)}); pass a local file or directory, "
        f"or {EMBEDDED_DATASET}"
    )


NO_ROWS = "no rows came from it (is the file there, and not empty?)"


def _load(builder: str, config: str | None = None, **kwargs) -> DatasetDict:
    try:
        return datasets.load_dataset(builder, config, **kwargs)
    except (FileNotFoundError, ValueError, UnicodeDecodeError) as error:
        raise UserError(
            f"cannot read dataset {redact(str(kwargs.get('data_files', builder)))}: {_first_line(error)}"
        ) from None
    except Exception as error:  # parser errors (pandas, pyarrow) name the broken row
        where = redact(str(kwargs.get("data_files", builder)))
        if isinstance(error, StopIteration):  # the json builder on an empty file
            raise UserError(f"cannot read dataset {where}: {NO_ROWS}") from None
        if type(error).__module__.split(".")[0] not in ("pandas", "pyarrow", "datasets"):
            raise
        missing = _cause(error, (FileNotFoundError, PermissionError))  # a generation error around a file not there
        if missing is not None:
            raise UserError(f"cannot read dataset {where}: {_first_line(missing)}") from None
        if _cause(error, (SchemaInferenceError,)) is not None:
            # zero rows to infer a schema from: an empty file, or a remote one the server did not send
            raise UserError(f"cannot read dataset {where}: {NO_ROWS}") from None
        raise UserError(f"cannot parse dataset {where}: {_first_line(error)}") from None


def _cause(error: BaseException, kinds: tuple) -> BaseException | None:
    """The first error of `kinds` in the chain of causes and contexts of `error`."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kinds):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _first_line(error: BaseException) -> str:
    """The first line of an error, redacted: library errors quote the URL they could not open."""
    return redact((str(error).strip().splitlines() or [type(error).__name__])[0])


# ---------------------------------------------------------------- columns and labels


def detect_columns(features: datasets.Features, text_column: str | None, label_column: str | None):
    """Return (text columns, label column), detected where not given. pandas index columns never count."""
    features = {name: feature for name, feature in features.items() if not name.startswith(INDEX_COLUMN_PREFIX)}
    names = list(features)
    if label_column is None:
        label_column = next((c for c in LABEL_COLUMNS if c in features), None)
        if label_column is None:
            raise UserError(f"no label column found among {names}: pass --label-column")
    elif label_column not in features:
        raise UserError(f"label column {label_column!r} is not in the data (columns: {names})")

    if text_column is not None:
        text_columns = [c.strip() for c in text_column.split(",")]
        missing = [c for c in text_columns if c not in features]
        if missing or len(text_columns) > 2:
            raise UserError(f"--text-column {text_column!r} must name one or two of the columns {names}")
        return text_columns, label_column
    for pair in TEXT_PAIRS:
        if all(c in features for c in pair):
            return list(pair), label_column
    for candidate in TEXT_COLUMNS:
        if candidate in features:
            return [candidate], label_column
    strings = [
        c for c, f in features.items() if c != label_column and getattr(f, "dtype", None) in ("string", "large_string")
    ]
    if len(strings) == 1:
        return strings, label_column
    raise UserError(f"cannot tell which column holds the text among {names}: pass --text-column")


def encode_labels(raw: DatasetDict, label_column: str) -> tuple[DatasetDict, list[str]]:
    """Give every split integer labels 0..K-1 under one shared ClassLabel (so splits can be stratified).

    String labels map to their sorted order, booleans to False=0/True=1, integers keep their values
    when they are 0..K-1 and map to their sorted order otherwise. A missing label (None, or -1 as in
    unlabelled test splits) stays missing here and is dropped by `drop_unusable_rows`. The class
    names are the mapping, recorded with the run.
    """
    feature = raw["train"].features[label_column]
    if isinstance(feature, ClassLabel):
        return raw, list(feature.names)
    dtype = getattr(feature, "dtype", None)
    values = set()
    for split in raw.values():
        values.update(v for v in split.unique(label_column) if v is not None)
    if dtype in ("string", "large_string"):
        names = sorted(values)
        ids = {name: i for i, name in enumerate(names)}
    elif dtype == "bool":
        names, ids = ["False", "True"], {False: 0, True: 1}
    elif dtype is not None and dtype.startswith(("int", "uint")):
        labelled = sorted(v for v in values if v >= 0)
        if not labelled:
            raise UserError(f"label column {label_column!r} has no labelled rows")
        if labelled == list(range(len(labelled))):
            names, ids = [str(v) for v in labelled], {v: v for v in labelled}
        else:
            names, ids = [str(v) for v in labelled], {v: i for i, v in enumerate(labelled)}
    else:
        raise UserError(
            f"label column {label_column!r} holds {dtype or type(feature).__name__} values; classification "
            "needs integer, boolean or string labels"
        )
    missing = -1  # ClassLabel's own value for "no label"

    def to_ids(labels):
        return {label_column: [ids.get(v, missing) if v is not None else missing for v in labels]}

    features = raw["train"].features.copy()
    features[label_column] = ClassLabel(names=names)
    raw = raw.map(to_ids, input_columns=label_column, batched=True, features=features, desc="encoding labels")
    return raw, names


def drop_unusable_rows(raw: DatasetDict, text_columns: list[str], label_column: str) -> tuple[DatasetDict, dict]:
    """Drop rows without a label or with an empty text; return the data and {split: {reason: rows}}."""
    dropped = {}

    def usable(batch):
        keep = []
        for index, label in enumerate(batch[label_column]):
            empty = any(batch[c][index] is None or not str(batch[c][index]).strip() for c in text_columns)
            keep.append(label is not None and label >= 0 and not empty)
        return keep

    kept = {}
    for name, split in raw.items():
        missing = int((_label_array(split, label_column) < 0).sum())  # encode_labels made missing labels -1
        filtered = split.filter(usable, batched=True, input_columns=None, desc="dropping unusable rows")
        empty = len(split) - len(filtered) - missing
        if missing or empty:
            dropped[name] = {"rows_in": len(split), "missing_label": missing, "empty_text": empty}
        kept[name] = filtered
    return DatasetDict(kept), dropped


# ---------------------------------------------------------------- splits


def make_splits(raw: DatasetDict, label_column: str, settings) -> tuple[dict[str, Dataset], dict]:
    """train/validation/test, carving what the source lacks out of train (fixed seed, stratified)."""
    splits = {"train": raw["train"]}
    origin = {"train": "source split 'train'"}
    validation_name = next((s for s in VALIDATION_SPLITS if s in raw and len(raw[s]) > 0), None)
    if "test" in raw and len(raw["test"]) > 0:
        splits["test"], origin["test"] = raw["test"], "source split 'test'"
    if validation_name:
        splits["validation"], origin["validation"] = raw[validation_name], f"source split '{validation_name}'"
    for split, fraction in (("test", settings.test_fraction), ("validation", settings.validation_fraction)):
        if split in splits:
            continue
        train = splits["train"]
        if len(train) < 10:
            raise UserError(f"only {len(train)} labelled training rows: too few to hold out a {split} split")
        stratify = label_column if _stratifiable(train, label_column, fraction) else None
        parts = train.train_test_split(
            test_size=fraction, seed=settings.resolved_data_seed, stratify_by_column=stratify
        )
        splits["train"], splits[split] = parts["train"], parts["test"]
        origin["train"] = "source split 'train' less the held-out splits"
        origin[split] = (
            f"{fraction:.0%} of train, seed {settings.resolved_data_seed}{', stratified' if stratify else ''}"
        )
    return splits, origin


def _label_array(split: Dataset, label_column: str) -> np.ndarray:
    """The label column as one numpy array, read as Arrow through the split's indices (row by row takes seconds,
    the numpy format a third of a second on a shuffled 30,000-row split)."""
    return split.select_columns([label_column]).with_format("arrow")[:].column(label_column).to_numpy()


def _stratifiable(train: Dataset, label_column: str, fraction: float) -> bool:
    _, counts = np.unique(_label_array(train, label_column), return_counts=True)
    return counts.min() >= 2 and round(len(train) * fraction) >= len(counts)


def subsample(split: Dataset, limit: int | None, seed: int) -> Dataset:
    """A fixed-seed random subset: sources are often sorted by label, so a head would be one class."""
    if limit is None or limit >= len(split):
        return split
    return split.shuffle(seed=seed).select(range(limit))


# ---------------------------------------------------------------- tokenization


@contextlib.contextmanager
def progress_bars(enabled: bool):
    """datasets' progress bars on or off inside the block, as they were after it."""
    before = datasets.is_progress_bar_enabled()
    (datasets.enable_progress_bars if enabled else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.enable_progress_bars if before else datasets.disable_progress_bars)()


def tokenize(split: Dataset, tokenizer, text_columns: list[str], label_column: str, max_seq_length: int):
    """Tokenize a split once; a second run with the same inputs loads it from the datasets cache.

    Returns (dataset, cached). The fingerprint is ours (source fingerprint, tokenizer, length,
    columns), so the cache hit is known before `map` and does not hinge on pickling the tokenizer.
    """
    fingerprint = Hasher.hash(
        [
            split._fingerprint,
            tokenizer.name_or_path,
            type(tokenizer).__name__,
            len(tokenizer),
            text_columns,
            label_column,
            max_seq_length,
            TOKENIZATION_VERSION,
        ]
    )
    cache_dir = Path(split.cache_files[0]["filename"]).parent if split.cache_files else None
    cached = bool(cache_dir and (cache_dir / f"cache-{fingerprint}.arrow").exists())

    def encode(batch):
        texts = [[str(t) if t is not None else "" for t in batch[c]] for c in text_columns]
        encoded = tokenizer(*texts, truncation=True, max_length=max_seq_length)
        encoded["labels"] = batch[label_column]
        return encoded

    with progress_bars(True):  # the one step worth a bar: it can take minutes on a large corpus
        tokenized = split.map(
            encode, batched=True, remove_columns=split.column_names, new_fingerprint=fingerprint, desc="tokenizing"
        )
    keep = [c for c in (*MODEL_INPUTS, "labels") if c in tokenized.column_names]
    return tokenized.select_columns(keep), cached


@dataclass
class LabelledSplits:
    """Raw-text train/validation/test with integer labels, before subsampling and tokenization."""

    splits: dict
    origin: dict
    label_names: list[str]
    text_columns: list[str]
    label_column: str
    source: dict
    dropped: dict

    def subset(self, split: str, settings) -> Dataset:
        limits = {
            "train": settings.max_train_samples,
            "validation": settings.max_eval_samples,
            "test": settings.max_test_samples,
        }
        return subsample(self.splits[split], limits[split], settings.resolved_data_seed)


def labelled_splits(settings) -> LabelledSplits:
    """--dataset -> labelled raw-text splits: columns detected, labels encoded, unusable rows dropped,
    missing splits carved from train."""
    raw, source = load_raw(settings)
    raw = _training_splits(raw)
    text_columns, label_column = detect_columns(raw["train"].features, settings.text_column, settings.label_column)
    raw, label_names = encode_labels(raw, label_column)
    raw, dropped = drop_unusable_rows(raw, text_columns, label_column)
    splits, origin = make_splits(raw, label_column, settings)
    present = set(splits["train"].unique(label_column))
    if len(present) < 2:
        raise UserError(
            f"the training data holds one class only ({label_names[present.pop()] if present else 'none'}): "
            "classification needs at least two"
        )
    return LabelledSplits(splits, origin, label_names, text_columns, label_column, source, dropped)


def load_classification_data(settings, tokenizer, main_process_first) -> ClassificationData:
    """--dataset -> tokenized train/validation/test; the main process tokenizes first, the rest read its cache."""
    # casts, filters and splits take a second; no bars for them
    with main_process_first(), progress_bars(False):
        labelled = labelled_splits(settings)
        tokenized, cached = {}, {}
        for split in ("train", "validation", "test"):
            tokenized[split], cached[split] = tokenize(
                labelled.subset(split, settings),
                tokenizer,
                labelled.text_columns,
                labelled.label_column,
                settings.max_seq_length,
            )
    provenance = {
        "source": labelled.source,
        "splits": {
            s: {"rows": len(tokenized[s]), "origin": labelled.origin[s], "tokenization_cached": cached[s]}
            for s in tokenized
        },
        "dropped_rows": labelled.dropped,
    }
    return ClassificationData(
        train=tokenized["train"],
        validation=tokenized["validation"],
        test=tokenized["test"],
        label_names=labelled.label_names,
        text_columns=labelled.text_columns,
        label_column=labelled.label_column,
        provenance=provenance,
    )


def _training_splits(raw) -> DatasetDict:
    """A DatasetDict with a 'train' split (a lone unnamed split is the training data)."""
    if isinstance(raw, Dataset):
        raw = DatasetDict({"train": raw})
    elif "train" not in raw and len(raw) == 1:
        raw = DatasetDict({"train": next(iter(raw.values()))})
    if "train" not in raw:
        raise UserError(f"the dataset has no 'train' split (splits: {list(raw)})")
    return raw


def dropped_rows_lines(dropped: dict) -> list[str]:
    """One line per split that lost rows, for the console."""
    return [
        f"dropped {d['missing_label'] + d['empty_text']} of {d['rows_in']} rows from {split}: "
        f"{d['missing_label']} without a label, {d['empty_text']} with an empty text"
        for split, d in dropped.items()
    ]


# ---------------------------------------------------------------- loaders


def build_collator(tokenizer, settings, pad_to_multiple_of: int | None = None):
    if settings.pad_to_max_length:
        return DataCollatorWithPadding(tokenizer, padding="max_length", max_length=settings.max_seq_length)
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)


def worker_options(settings, pin_memory: bool) -> dict:
    """DataLoader keyword arguments for the worker settings (PyTorch rejects some combinations)."""
    options = {"num_workers": settings.num_workers, "pin_memory": pin_memory}
    if settings.num_workers > 0:
        options["persistent_workers"] = settings.persistent_workers
        if settings.prefetch_factor is not None:
            options["prefetch_factor"] = settings.prefetch_factor
    return options


def build_dataloaders(
    data: ClassificationData, tokenizer, settings, pin_memory: bool = False, pad_to_multiple_of: int | None = None
):
    """Train (shuffled), validation and test DataLoaders with the same collate and worker settings."""
    collate = build_collator(tokenizer, settings, pad_to_multiple_of)
    options = worker_options(settings, pin_memory)
    # Each new iterator draws a worker seed; from the global generator that draw would shift the
    # dropout masks of everything after it (a resumed run creates one iterator more than the
    # uninterrupted run). Loaders get their own generators.
    generator = lambda: torch.Generator().manual_seed(settings.seed)  # noqa: E731
    if settings.group_by_length:
        # transformers' sampler: random megabatches, sorted by length inside, longest batch first
        from transformers.trainer_pt_utils import LengthGroupedSampler

        lengths = [len(ids) for ids in data.train["input_ids"]]
        order = {
            "sampler": LengthGroupedSampler(settings.per_device_batch_size, lengths=lengths, generator=generator())
        }
    else:
        order = {"shuffle": True}
    train = torch.utils.data.DataLoader(
        data.train,
        batch_size=settings.per_device_batch_size,
        collate_fn=collate,
        generator=generator(),
        **order,
        **options,
    )
    evaluation = [
        torch.utils.data.DataLoader(
            by_length(split) if settings.eval_order == "length" else split,
            batch_size=settings.resolved_eval_batch_size,
            shuffle=False,
            collate_fn=collate,
            generator=generator(),
            **options,
        )
        for split in (data.validation, data.test)
    ]
    return train, *evaluation


def by_length(split: Dataset) -> Dataset:
    """The split sorted by sequence length (stable: rows of one length keep their order), for --eval-order length:
    evaluation scores do not depend on the order, padding does."""
    lengths = [len(ids) for ids in split["input_ids"]]
    return split.select(sorted(range(len(lengths)), key=lengths.__getitem__))
