"""Fine-tune a transformer text classifier and measure where the time and memory go.

The same script runs on a CPU, one GPU, several GPUs (DDP, FSDP) and in fp16/bf16; only the
Accelerate config changes:

    python train.py                                    # embedded MiniLM-L6 on the embedded tweets
    accelerate launch --config_file accelerate_configs/ddp_fp16.yaml train.py --model roberta-base --dataset glue/sst2

Every run writes runs/<run-name>/record.json (settings, environment, stage timing per rank,
throughput, memory, accuracy) and steps.jsonl; docs/RECORD.md describes them.
"""

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import evaluate
import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import (ProjectConfiguration, TorchDynamoPlugin, broadcast_object_list, gather_object,
                             parse_flag_from_env, set_seed)
from tqdm.auto import tqdm
from transformers import get_scheduler

from trainscope import environment, summary, trackers
from trainscope.data import build_dataloaders, load_classification_data, redact_url
from trainscope.distributed import settle_collectives
from trainscope.errors import UserError, exit_with
from trainscope.flops import mfu, training_flops
from trainscope.loop import LoopState, train_step
from trainscope.memory import GIB, peak_rss_bytes
from trainscope.modeling import build_model, build_optimizer, build_tokenizer
from trainscope.profiling import build_profiler
from trainscope.records import RunRecord, now_iso, read_steps
from trainscope.settings import Settings, parse_settings
from trainscope.timing import STAGES, StageTimer, make_clock

METRIC_MODULE = str(Path(__file__).parent / "trainscope" / "metrics" / "classification")
KEEP_CHECKPOINTS = 2


class NonFiniteLoss(RuntimeError):
    pass


def main(argv: list[str] | None = None) -> None:
    (settings,) = parse_settings(argv=argv, description=__doc__)
    try:
        train(settings)
    except UserError as error:
        exit_with(error, code=2)
    except (NonFiniteLoss, torch.OutOfMemoryError) as error:
        exit_with(error, code=1)


