"""Where trainscope's cost on a step goes: an A/B by block inside one process, blocks of steps with every piece of the
instrument on ("all"), none of it ("none") and each piece off in turn, in alternating order; a piece's cost is "all"
less the block without it, per step.

    python -m trainscope.experiments.benchmarks.pieces train|trainer|loop [--rounds 7] [--block-steps 30] [flags]

`train`: train.py's step driven by trainscope.Run; `trainer`: a transformers.Trainer with TrainscopeCallback (both
take train.py's flags); `loop`: examples/causal_lm.py's Run loop (its flags, make bench-overhead's by default, and
--threads for Run's threads=, "auto" as the example has it). A diagnostic: the load average is printed with its
figures; one run of each is committed (benchmarks/pieces_<script>.{json,md}).
How it works: docs/benchmarks.md#in-the-code-where-the-cost-goes-trainscopeexperimentsbenchmarkspiecespy."""

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import os
import tempfile
import time
import types
from pathlib import Path

import torch

from trainscope.core.paths import ROOT
from trainscope.experiments.benchmarks import short_run
from trainscope.experiments.benchmarks.overhead import LOOP_ARGS
from trainscope.experiments.loaders.sweep import endless
from trainscope.measure import bench
from trainscope.report.document import Heading, Paragraph, markdown
from trainscope.report.tables import Table, spread_cell
from trainscope.workload.settings import parse_settings
from trainscope.workload.step import unmeasured

DEFAULT_ARGS = ["--threads", "1", "--model", "embedded:tiny-bert", "--per-device-batch-size", "16",
                "--max-seq-length", "64", *short_run(samples=2000, steps=None, warmup=20)]  # fmt: skip
ALL, NONE = "all", "none"
LOOP_WARMUP = 3  # the loop's untimed first steps: its run's warm-up (2 by default) and one more


@contextlib.contextmanager
def replaced(owner, name: str, value):
    """`owner.name` is `value` for the block, then what it was (an instance attribute that was not there removed)."""
    had, old = name in vars(owner), vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def removed(owner, name: str):
    """An instance attribute that shadows the class's (a wrapper set on an object) taken off for the block."""
    old = vars(owner).pop(name)
    try:
        yield
    finally:
        setattr(owner, name, old)


@contextlib.contextmanager
def lifted(*hooks: dict):
    """torch's hook dictionaries (a module's forward hooks, an optimizer's step hooks) emptied for the block."""
    saved = [dict(found) for found in hooks]
    for found in hooks:
        found.clear()
    try:
        yield
    finally:
        for found, kept in zip(hooks, saved):
            found.update(kept)


NULL_PROGRESS = types.SimpleNamespace(update=lambda n=1: None, set_postfix=lambda **_: None, close=lambda: None)


def run_pieces(run, model, optimizer) -> dict:
    """The pieces of trainscope.Run, each a function giving the context that switches it off."""
    metrics, lifecycle = run.metrics, run.lifecycle
    inner = getattr(optimizer, "optimizer", optimizer)

    def counting_off():  # the loss is still kept: the step lines read it
        return replaced(metrics, "micro_batch", lambda batch, loss, *_: metrics.loop.interval_losses.append(loss))

    return {
        "stage timer": lambda: replaced(type(metrics.timer), "__call__", lambda *_, **__: contextlib.nullcontext()),
        "forward hooks": lambda: lifted(model._forward_pre_hooks, model._forward_hooks),
        "step hook": lambda: lifted(inner._optimizer_step_post_hooks),
        "micro-batch counting": counting_off,
        "step lines": lambda: replaced(type(metrics), "log_due", property(lambda self: False)),
        "progress bar": lambda: replaced(lifecycle, "progress", NULL_PROGRESS),
        "stop checks": lambda: replaced(lifecycle, "check", lambda: None),
    }


