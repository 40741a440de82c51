"""The user's command as `trainscope tune` runs it, and a change applied to it from outside the script.

How it works: docs/tune.md#what-trainscope-tune-changes-and-how.
"""

import contextlib
import dataclasses
import io
import shlex
from pathlib import Path

from trainscope.advice import changes
from trainscope.advice.judge import merge_flags
from trainscope.core.errors import UserError
from trainscope.core.record_view import RunView
from trainscope.run import overrides


@dataclasses.dataclass(frozen=True)
class Change:
    """What a trial changes (None or empty: as the command has it)."""

    mixed_precision: str | None = None  # Accelerate's: no, fp16, bf16
    threads: int | None = None  # each process's intra-op threads
    compile_mode: str | None = None  # torch.compile through Accelerate's dynamo plugin (inductor) in this mode
    num_workers: int | None = None  # trainscope.Run's loader (trainscope.run.overrides)
    pin_memory: bool | None = None
    flags: tuple = ()  # the script's own flags (train.py's)
    env: tuple = ()  # other (name, value) pairs of the environment

    def __or__(self, other: "Change") -> "Change":
        """This change with `other` on top: its settings win, its flags replace the same flags' values."""
        fields = {f.name: getattr(other, f.name) for f in dataclasses.fields(other) if getattr(other, f.name)}
        fields.update(flags=tuple(merge_flags(list(self.flags), list(other.flags))), env=self.env + other.env)
        return dataclasses.replace(self, **fields)

    @property
    def parts(self) -> list[str]:
        """Its catalogue keys (trainscope.advice.changes, train.py's words): what decides its kind."""
        named = {"threads": "--threads", "compile_mode": "--compile", "num_workers": "--num-workers"}
        found = [key for field, key in named.items() if getattr(self, field)]
        found += [f for f in self.flags if f.startswith("--")] + ["--pin-memory"] * bool(self.pin_memory)
        found += [f"env:{name}" for name, _ in self.env]
        return found + ([f"config:{self.mixed_precision}"] if self.mixed_precision not in (None, "no") else [])

    @property
    def kind(self) -> str:
        """exact, numeric or training: the strictest of its parts' (nothing changed: exact)."""
        return changes.kind_of_parts(self.parts)

    @property
    def does(self) -> str:
        return changes.does_of_parts(self.parts)


LAUNCHERS = ("accelerate launch", "python", "torchrun")


