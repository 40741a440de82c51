"""The one metrics component of a training run: train.py calls it, and every measurement lives here.

It owns the stage timer, the loop's counters, the profiler and memory snapshot windows, the run
record, the trackers, the step lines, the health warnings and the summary with its end-of-run
table. A new measurement (a block of the summary, a warning, a column of the step line) goes here
or into a module this one calls, never into train.py.

    metrics = RunMetrics(accelerator, launch, plan, model_config, scheduler)
    metrics.open(model_facts, data.record_facts(), model)
    metrics.start()
    ... with metrics.stage("data"): ...; train_step(..., metrics.stage, ...); metrics.micro_batch(...)
    result = metrics.finish(test_scores)      # or metrics.fail(error) on the way out
"""

import contextlib
from dataclasses import asdict

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from trainscope import checkpoints, communication, environment, health, modeling, provenance, summary, trackers
from trainscope.data import dropped_rows_lines
from trainscope.distributed import shut_down
from trainscope.errors import one_line
from trainscope.flops import mfu, training_flops
from trainscope.loop import LoopState
from trainscope.memory import GIB, peak_rss_bytes
from trainscope.precision import SkippedSteps, effective_precision
from trainscope.profiling import build_memory_snapshot, build_profiler
from trainscope.records import RunRecord, now_iso, read_record
from trainscope.timing import STAGES, StageTimer, make_clock


class NonFiniteLoss(RuntimeError):
    pass