WHAT = {  # each piece in a line (docs/benchmarks.md says how each is switched off)
    "stage timer": "the clocks of `run.stage` and `run.data`",
    "forward hooks": "the model's forward hooks (the run's, the operator timings' watch, the callback's stages)",
    "step hook": "the optimizer's step hooks, and with them all of a step's end",
    "micro-batch counting": "samples, tokens, FLOPs and the prediction's check of each micro-batch",
    "step lines": "the log steps' line (the losses gathered and checked: a sync; the line written)",
    "progress bar": "the progress bar's update",
    "stop checks": "the signal check at each batch and step end",
    "batch wrapper": "the callback's wrapper of `Trainer.get_batch_samples`",
    "backward wrapper": "the callback's wrapper of `accelerator.backward`",
}


@dataclasses.dataclass
class Blocks:
    """The plan of blocks and what they measured: each block one untimed step (the switch settles), then `steps`
    timed ones, each timed by the wall clock, by the process's CPU time (steadier than the wall while other
    processes share the cores) and by the time Python's garbage collector took inside it (gc.callbacks; the pieces'
    objects may bring a collection on in any block)."""

    configurations: list
    rounds: int
    steps: int
    measured: dict = dataclasses.field(default_factory=lambda: {"wall": [], "cpu": [], "collector": []})
    _gc_s: float = 0.0
    _gc_began: float = 0.0
    _began: dict = dataclasses.field(default_factory=dict)

    def schedule(self) -> list[tuple[int, str]]:
        return [(index, name) for index in range(self.rounds) for name in bench.round_order(self.configurations, index)]

    def _collecting(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_began

    @contextlib.contextmanager
    def watching_the_collector(self):
        gc.callbacks.append(self._collecting)
        try:
            yield
        finally:
            gc.callbacks.remove(self._collecting)

    def _now(self) -> dict:
        return {"wall": time.perf_counter(), "cpu": time.process_time(), "collector": self._gc_s}

    def begin(self) -> None:
        self._began = self._now()

    def end(self, index: int, name: str) -> None:
        """One block's microseconds a step by each clock, into round `index`."""
        for key, now in self._now().items():
            rows = self.measured[key]
            while len(rows) <= index:
                rows.append({})
            rows[index][name] = (now - self._began[key]) / self.steps * 1e6


def steps_needed(warmup: int, rounds: int, steps: int, pieces_wanted) -> int:
    """The optimizer steps a plan takes: the warm-up, each round's blocks ("all", "none" and one a piece) of one
    untimed step and `steps` timed ones, and one more."""
    return warmup + rounds * (len(pieces_wanted) + 2) * (steps + 1) + 1


def driven(blocks: Blocks, run, model, optimizer, pieces: dict, bare_steps, measured_steps, warmup: int) -> None:
    """The run opened, its warm-up steps, then each block of the plan: "none" the bare step with the hooks lifted,
    any other every piece on but the one it names; the run finished."""

    def block(index: int, name: str) -> None:
        if name == NONE:
            switch, steps = lifted(*model_hooks(model), *step_hooks(optimizer)), bare_steps
        else:
            switch, steps = pieces[name]() if name in pieces else contextlib.nullcontext(), measured_steps
        with switch:
            steps(1)
            blocks.begin()
            steps(blocks.steps)
            blocks.end(index, name)

    model.train()
    with run, blocks.watching_the_collector():
        measured_steps(warmup)  # the run's warm-up (FLOPs counted, shapes watched)
        for index, name in blocks.schedule():
            block(index, name)
        run.finish()


def train_blocks(argv: list[str], rounds: int, steps: int, pieces_wanted) -> tuple[Blocks, dict]:
    """train.py's run, its loop driven block by block (see the module's docstring)."""
    from trainscope import classifier as task  # deferred: it loads transformers' models and datasets
    from trainscope.instrument import Run

    (settings,) = parse_settings(argv=argv)
    steps_in_all = steps_needed(settings.timing_warmup_steps, rounds, steps, pieces_wanted)
    settings = dataclasses.replace(settings, max_steps=steps_in_all)
    with tempfile.TemporaryDirectory() as scratch:
        started = task.start(dataclasses.replace(settings, output_dir=scratch, run_name="pieces", overwrite=False))
        settings = started.settings
        tokenizer = task.build_tokenizer(settings)
        data = task.load_classification_data(settings, tokenizer, started.state.main_process_first)
        prediction = task.predict.before_run(settings, started, tokenizer, data)
        training = task.build_training(settings, started, tokenizer, data)
        accelerator, model, optimizer = training.accelerator, training.model, training.optimizer
        driver = task.ClassifierDriver(settings, prediction)
        run = Run.from_started(training.prepared, started, task.facts(training, data), driver)
        pieces = {name: off for name, off in run_pieces(run, model, optimizer).items() if name in pieces_wanted}
        blocks = Blocks([ALL, NONE, *pieces], rounds, steps)
        source = endless(training.train_loader)  # one stream every block reads on from

        def bare_steps(count: int):
            for _ in range(count):
                task.train_step(accelerator, model, next(source), optimizer, training.scheduler, task.unmeasured,
                                settings.max_grad_norm)  # fmt: skip

        def measured_steps(count: int):
            batches = run.data(source)  # a generator is its own iterator: each block's run.data goes on from it
            for _ in range(count):
                batch = next(batches)
                loss, _ = task.train_step(accelerator, model, batch, optimizer, training.scheduler, run.stage,
                                          settings.max_grad_norm, run.backward)  # fmt: skip
                run.count_micro_batch(batch, loss)

        driven(blocks, run, model, optimizer, pieces, bare_steps, measured_steps, settings.timing_warmup_steps)
    return blocks, {"planned_steps": steps_in_all, "threads": torch.get_num_threads()}


def loop_blocks(argv: list[str], rounds: int, steps: int, pieces_wanted) -> tuple[Blocks, dict]:
    """examples/causal_lm.py's loop as that script writes it, driven block by block: its model, data and optimizer
    built by the example's own functions from its flags (see the module's docstring)."""
    from trainscope.instrument import Run

    example = causal_lm_example()
    steps_in_all = steps_needed(LOOP_WARMUP, rounds, steps, pieces_wanted)
    threads = argparse.ArgumentParser(add_help=False)
    threads.add_argument("--threads", default="auto")  # Run's threads= (the example's "auto"), a number or launcher
    threads, argv = threads.parse_known_args(argv)
    args = example.arguments([*argv, "--steps", str(steps_in_all)])
    accelerator, model, optimizer, loader, _ = example.set_up(args)
    source = endless(loader)

    def one_step(ids, stage, backward):
        with stage("forward"):
            loss = model(input_ids=ids, labels=ids).loss
        with stage("backward"):
            backward(loss)
        with stage("optimizer"):
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss

    with tempfile.TemporaryDirectory() as scratch:
        run = Run(accelerator, model, optimizer, steps=steps_in_all, name="pieces", output_dir=scratch,
                  log_every=args.log_every, threads=threads.threads)  # fmt: skip
        pieces = {name: off for name, off in run_pieces(run, model, optimizer).items() if name in pieces_wanted}
        blocks = Blocks([ALL, NONE, *pieces], rounds, steps)

        def bare_steps(count: int):
            for _ in range(count):
                one_step(next(source), unmeasured, accelerator.backward)

        def measured_steps(count: int):
            batches = run.data(source)
            for _ in range(count):
                ids = next(batches)
                run.count_micro_batch({"input_ids": ids}, one_step(ids, run.stage, run.backward))

        driven(blocks, run, model, optimizer, pieces, bare_steps, measured_steps, LOOP_WARMUP)
    return blocks, {"planned_steps": steps_in_all, "threads": torch.get_num_threads()}


def causal_lm_example():
    """examples/causal_lm.py as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("causal_lm_example", ROOT / "examples" / "causal_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trainer_blocks(argv: list[str], rounds: int, steps: int, pieces_wanted) -> tuple[Blocks, dict]:
    """A transformers.Trainer with trainscope's callback on train.py's workload, switched block by block at its step
    ends (see the module's docstring)."""
    from transformers import TrainerCallback

    from trainscope.experiments.benchmarks import trainer_peer
    from trainscope.trainer import TrainscopeCallback

    (settings,) = parse_settings(argv=argv)
    warmup = settings.timing_warmup_steps
    settings = dataclasses.replace(settings, max_steps=steps_needed(warmup, rounds, steps, pieces_wanted))
    blocks = Blocks([ALL, NONE], rounds, steps)

    class Switch(TrainerCallback):
        """At each step end: the block that ended is timed, and the next one's switches are set (after the callback's
        own step end: it comes before this in the Trainer's list)."""

        at, left, pieces, plan = None, warmup, {}, iter(())
        switched = contextlib.ExitStack()

        def on_train_begin(self, args, state, control, **kwargs):
            self.pieces = trainer_pieces(trainer, callback, pieces_wanted)
            blocks.configurations[2:] = list(self.pieces)
            self.plan = iter(blocks.schedule())
            if self.left == 0:
                self._next()

        def on_step_end(self, args, state, control, **kwargs):
            self.left -= 1
            if self.at is not None and self.left == steps:  # the block's untimed step is over
                blocks.begin()
            if self.left == 0:
                if self.at is not None:
                    blocks.end(*self.at)
                self._next()

        def _next(self):
            self.switched.close()
            self.at = next(self.plan, None)
            if self.at is None:
                self.left = -1  # the blocks are done: the Trainer's last steps run as they are
                return
            self.left = steps + 1
            name = self.at[1]
            if name == NONE:
                self.switched.enter_context(without_callback(trainer, callback))
            elif name in self.pieces:
                self.switched.enter_context(self.pieces[name]())

    with tempfile.TemporaryDirectory() as scratch:
        trainer = trainer_peer.peer_trainer(settings, "fp32", scratch, [])
        callback = TrainscopeCallback(trainer, name="pieces", output_dir=scratch, log_every=settings.log_every,
                                      timing_warmup_steps=warmup, threads="launcher")  # fmt: skip
        trainer.add_callback(callback)
        trainer.add_callback(Switch())  # after the callback: its step end comes first
        with blocks.watching_the_collector():
            trainer.train()
    return blocks, {"planned_steps": settings.max_steps, "threads": torch.get_num_threads()}


def trainer_pieces(trainer, callback, wanted) -> dict:
    """The pieces of the callback's instrument that a block switches off: its run's, and the wrappers it set."""
    inner = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    pieces = run_pieces(callback.run, inner, trainer.optimizer)
    pieces["batch wrapper"] = lambda: removed(trainer, "get_batch_samples")
    pieces["backward wrapper"] = lambda: removed(trainer.accelerator, "backward")
    return {name: off for name, off in pieces.items() if name in wanted}


@contextlib.contextmanager
def without_callback(trainer, callback):
    """The Trainer as it is without trainscope's callback: the callback out of its handler, the wrappers it set on the
    Trainer and its Accelerator taken off, the hooks lifted off the model and the optimizer."""
    handler = trainer.callback_handler.callbacks
    where = handler.index(callback)
    handler.remove(callback)
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    try:
        with contextlib.ExitStack() as stack:
            for owner, name in ((trainer, "get_batch_samples"), (trainer, "training_step"),
                                (trainer.accelerator, "backward")):  # fmt: skip
                if name in vars(owner):
                    stack.enter_context(removed(owner, name))
            stack.enter_context(lifted(*model_hooks(model), *step_hooks(trainer.optimizer)))
            yield
    finally:
        handler.insert(where, callback)


def model_hooks(model) -> tuple:
    return model._forward_pre_hooks, model._forward_hooks


def step_hooks(optimizer) -> tuple:
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner._optimizer_step_pre_hooks, inner._optimizer_step_post_hooks


def figures(blocks: Blocks) -> dict:
    """By the wall clock and by CPU time: each piece's cost (all less all-but-it) and the total (all less none),
    microseconds a step, median, min-max and the median's distribution-free interval over the rounds; each block's
    step and its collector's time."""
    complete = [i for i, r in enumerate(blocks.measured["wall"]) if len(r) == len(blocks.configurations)]
    found = {"rounds": len(complete), "steps_per_block": blocks.steps, "measured": blocks.measured}
    for key, rows in blocks.measured.items():
        rounds = [rows[i] for i in complete]
        found[f"{key}_us_per_step"] = {name: bench.spread([r[name] for r in rounds]) for name in blocks.configurations}
        if key == "collector":
            continue
        costs = {}
        for name in blocks.configurations[1:]:
            differences = [r[ALL] - r[name] for r in rounds]
            costs[name] = bench.spread_and_interval(differences)
        total, pieces = costs.pop(NONE), costs
        found[key] = {"total": total, "pieces": pieces,
                      "not_located": total["median"] - sum(max(0.0, p["median"]) for p in pieces.values())}  # fmt: skip
    return found


def page(report: dict) -> list:
    found = report["figures"]
    bare = found["wall_us_per_step"][NONE]["median"]

    def cells(cost: dict) -> list:
        interval = cost["interval"]
        return [f"{cost['median']:+.0f} ({cost['min']:+.0f} to {cost['max']:+.0f})",
                f"{interval['low']:+.0f} to {interval['high']:+.0f} ({interval['confidence']:.0%})"]  # fmt: skip

    names = [("everything (all less none)", "total"), *((f"{n}: {WHAT[n]}", n) for n in found["wall"]["pieces"])]
    rows = []
    for label, name in names:
        wall, cpu = (found[key]["total"] if name == "total" else found[key]["pieces"][name] for key in ("wall", "cpu"))
        rows.append([label, *cells(wall), f"{wall['median'] / bare:+.2%}", *cells(cpu)])
    table = Table(
        "What each piece costs a step (the block with every piece on less the block without it), microseconds",
        ["piece", "wall: median (min to max)", "wall: median's interval", "of the bare step",
         "CPU: median (min to max)", "CPU: median's interval"],
        rows, "pieces", align="lrrrrr",
    )  # fmt: skip
    kinds = Table(
        "Each kind of block: its step, and the garbage collector's time inside it, microseconds",
        ["block", "wall a step", "CPU a step", "the collector a step"],
        [[name, *(spread_cell(found[f"{key}_us_per_step"][name], 0 if key != "collector" else 1)
                  for key in ("wall", "cpu", "collector"))] for name in found["wall_us_per_step"]],
        "pieces_blocks", align="lrrr",
    )  # fmt: skip
    return [
        Heading(f"Where trainscope's cost goes: {report['script']}"),
        Paragraph(
            f"One process, {found['rounds']} rounds of {len(kinds.rows)} blocks in alternating order, each block one "
            f"untimed step then {found['steps_per_block']} timed ones; flags `{' '.join(report['args'])}`; torch "
            f"threads {report['threads']}; load average (1, 5, 15 min) before {report['load_before']}, after "
            f"{report['load_after']}."
        ),
        table,
        kinds,
        Paragraph(
            f"Not located by the pieces (the total less the positive pieces' medians): {found['wall']['not_located']:+.0f}"
            f" us a step by the wall clock, {found['cpu']['not_located']:+.0f} in CPU time. The pieces overlap where one "
            "holds another (the step hook holds a step's whole end). A diagnostic: figures measured while other work "
            "ran are indicative, CPU time less disturbed by it than the wall clock."
        ),
    ]


MEASURES = {"train": train_blocks, "trainer": trainer_blocks, "loop": loop_blocks}


def load() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "script", choices=list(MEASURES), help="train.py's loop, a Trainer with the callback, or a Run loop"
    )
    parser.add_argument("--rounds", type=int, default=7, help="rounds of blocks (default 7)")
    parser.add_argument("--block-steps", type=int, default=30, help="timed optimizer steps a block (default 30)")
    parser.add_argument("--pieces", nargs="+", default=None, choices=list(WHAT), help="pieces (default: every one)")
    parser.add_argument("--out", default=None, help="write <out>.json and <out>.md (default: print only)")
    args, train_args = parser.parse_known_args(argv)
    if args.rounds < 1 or args.block_steps < 1:
        parser.error("--rounds and --block-steps must be at least 1")
    wanted = args.pieces or [p for p in WHAT if args.script == "trainer" or "wrapper" not in p]
    train_args = [*(LOOP_ARGS if args.script == "loop" else DEFAULT_ARGS), *train_args]
    before = load()
    blocks, facts = MEASURES[args.script](train_args, args.rounds, args.block_steps, wanted)
    report = {"script": args.script, "args": train_args, "load_before": before, "load_after": load(), **facts,
              "figures": figures(blocks)}  # fmt: skip
    lines = markdown(page(report))
    if args.out:
        bench.write_results(Path(args.out), report, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