@dataclasses.dataclass(frozen=True)
class Command:
    """`accelerate launch [its flags] script [args]`, `python [-u] script|-m module [args]` or `torchrun [its flags]
    script [args]`: `at` is where the script (or -m) begins."""

    argv: tuple
    launcher: str
    at: int

    @classmethod
    def parse(cls, argv: list[str]) -> "Command":
        if not argv:
            raise UserError("no command to tune: trainscope tune [options] -- <your training command>")
        name = Path(argv[0]).name
        if name == "accelerate" and argv[1:2] == ["launch"]:
            from accelerate.commands.launch import launch_command_parser

            parser, rest, launcher = launch_command_parser(), argv[2:], "accelerate launch"
        elif name == "torchrun":
            from torch.distributed.run import get_args_parser

            parser, rest, launcher = get_args_parser(), argv[1:], "torchrun"
        elif name.startswith("python"):
            start = 2 if argv[1:2] == ["-u"] else 1
            if len(argv) <= start or argv[start].startswith("-") and argv[start] != "-m":
                raise UserError(f"`{shlex.join(argv)}`: tune runs `python script.py ...` or `python -m module ...`")
            return cls(tuple(argv), "python", start)
        else:
            raise UserError(f"`{shlex.join(argv)}`: tune runs commands of {', '.join(LAUNCHERS)}")
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):  # argparse's usage: the one line of its error is enough
                parsed = parser.parse_args(rest)
        except SystemExit:
            why = said.getvalue().strip().splitlines()[-1:] or ["?"]
            raise UserError(f"`{shlex.join(argv)}`: {launcher} cannot read its arguments ({why[0]})") from None
        return cls(tuple(argv), launcher, len(argv) - len(parsed.training_script_args) - 1)

    @property
    def script(self) -> str:
        return self.argv[self.at + 1] if self.argv[self.at] == "-m" else Path(self.argv[self.at]).name

    def outside(self, change: Change) -> tuple[list[str], dict]:
        """(the launcher's flags, environment variables) that make `change` from outside the script."""
        env, flags = dict(change.env), []
        if change.num_workers is not None:
            env[overrides.WORKERS] = str(change.num_workers)
        if change.pin_memory is not None:
            env[overrides.PIN_MEMORY] = "1" if change.pin_memory else "0"
        if change.compile_mode:
            env[overrides.EAGER_RANDOM] = "1"  # compiled code keeps eager's dropout draws
        if self.launcher == "accelerate launch":  # its flags win over its config file and the environment
            flags += ["--mixed_precision", change.mixed_precision] if change.mixed_precision else []
            flags += ["--num_cpu_threads_per_process", str(change.threads)] if change.threads else []
            if change.compile_mode:  # dynamic shapes: a loop whose lengths vary would recompile for each otherwise
                flags += ["--dynamo_backend", "inductor", "--dynamo_mode", change.compile_mode, "--dynamo_use_dynamic"]
        else:
            env.update({"ACCELERATE_MIXED_PRECISION": change.mixed_precision} if change.mixed_precision else {})
            env.update({"OMP_NUM_THREADS": str(change.threads)} if change.threads else {})
            if change.compile_mode:
                env.update(ACCELERATE_DYNAMO_BACKEND="INDUCTOR", ACCELERATE_DYNAMO_MODE=change.compile_mode)
        return flags, env

    def applied(self, change: Change) -> tuple[list[str], dict]:
        """(argv, environment variables to set) of the command with `change` applied."""
        flags, env = self.outside(change)
        script = list(self.argv[self.at :])
        head = 2 if script[0] == "-m" else 1
        return [*self.argv[: self.at], *flags, *script[:head], *merge_flags(script[head:], list(change.flags))], env

    def words(self, change: Change) -> list[str]:
        """`change` as this command takes it: environment variables, the launcher's flags, the script's flags."""
        flags, env = self.outside(change)
        return [*(f"{name}={value}" for name, value in env.items()), *flags, *change.flags]

    def text(self, change: Change) -> str:
        """The command with `change` applied, as a user types it (its environment written out in front)."""
        argv, env = self.applied(change)
        return " ".join([*(f"{name}={shlex.quote(value)}" for name, value in env.items()), shlex.join(argv)])


def not_applied(change: Change, view: RunView) -> str | None:
    """Why a trial's record shows its change did not take (the script's own code fixes the setting), or None."""
    precision = {"no": "fp32"}.get(change.mixed_precision, change.mixed_precision)
    if precision and view.precision != precision:
        return f"its run stayed in {view.precision}: the script's own code sets its precision (Accelerator(...))"
    if change.threads and view.torch_threads != change.threads:
        return f"its run kept {view.torch_threads} thread(s): the script sets its own (trainscope.Run(threads=...))"
    if change.compile_mode and not (view.setting("compile") or view.model_facts.get("class") == "OptimizedModule"):
        return "its model was not compiled: the script's Accelerator takes no dynamo plugin from outside"
    return None


def outside(suggestion, view: RunView) -> Change | str:
    """An advisor's suggestion (in train.py's terms) as a change from outside the script, or why it cannot be one: on
    train.py its own flags; on a loop of its own the threads, the compile (and its mode) and, where trainscope.Run
    feeds the loop its batches (not the Trainer's), the loader's workers and pinned memory."""
    config, flags = suggestion.config, list(suggestion.flags)
    if config not in (None, "bf16", "fp16"):
        return f"another Accelerate config ({config}): its topology is the launch's"
    if view.options_as == "flags":  # train.py: its own flags
        return Change(mixed_precision=config, flags=tuple(flags))
    loader = "Trainer" not in str((view.record.get("instrument") or {}).get("api"))
    fields, index = {"mixed_precision": config}, 0
    while index < len(flags):
        flag = flags[index]
        value = flags[index + 1] if index + 1 < len(flags) and not flags[index + 1].startswith("--") else None
        index += 2 if value is not None else 1
        if flag == "--threads":
            fields["threads"] = view.threads.get("thread_budget") if value == "auto" else int(value)
        elif flag in ("--compile", "--compile-mode"):
            fields["compile_mode"] = value or fields.get("compile_mode") or "default"
        elif flag == "--num-workers" and loader:
            fields["num_workers"] = int(value)
        elif flag == "--pin-memory" and loader:
            fields["pin_memory"] = True
        else:
            return f"not from outside the script: {changes.loop_words([flag, *([value] if value else [])])}"
    return Change(**fields)