def train(settings: Settings) -> dict:
    # ---------------------------------------------------------------- launch and settings
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))  # as Accelerator() reads it
    environment.refuse_independent_runs(state.num_processes)
    set_seed(settings.seed)
    torch.backends.cuda.matmul.allow_tf32 = settings.tf32
    torch.backends.cudnn.allow_tf32 = settings.tf32
    run_dir = resolve_run_dir(settings, state)

    # ---------------------------------------------------------------- data and model
    tokenizer = build_tokenizer(settings)
    data = load_classification_data(settings, tokenizer, state.main_process_first)
    train_batches = math.ceil(len(data.train) / settings.per_device_batch_size)
    if train_batches < state.num_processes:
        raise UserError(
            f"{len(data.train)} training rows make {train_batches} batches of {settings.per_device_batch_size}, "
            f"fewer than the {state.num_processes} processes: lower --per-device-batch-size or use more data"
        )
    model, model_facts = build_model(settings, data.label_names, tokenizer)

    # ---------------------------------------------------------------- accelerator
    tracker_names = trackers.trackers_for(settings.report_to)
    on_cuda = state.device.type == "cuda"
    pin_memory = on_cuda if settings.pin_memory is None else settings.pin_memory
    accelerator = Accelerator(
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        log_with=tracker_names or None,
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "tensorboard")),
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=settings.seed, non_blocking=pin_memory
        ),
        dynamo_plugin=TorchDynamoPlugin(backend="inductor") if settings.compile else None,
    )
    precision = environment.effective_precision(accelerator)
    if accelerator.mixed_precision not in ("no", precision):
        accelerator.print(
            f"warning: {accelerator.mixed_precision} was requested but {accelerator.device.type} runs {precision}; "
            f"recorded as {precision}"
        )

    train_loader, validation_loader, test_loader = build_dataloaders(
        data, tokenizer, settings, pin_memory=pin_memory,
        pad_to_multiple_of=8 if on_cuda and precision in ("fp16", "bf16") else None,
    )
    optimizer = build_optimizer(model, settings, accelerator.device)
    steps_per_epoch = math.ceil(
        math.ceil(len(data.train) / (settings.per_device_batch_size * accelerator.num_processes))
        / settings.gradient_accumulation_steps
    )
    total_steps = settings.max_steps or settings.epochs * steps_per_epoch
    epochs = math.ceil(total_steps / steps_per_epoch)
    # Accelerate steps a prepared scheduler once per process for every optimizer step.
    scheduler = get_scheduler(
        settings.lr_scheduler, optimizer,
        num_warmup_steps=int(settings.warmup_fraction * total_steps) * accelerator.num_processes,
        num_training_steps=total_steps * accelerator.num_processes,
    )
    model_config = model.config  # before prepare() wraps it (DDP, FSDP, compile)
    model, optimizer, train_loader, validation_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, validation_loader, test_loader, scheduler
    )
    metric = evaluate.load(METRIC_MODULE)

    # ---------------------------------------------------------------- run record and trackers
    record = RunRecord(run_dir) if accelerator.is_main_process else None
    resumed = load_checkpoint(accelerator, run_dir, record) if settings.resume else None
    recorded_settings = {**asdict(settings), "dataset": redact_url(settings.dataset), "model": redact_url(settings.model)}
    init_kwargs, tracker_facts = trackers.init_kwargs(tracker_names, run_dir.name, run_dir)
    env = environment.describe(accelerator, precision)
    clock, timing_mode = make_clock(settings.timing, accelerator.device)
    env["timing_mode"] = timing_mode
    if record:
        record.update(
            run_name=run_dir.name, status="running", created=record.data.get("created", now_iso()),
            settings=recorded_settings, environment=env, model=model_facts,
            data={"labels": data.label_names, "text_columns": data.text_columns,
                  "label_column": data.label_column, **data.provenance},
            trackers=tracker_facts, plan={"optimizer_steps": total_steps, "steps_per_epoch": steps_per_epoch,
                                          "epochs": epochs, "global_batch_size": settings.per_device_batch_size
                                          * accelerator.num_processes * settings.gradient_accumulation_steps},
            resumed_from=record.data.get("resumed_from", []) + ([resumed["checkpoint"]] if resumed else []),
        )
    if tracker_names:
        accelerator.init_trackers("trainscope", config=trackers.flat_config(recorded_settings),
                                  init_kwargs=init_kwargs)

    # ---------------------------------------------------------------- the timed loop
    profiler = build_profiler(settings, run_dir, accelerator.device, accelerator.process_index)
    timer = StageTimer(clock, accelerator.device, profiler_labels=profiler.enabled)
    state = LoopState(accelerator.device, resumed)
    if resumed:
        timer.restore(resumed["timer"])
    progress = tqdm(total=total_steps, initial=state.step, desc="training", unit="step",
                    disable=not accelerator.is_local_main_process)
    model.train()
    timer.start()
    timer.set_phase("steady" if state.step >= settings.timing_warmup_steps else "warmup")
    try:
        with profiler:
            for epoch in range(state.epoch, epochs):
                skip = state.start_epoch(epoch)
                train_loader.set_epoch(epoch)
                batches = iter(accelerator.skip_first_batches(train_loader, skip) if skip else train_loader)
                while state.step < total_steps:
                    with timer("data"):
                        batch = next(batches, None)
                    if batch is None:
                        break
                    phase = timer.phase
                    flops = training_flops(model_config, *batch["input_ids"].shape)  # from shapes: no sync
                    loss, labels = train_step(accelerator, model, batch, optimizer, scheduler, timer,
                                              settings.max_grad_norm)
                    state.add_micro_batch(phase, loss, labels, batch["attention_mask"], flops)
                    if not accelerator.sync_gradients:
                        continue
                    state.end_step(phase, optimizer.step_was_skipped)
                    profiler.step()
                    progress.update(1)
                    last_step = state.step == total_steps
                    if state.step % settings.log_every == 0 or last_step:
                        line = log_step(accelerator, timer, state, scheduler.get_last_lr()[0])
                        progress.set_postfix(loss=f"{line['loss']:.4f}")
                        if record:
                            record.append_step(line)
                        accelerator.log({"train/loss": line["loss"], "train/lr": line["lr"]}, step=state.step)
                    if state.step == settings.timing_warmup_steps:
                        timer.set_phase("steady")
                    if settings.save_every and state.step % settings.save_every == 0 and not last_step:
                        save_checkpoint(accelerator, run_dir, timer, state.checkpoint())
                with timer("eval"):
                    scores = evaluate_split(model, validation_loader, accelerator, metric)
                state.evaluations.append({"epoch": epoch, "step": state.step, **scores})
                accelerator.log({f"validation/{k}": v for k, v in scores.items()}, step=state.step)
                if state.step >= total_steps:
                    break
            with timer("eval"):
                test_scores = evaluate_split(model, test_loader, accelerator, metric)
            timer.stop()
        snapshot = profiler.save_memory_snapshot()
    except torch.OutOfMemoryError:
        fail(record, accelerator, f"out of memory at --per-device-batch-size {settings.per_device_batch_size} "
             f"(step {state.step + 1}): halve it and double --gradient-accumulation-steps, or add "
             "--gradient-checkpointing, a bf16/fp16 config or --lora", torch.OutOfMemoryError)
    except NonFiniteLoss as error:
        fail(record, accelerator, str(error), NonFiniteLoss)
    finally:
        progress.close()

    # ---------------------------------------------------------------- results
    state.finish()
    rank_summary = {
        "rank": accelerator.process_index,
        "timing": timer.summary(),
        "counts": state.counts,
        "memory": {**timer.memory_summary(), "peak_rss_gib": peak_rss_bytes() / GIB},
    }
    per_rank = gather_object([rank_summary])
    throughput = summary.throughput(per_rank, "steady" if state.counts["steady"]["optimizer_steps"] else "warmup")
    result = {
        "world_size": accelerator.num_processes,
        "optimizer_steps": state.step,
        "skipped_steps": state.skipped_steps,
        "timing": {
            "mode": timing_mode,
            "warmup_steps": min(settings.timing_warmup_steps, state.step),
            "across_ranks": {phase: summary.combine_ranks(per_rank, phase) for phase in ("run", "steady", "warmup")},
            "per_rank": per_rank,
        },
        "throughput": throughput,
        "mfu": mfu(throughput["tflops_per_device"], env["device_name"], precision),
        "memory": summary.memory_across_ranks(per_rank),
        "validation": state.evaluations,
        "test": test_scores,
        "final_train_loss": last_logged_loss(record),
        "wall_s": per_rank[0]["timing"]["run"]["wall_s"],
        "profile": {"directory": str(run_dir / "profile"), "top_operators": profiler.top_operators,
                    "memory_snapshot": str(snapshot) if snapshot else None} if profiler.enabled else None,
    }
    if record:
        record.update(status="complete", finished=now_iso(), summary=result)
        print_table(result, env, run_dir)
    shut_down(accelerator)
    return result


