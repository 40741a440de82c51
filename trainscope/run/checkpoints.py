"""Resumable checkpoints: Accelerate's save_state plus each rank's loop position and timing so far, written as
.step_<N>.partial and renamed once every rank has written its part; `--resume` chooses a usable one (`choose`).
How it works: docs/endings.md#checkpoints-and---resume.
"""

import errno
import json
import shutil
import zipfile
from pathlib import Path

from trainscope.core.errors import Fault, UserError, one_line
from trainscope.core.liveness import lost_a_peer
from trainscope.core.paths import GIB

KEEP_CHECKPOINTS = 2


def loop_state_name(rank: int) -> str:
    return f"loop_state_rank{rank}.json"


def save(accelerator, run_dir: Path, loop_state: dict) -> Path:
    """runs/<run>/checkpoints/step_<N>/ with save_state and loop_state_rank<R>.json; keeps the latest two. Refused
    before writing when the disk cannot hold it; a failure while writing removes the .partial (on every rank that
    sees it, its own or a peer's) and ends in one line naming the folder."""
    checkpoints = Path(run_dir) / "checkpoints"
    directory = checkpoints / f"step_{loop_state['step']:08d}"
    partial = checkpoints / f".{directory.name}.partial"
    needed = state_bytes(accelerator)
    try:
        checkpoints.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(checkpoints).free
        if free < needed:
            raise OSError(errno.ENOSPC, "not enough free space before writing")
        accelerator.save_state(str(partial))
        state = {**loop_state, "world_size": accelerator.num_processes}
        (partial / loop_state_name(accelerator.process_index)).write_text(json.dumps(state))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            if directory.exists():  # left by an earlier part of the run (an interrupt saved at this step)
                shutil.rmtree(directory)
            partial.rename(directory)
            for old in sorted(checkpoints.glob("step_*"))[:-KEEP_CHECKPOINTS]:
                shutil.rmtree(old)
        accelerator.wait_for_everyone()
    except BaseException as error:
        shutil.rmtree(partial, ignore_errors=True)
        if not isinstance(error, Exception) or lost_a_peer(error):  # a peer's failure: the run names it
            raise
        raise save_failed(error, directory, needed) from error
    return directory


def save_failed(error: BaseException, directory: Path, needed: int) -> Fault:
    """The one line of a save that failed: a full disk names the folder and the bytes needed."""
    folder = directory.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    if disk_full(error) or (free is not None and free < needed):
        have = f", {free / GIB:.2f} GiB free there" if free is not None else ""
        return Fault(
            f"no space left on the disk of {folder} for checkpoint {directory.name}: it needs about "
            f"{needed / GIB:.2f} GiB{have}; free some space, point the output folder (--output-dir; trainscope.Run's output_dir=) at a larger "
            "disk or save less often (--save-every; save_every=); the partial checkpoint was removed"
        )
    return Fault(
        f"checkpoint {directory.name} could not be written in {folder}: {one_line(error)}; the partial "
        "checkpoint was removed"
    )


def disk_full(error: BaseException) -> bool:
    """ENOSPC, however the writer reported it: an OSError, safetensors' 'No space left on device' (os error 28)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(error)
        if "No space left on device" in text or "os error 28" in text or "StorageFull" in text:
            return True
        error = error.__cause__ or error.__context__
    return False


def state_bytes(accelerator) -> int:
    """About what a checkpoint of this rank's state takes on disk: parameters, buffers and optimizer state
    (local shards under FSDP), read from the tensors' sizes without touching their data."""
    import torch

    tensors = []
    for model in accelerator._models:
        tensors += [*model.parameters(), *model.buffers()]
    for optimizer in accelerator._optimizers:
        for state in getattr(optimizer, "optimizer", optimizer).state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
    from trainscope.measure.memory import local_bytes  # deferred: it loads torch

    unique = {id(t): t for t in tensors}
    return sum(local_bytes(t) for t in unique.values())  # a DTensor's numel() is the whole tensor's


# ---------------------------------------------------------------- choosing one on --resume