class RunMetrics:
    def __init__(self, accelerator, launch, plan: dict, model_config, scheduler):
        self.accelerator, self.launch, self.plan, self.scheduler = accelerator, launch, plan, scheduler
        self.settings, self.run_dir = launch.settings, launch.run_dir
        self.model_config = model_config  # taken before prepare() wraps the model (DDP, FSDP, compile)
        device, rank = accelerator.device, accelerator.process_index
        clock, self.timing_mode = make_clock(self.settings.timing, device)
        self.profiler = build_profiler(self.settings, self.run_dir, device, rank)
        self.snapshot = build_memory_snapshot(self.settings, self.run_dir, device, rank)
        self.timer = StageTimer(clock, device, profiler_labels=self.profiler.enabled)
        self.stage = self.timer  # `with metrics.stage("forward"): ...`
        self.skips = SkippedSteps(accelerator.scaler, device)
        self.record = RunRecord(self.run_dir) if accelerator.is_main_process else None
        self.loop = LoopState(device)
        self.communication = communication.NoCommunication()
        self.env, self.progress, self._last_loss, self._graphs_after_first_step = {}, None, None, None
        self._evaluation_graphs = 0  # torch.compile graphs made for evaluation (eval mode): not recompiles

    # ---------------------------------------------------------------- opening

    def open(self, model_facts: dict, data_facts: dict, model=None) -> None:
        """Resume if asked, write the record's header, start trackers and the progress bar."""
        resumed = checkpoints.load_latest(self.accelerator, self.run_dir) if self.settings.resume else None
        self.loop = LoopState(self.accelerator.device, resumed)
        if resumed:
            self.timer.restore(resumed["timer"])
        self.communication = communication.build(self.settings, self.accelerator, model, self.plan["optimizer_steps"])
        self.env = {**environment.describe(self.accelerator, effective_precision(self.accelerator), self.launch.threads),
                    "timing_mode": self.timing_mode, **self.launch.environment_facts(),
                    "ddp": self.communication.settings_in_effect()}
        if self.env["requested_precision"] not in ("no", self.env["effective_precision"]):
            self.accelerator.print(f"warning: {self.env['requested_precision']} was requested but "
                                   f"{self.accelerator.device.type} runs {self.env['effective_precision']}; "
                                   f"recorded as {self.env['effective_precision']}")
        names = trackers.trackers_for(self.settings.report_to)
        init_kwargs, tracker_facts = trackers.init_kwargs(names, self.run_dir.name, self.run_dir,
                                                          self.settings.tracker_group)
        if self.record:
            self._write_header(resumed, model_facts, data_facts, tracker_facts)
            for line in dropped_rows_lines(data_facts.get("dropped_rows") or {}):
                print(line, flush=True)
        if names:
            self.accelerator.init_trackers("trainscope", config=trackers.flat_config(asdict(self.settings)),
                                           init_kwargs=init_kwargs)
        self.progress = tqdm(total=self.plan["optimizer_steps"], initial=self.loop.step, desc="training",
                             unit="step", disable=not self.accelerator.is_local_main_process)

    def _write_header(self, resumed, model_facts, data_facts, tracker_facts) -> None:
        if resumed:
            self.record.data = read_record(self.run_dir)
            self.record.truncate_steps(after_step=resumed["step"])
        self.record.update(
            run_name=self.run_dir.name, status="running", created=self.record.data.get("created", now_iso()),
            settings=asdict(self.settings), environment=self.env, provenance=provenance.collect(),
            model=model_facts, data=data_facts, trackers=tracker_facts, plan=self.plan,
            resumed_from=self.record.data.get("resumed_from", []) + ([resumed["checkpoint"]] if resumed else []),
        )

    # ---------------------------------------------------------------- the loop

    def start(self) -> None:
        self.timer.start()
        self.timer.set_phase("steady" if self.loop.step >= self.settings.timing_warmup_steps else "warmup")
        self.timer.set_memory_sampling(self._samples_memory(self.loop.step + 1))
        self.snapshot.step_finished(self.loop.step)

    @property
    def done(self) -> bool:
        return self.loop.step >= self.plan["optimizer_steps"]

    def calibration(self):
        """The communication calibration for the coming micro-batch, or None (see trainscope.communication)."""
        return self.communication.calibration_for(self.loop.step + 1, self.timer.phase)

    def micro_batch(self, batch: dict, loss, labels) -> bool:
        """Count one trained micro-batch; True when it completed an optimizer step."""
        phase = self.timer.phase
        flops = training_flops(self.model_config, *batch["input_ids"].shape)  # from shapes: no sync
        self.loop.add_micro_batch(phase, loss, labels, batch["attention_mask"], flops)
        if not self.accelerator.sync_gradients:
            return False
        self.loop.end_step(phase)
        step = self.loop.step
        self.profiler.step()
        self.snapshot.step_finished(step)
        self.progress.update(1)
        if step == 1 and self.settings.compile:
            self._graphs_after_first_step = modeling.compile_stats()["graphs"]
        if step % self.settings.log_every == 0 or self.done:
            self._log_step()
        if step == self.settings.timing_warmup_steps:
            self.timer.set_phase("steady")
        self.timer.set_memory_sampling(self._samples_memory(step + 1))
        return True

    def _samples_memory(self, step: int) -> bool:
        return step == 1 or step % self.settings.memory_every == 0

    def checkpoint_due(self) -> bool:
        every = self.settings.save_every
        return bool(every) and self.loop.step % every == 0 and not self.done

    def save_checkpoint(self) -> None:
        self.loop.skipped_steps = self._skipped_total()
        checkpoints.save(self.accelerator, self.run_dir, {**self.loop.checkpoint(), "timer": self.timer.state_dict()})

    def _skipped_total(self) -> int:
        return self.loop.skipped_steps + self.skips.total()  # a sync point: log steps and checkpoints only

    def _log_step(self) -> None:
        """One step line: mean loss over the interval and all ranks; this rank's stage seconds and TFLOP/s,
        all over the timer's one clock."""
        interval, timing = self.loop.take_interval(), self.timer.take_interval()
        world = self.accelerator.num_processes
        # Gathered before any check, so every rank sees the same losses and stops together.
        gathered = self.accelerator.gather(torch.stack(interval["losses"]).float()).view(world, -1)
        finite = torch.isfinite(gathered).all(dim=0)
        if not bool(finite.all()):  # sync point (log steps only)
            first = int((~finite).nonzero()[0])
            raise NonFiniteLoss(
                f"loss became {gathered[:, first].tolist()} at optimizer step "
                f"{self.loop.step - len(interval['losses']) + first + 1}: lower --learning-rate, keep "
                "--max-grad-norm, or use bf16 instead of fp16")
        self._last_loss = gathered.mean().item()
        wall = timing["wall_s"]
        line = {"step": self.loop.step, "epoch": self.loop.epoch, "loss": self._last_loss,
                "lr": self.scheduler.get_last_lr()[0], "micro_batches": len(interval["losses"]),
                "samples": interval["samples"] * world,
                "tokens": self.accelerator.reduce(interval["tokens"], reduction="sum").item(),
                "stage_s": timing["stage_s"], "wall_s": wall, "skipped_steps": self._skipped_total(),
                "tflops_per_device": interval["flops"] / wall / 1e12 if interval["flops"] and wall > 0 else None,
                "time": now_iso()}
        if self.record:
            self.record.append_step(line)
        self.accelerator.log({"train/loss": line["loss"], "train/lr": line["lr"]}, step=self.loop.step)
        self.progress.set_postfix(loss=f"{line['loss']:.4f}")

    @contextlib.contextmanager
    def evaluation(self):
        """The `eval` stage; with --compile, graphs compiled in it (eval mode) are told apart from recompiles."""
        before = modeling.compile_stats()["graphs"] if self.settings.compile else 0
        with self.stage("eval"):
            yield
        if self.settings.compile:
            self._evaluation_graphs += modeling.compile_stats()["graphs"] - before

    def validation(self, epoch: int, scores: dict) -> None:
        self.loop.evaluations.append({"epoch": epoch, "step": self.loop.step, **scores})
        self.accelerator.log({f"validation/{k}": v for k, v in scores.items()}, step=self.loop.step)

    # ---------------------------------------------------------------- the end

    def fail(self, error: BaseException) -> None:
        """Mark the run failed with the error's one line, end trackers and the process group. Out of memory
        gets a note naming the batch size and what to try (the user's one line)."""
        if isinstance(error, torch.OutOfMemoryError):
            error.add_note(f"out of memory at --per-device-batch-size {self.settings.per_device_batch_size} (step "
                           f"{self.loop.step + 1}): halve it and double --gradient-accumulation-steps, or add "
                           "--gradient-checkpointing, a bf16/fp16 config or --lora")
        if self.progress is not None:
            self.progress.close()
        if self.record and self.record.path.exists():
            self.record.update(status="failed", finished=now_iso(), error=one_line(error))
        shut_down(self.accelerator, wait=False)

    def finish(self, test_scores: dict) -> dict:
        """Stop the clocks, gather every rank, write the summary and warnings, print the table."""
        self.timer.stop()
        self.progress.close()
        snapshot = self.snapshot.finish(self.loop.step)
        self.loop.finish()
        self.loop.skipped_steps = self._skipped_total()
        per_rank = gather_object([self._rank_summary()])
        result = self._summary(per_rank, test_scores, snapshot)
        warnings = health.check({"settings": asdict(self.settings), "environment": self.env, "summary": result})
        if self.record:
            self.record.update(status="complete", finished=now_iso(), summary=result, warnings=warnings)
            print("\n".join(table_lines(result, self.env, self.run_dir, warnings)), flush=True)
        shut_down(self.accelerator)
        return result

    def _rank_summary(self) -> dict:
        return {"rank": self.accelerator.process_index, "timing": self.timer.summary(), "counts": self.loop.counts,
                "memory": {**self.timer.memory_summary(), "peak_rss_gib": peak_rss_bytes() / GIB},
                "communication": self.communication.rank_summary(self.loop.counts)}

    def _summary(self, per_rank: list[dict], test_scores: dict, snapshot: dict | None) -> dict:
        phase = "steady" if self.loop.counts["steady"]["optimizer_steps"] else "warmup"
        throughput = summary.throughput(per_rank, phase)
        return {
            "world_size": self.accelerator.num_processes,
            "optimizer_steps": self.loop.step,
            "skipped_steps": self.loop.skipped_steps,
            "timing": {"mode": self.timing_mode, "warmup_steps": min(self.settings.timing_warmup_steps, self.loop.step),
                       "across_ranks": {p: summary.combine_ranks(per_rank, p) for p in ("run", "steady", "warmup")},
                       "per_rank": per_rank},
            "throughput": throughput,
            "mfu": mfu(throughput["tflops_per_device"], self.env["device_name"], self.env["effective_precision"]),
            "memory": summary.memory_across_ranks(per_rank),
            "validation": self.loop.evaluations,
            "test": test_scores,
            "final_train_loss": self._last_loss,
            "wall_s": per_rank[0]["timing"]["run"]["wall_s"],
            "profile": ({"directory": str(self.run_dir / "profile"), "window": self.profiler.window,
                         "top_operators": self.profiler.top_operators} if self.profiler.enabled else None),
            "memory_snapshot": snapshot,
            "compile": self._compile_summary(),
            "communication": communication.combine(per_rank, throughput),
        }

    def _compile_summary(self) -> dict | None:
        if not self.settings.compile:
            return None
        stats = modeling.compile_stats()
        first = self._graphs_after_first_step
        return {"dynamic": not self.settings.pad_to_max_length, "compile_s": stats["compile_s"],
                "graphs": stats["graphs"], "graphs_after_first_step": first, "evaluation_graphs": self._evaluation_graphs,
                "recompiles": max(0, stats["graphs"] - first - self._evaluation_graphs) if first is not None else None}