# ---------------------------------------------------------------- helpers


def resolve_run_dir(settings: Settings, state: PartialState) -> Path:
    """runs/<run-name>, named the same on every process, checked (not created) before any work."""
    name = settings.run_name
    if name is None:
        stamp = [datetime.now().strftime("%Y%m%d-%H%M%S")]
        broadcast_object_list(stamp)  # the main process's clock names the run for everybody
        model = settings.model.rstrip("/").split("/")[-1].split(":")[-1]
        dataset = settings.dataset.rstrip("/").split("/")[-1].split(":")[-1].split(".")[0]
        precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").replace("no", "fp32")
        name = f"{model}-{dataset}-{precision}-{state.num_processes}p-{stamp[0]}"
    run_dir = Path(settings.output_dir) / name
    if settings.resume:
        if not (run_dir / "checkpoints").is_dir() or not any((run_dir / "checkpoints").iterdir()):
            raise UserError(f"--resume: {run_dir} has no checkpoint (was it run with --save-every?)")
    elif run_dir.exists():
        if not settings.overwrite:
            raise UserError(f"{run_dir} already exists: pass --overwrite, --resume or another --run-name")
        state.wait_for_everyone()
        if state.is_main_process:
            shutil.rmtree(run_dir)
    return run_dir


def log_step(accelerator, timer, state: LoopState, lr: float) -> dict:
    """One step line: mean loss over the interval and all ranks; this rank's stage seconds and TFLOP/s."""
    interval = state.take_interval()
    losses = interval["losses"]
    # Gathered before any check, so every rank sees the same losses and stops together.
    gathered = accelerator.gather(torch.stack(losses).float()).view(accelerator.num_processes, -1)
    finite = torch.isfinite(gathered).all(dim=0)
    if not bool(finite.all()):  # sync point (log steps only)
        first = int((~finite).nonzero()[0])
        raise NonFiniteLoss(
            f"loss became {gathered[:, first].tolist()} at optimizer step {state.step - len(losses) + first + 1}: "
            "lower --learning-rate, keep --max-grad-norm, or use bf16 instead of fp16"
        )
    stage_seconds = timer.take_interval()
    return {"step": state.step, "epoch": state.epoch, "loss": gathered.mean().item(), "lr": lr,
            "micro_batches": len(losses), "samples": interval["samples"] * accelerator.num_processes,
            "tokens": accelerator.reduce(interval["tokens"], reduction="sum").item(),
            "stage_s": stage_seconds, "wall_s": interval["wall_s"],
            "tflops_per_device": interval["flops"] / interval["wall_s"] / 1e12 if interval["flops"] else None,
            "time": time.time()}