def problem(directory: Path) -> str | None:
    """Why a checkpoint folder cannot be resumed from (a part missing or unreadable), or None when it can."""
    states = {}
    for path in sorted(directory.glob("loop_state_rank*.json")):
        try:
            states[int(path.stem.removeprefix("loop_state_rank"))] = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            return f"{path.name} is unreadable ({one_line(error)})"
    if not states:
        return "it has no loop_state_rank*.json"
    world = max((state.get("world_size", 0) for state in states.values() if isinstance(state, dict)), default=0)
    for rank in range(world or len(states)):
        state = states.get(rank)
        if state is None:
            return f"{loop_state_name(rank)} (rank {rank}'s part) is missing"
        if not isinstance(state, dict) or "step" not in state:
            return f"{loop_state_name(rank)} has no step"
        if not (directory / f"random_states_{rank}.pkl").exists():
            return f"random_states_{rank}.pkl (rank {rank}'s random state) is missing"
    if len({state["step"] for state in states.values() if isinstance(state, dict)}) > 1:
        return "its ranks' parts are of different steps"
    if not any(directory.glob("model*.safetensors")) and not any(directory.glob("pytorch_model*")):
        return "it has no model weights"
    if not any(directory.glob("optimizer*")):
        return "it has no optimizer state"
    for path in sorted(directory.iterdir()):
        trouble = _unreadable(path)
        if trouble:
            return f"{path.name} is unreadable ({trouble})"
    return None


def _unreadable(path: Path) -> str | None:
    """A cheap look at one file: the safetensors header covers the file; torch.save's zip has its directory."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt"):
                pass
        elif path.suffix in (".bin", ".pkl", ".pt") and path.is_file():
            with zipfile.ZipFile(path) as archive:
                size = path.stat().st_size
                if any(info.header_offset + info.compress_size > size for info in archive.infolist()):
                    return "truncated"
        elif path.is_dir() and path.name.startswith(("pytorch_model_fsdp", "optimizer")):
            if not (path / ".metadata").exists():  # torch.distributed.checkpoint's index of the shards
                return "its .metadata is missing"
    except Exception as error:
        return one_line(error)
    return None


def world_size_of(directory: Path) -> int:
    """How many processes wrote a checkpoint (its loop states say so; older ones: how many there are)."""
    states = [json.loads(p.read_text()) for p in directory.glob("loop_state_rank*.json")]
    return max((s.get("world_size", 0) for s in states), default=0) or len(states)


def choose(run_dir: Path, processes: int) -> tuple[Path, list[dict]]:
    """The latest usable checkpoint of `run_dir` and the newer ones skipped ({checkpoint, problem}).
    UserError when none is usable, or when it was written by another number of processes."""
    folder = Path(run_dir) / "checkpoints"
    candidates = sorted(folder.glob("step_*"), reverse=True) if folder.is_dir() else []
    if not candidates:
        raise UserError(f"--resume: {run_dir} has no checkpoint (was it run with --save-every, or save_every=?)")
    skipped = []
    for directory in candidates:
        trouble = problem(directory)
        if trouble is None:
            break
        skipped.append({"checkpoint": directory.name, "problem": trouble})
    else:
        reasons = "; ".join(f"{s['checkpoint']}: {s['problem']}" for s in skipped)
        raise UserError(
            f"--resume: no usable checkpoint in {folder} ({reasons}); start the run again with --overwrite "
            "(trainscope.Run: overwrite=True)"
        )
    written_by = world_size_of(directory)
    if written_by != processes:
        raise UserError(
            f"--resume: {directory.name} was written by {written_by} process{'es' * (written_by != 1)} and this launch "
            f"has {processes}: resume with {written_by} (the data order and the learning-rate schedule depend on the "
            "number of processes), or start a new run"
        )
    return directory, skipped


def remove_unusable(run_dir: Path, skipped: list[dict]) -> None:
    """Remove the checkpoints found unusable and any .partial a killed save left (the main process, once)."""
    folder = Path(run_dir) / "checkpoints"
    for entry in skipped:
        shutil.rmtree(folder / entry["checkpoint"], ignore_errors=True)
    for leftover in folder.glob(".step_*.partial"):
        shutil.rmtree(leftover, ignore_errors=True)


def load(accelerator, directory: Path) -> dict:
    """Restore a checkpoint chosen by `choose`; returns this rank's loop state with the checkpoint's name."""
    try:
        accelerator.load_state(str(directory))
        loop_state = json.loads((directory / loop_state_name(accelerator.process_index)).read_text())
    except Exception as error:  # a model or optimizer of another shape, a file that changed since the check
        raise UserError(
            f"--resume: {directory.name} cannot be loaded into this run ({one_line(error)[:300]}): resume "
            "with the settings it was written with (--model, --lora, the config; in your own loop, its model)"
        ) from None
    accelerator.print(f"resuming {Path(directory).parent.parent.name} from {directory.name}")
    return {**loop_state, "checkpoint": directory.name}
