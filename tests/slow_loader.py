"""Every batch waits in train.py's loader, as on storage that makes each batch wait: a run long enough to be
interrupted in its middle, on any machine. tests/test_endings.py patches it into the script it launches and into its
forked ranks."""

import time

import trainscope.workload.data as data


def every_batch_waits(seconds: float = 0.03) -> None:
    build = data.build_collator

    def build_collator(*args, **kwargs):
        collate = build(*args, **kwargs)
        return lambda rows: (time.sleep(seconds), collate(rows))[1]

    data.build_collator = build_collator