@torch.no_grad()
def evaluate_split(model, loader, accelerator, metric) -> dict:
    """Accuracy, macro-F1 and mean loss over a whole split, gathered from every process."""
    model.eval()
    loss_sum, count = torch.zeros((), device=accelerator.device), 0
    for batch in loader:
        labels = batch.pop("labels")
        logits = model(**batch).logits
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        predictions, references, losses = accelerator.gather_for_metrics((logits.argmax(-1), labels, losses))
        metric.add_batch(predictions=predictions.cpu(), references=references.cpu())
        loss_sum += losses.sum()
        count += losses.numel()
    model.train()
    return {**metric.compute(), "loss": loss_sum.item() / count}


def save_checkpoint(accelerator, run_dir: Path, timer: StageTimer, loop_state: dict) -> None:
    """Accelerate save_state, plus each rank's loop position and timing so far; keeps the latest two."""
    directory = run_dir / "checkpoints" / f"step_{loop_state['step']:08d}"
    accelerator.save_state(str(directory))
    loop_state = {**loop_state, "timer": timer.state_dict()}
    (directory / f"loop_state_rank{accelerator.process_index}.json").write_text(json.dumps(loop_state))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for old in sorted((run_dir / "checkpoints").glob("step_*"))[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old)


def load_checkpoint(accelerator, run_dir: Path, record: RunRecord | None) -> dict:
    directory = max((run_dir / "checkpoints").glob("step_*"))
    accelerator.load_state(str(directory))
    loop_state = json.loads((directory / f"loop_state_rank{accelerator.process_index}.json").read_text())
    if record:
        record.data = json.loads(record.path.read_text())
        record.truncate_steps(after_step=loop_state["step"])
    accelerator.print(f"resuming {run_dir.name} from {directory.name}")
    return {**loop_state, "checkpoint": directory.name}


def last_logged_loss(record: RunRecord | None) -> float | None:
    if record is None:
        return None
    steps = read_steps(record.directory)
    return steps[-1]["loss"] if steps else None


def shut_down(accelerator) -> None:
    """End trackers and the process group on every rank together (see trainscope.distributed)."""
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.num_processes > 1:
        settle_collectives()


def fail(record, accelerator, message: str, kind) -> None:
    if record:
        record.update(status="failed", finished=now_iso(), error=message)
    accelerator.end_training()
    if accelerator.num_processes > 1:
        settle_collectives()
    raise kind(message)


def print_table(result: dict, env: dict, run_dir: Path) -> None:
    run = result["timing"]["across_ranks"]["run"]
    rows = [f"{'stage':<10} {'seconds':>9} {'share':>7}" + ("  (median / max over ranks)" if result["world_size"] > 1 else "")]
    for stage in (*STAGES, "other"):
        seconds, share = run["seconds"][stage], run["shares"][stage]
        extra = f"  max {seconds['max']:.2f}s" if result["world_size"] > 1 else ""
        rows.append(f"{stage:<10} {seconds['median']:>9.2f} {share['median']:>7.1%}{extra}")
    rows.append(f"{'wall':<10} {run['wall_s']['median']:>9.2f}")
    throughput = result["throughput"]
    memory = result["memory"]
    peak = (f"{memory['max_allocated_gib']['max']:.2f} GiB allocated" if "max_allocated_gib" in memory
            else f"{memory['peak_rss_gib']['max']:.2f} GiB RSS")
    test = result["test"]
    rows += [
        f"throughput {throughput['samples_per_s']:.1f} samples/s, {throughput['tokens_per_s']:.0f} tokens/s "
        f"({env['world_size']} x {env['device_name']}, {env['effective_precision']}, timing: {env['timing_mode']})",
        f"model FLOPs {throughput['tflops_per_device'] or 0:.3f} TFLOP/s per device, MFU "
        + (f"{result['mfu']:.1%}" if result["mfu"] is not None else f"unknown (no peak for {env['device_name']})"),
        f"peak memory {peak}",
        f"test accuracy {test['accuracy']:.4f}, macro-F1 {test['macro_f1']:.4f}",
        f"record: {run_dir / 'record.json'}",
    ]
    if result["profile"]:
        rows.append(f"profile: {result['profile']['directory']} (tensorboard --logdir, or open a .pt.trace.json "
                    "in ui.perfetto.dev); top operators by self time:")
        for op in result["profile"]["top_operators"][:8]:
            seconds = op["self_device_s"] if op["self_device_s"] is not None else op["self_cpu_s"]
            rows.append(f"  {seconds * 1e3:9.2f} ms  {op['calls']:6d}x  {op['name']}")
    print("\n".join(rows), flush=True)


if __name__ == "__main__":
    sys.exit(main())