def table_lines(result: dict, env: dict, run_dir, warnings: list[dict]) -> list[str]:
    """The end-of-run table: stages (median / max over ranks), throughput, MFU, memory, accuracy, warnings."""
    run = result["timing"]["across_ranks"]["run"]
    several = result["world_size"] > 1
    rows = [f"{'stage':<10} {'seconds':>9} {'share':>7}" + ("  (median / max over ranks)" if several else "")]
    for stage in (*STAGES, "other"):
        seconds, share = run["seconds"][stage], run["shares"][stage]
        rows.append(f"{stage:<10} {seconds['median']:>9.2f} {share['median']:>7.1%}"
                    + (f"  max {seconds['max']:.2f}s" if several else ""))
    rows.append(f"{'wall':<10} {run['wall_s']['median']:>9.2f}")
    throughput, test = result["throughput"], result["test"]
    peak, kind = summary.peak_memory(result["memory"])
    threads = env["threads"]
    rows += [
        f"throughput {throughput['samples_per_s']:.1f} samples/s, {throughput['tokens_per_s']:.0f} tokens/s "
        f"({env['world_size']} x {env['device_name']}, {env['effective_precision']}, timing: {env['timing_mode']}, "
        f"{threads['torch_threads']} threads per process ({threads['threads_source']}))",
        f"model FLOPs {throughput['tflops_per_device'] or 0:.3f} TFLOP/s per device, MFU "
        + (f"{result['mfu']:.1%}" if result["mfu"] is not None else f"unknown (no peak for {env['device_name']})"),
        f"peak memory {peak:.2f} GiB ({kind})",
        f"test accuracy {test['accuracy']:.4f}, macro-F1 {test['macro_f1']:.4f}",
        *communication.table_lines(result.get("communication")),
        f"record: {run_dir / 'record.json'}",
    ]
    if result["profile"]:
        rows.append(f"profile: {result['profile']['directory']} (tensorboard --logdir, or open a .pt.trace.json "
                    "in ui.perfetto.dev); top operators by self time:")
        for op in result["profile"]["top_operators"][:8]:
            seconds = op["self_device_s"] if op["self_device_s"] is not None else op["self_cpu_s"]
            rows.append(f"  {seconds * 1e3:9.2f} ms  {op['calls']:6d}x  {op['name']}")
    rows += [f"warning [{w['code']}]: {w['message']}" for w in warnings]
    return rows
