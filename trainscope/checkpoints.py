"""Resumable checkpoints: Accelerate's save_state plus each rank's loop position and timing so far."""

import json
import shutil
from pathlib import Path

KEEP_CHECKPOINTS = 2


def save(accelerator, run_dir: Path, loop_state: dict) -> Path:
    """runs/<run>/checkpoints/step_<N>/ with save_state and loop_state_rank<R>.json; keeps the latest two.

    Written as .step_<N>.partial and renamed once every rank has written its part: a run killed while
    saving leaves no half checkpoint for --resume to load.
    """
    checkpoints = Path(run_dir) / "checkpoints"
    directory = checkpoints / f"step_{loop_state['step']:08d}"
    partial = checkpoints / f".{directory.name}.partial"
    accelerator.save_state(str(partial))
    (partial / f"loop_state_rank{accelerator.process_index}.json").write_text(json.dumps(loop_state))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        partial.rename(directory)
        for old in sorted(checkpoints.glob("step_*"))[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return directory


def load_latest(accelerator, run_dir: Path) -> dict:
    """Restore the latest checkpoint's state; returns this rank's loop state with the checkpoint's name."""
    directory = max((Path(run_dir) / "checkpoints").glob("step_*"))
    accelerator.load_state(str(directory))
    loop_state = json.loads((directory / f"loop_state_rank{accelerator.process_index}.json").read_text())
    accelerator.print(f"resuming {Path(run_dir).name} from {directory.name}")
    return {**loop_state, "checkpoint": directory.name}
