"""The one metrics component of a training run: it measures and summarizes, nothing else.

It owns the stage timer, the loop's counters, the communication measurement, the profiler and memory
snapshot windows, the content of the step lines, the summary with its health warnings, and the
end-of-run table. Writing the record, trackers, checkpoints, signals and the run's ending live beside
it in trainscope.lifecycle. A new measurement (a block of the summary, a column of the step line) goes
here or into a module this one calls, never into train.py.

    metrics = RunMetrics(accelerator, started, plan, model_config, scheduler, prediction)
    metrics.attach(model, optimizer)           # the communication measurement of a DDP model, the prediction's check
    metrics.start()
    ... with metrics.stage("data"): ...; train_step(..., metrics.stage, ...); metrics.micro_batch(...)
    result, warnings = metrics.summarize(test_scores)
"""

import contextlib
from dataclasses import asdict

import torch
from accelerate.utils import gather_object

from trainscope import communication, environment, health, modeling, predict, summary
from trainscope.flops import mfu, training_flops
from trainscope.loop import LoopState
from trainscope.memory import GIB, peak_rss_bytes
from trainscope.precision import SkippedSteps, effective_precision
from trainscope.profiling import build_memory_snapshot, build_profiler
from trainscope.record_view import RunView
from trainscope.records import now_iso
from trainscope.timing import PHASES, STAGES, StageTimer, make_clock


class NonFiniteLoss(RuntimeError):
    pass


class RunMetrics:
    def __init__(self, accelerator, started, plan: dict, model_config, scheduler, prediction: dict | None = None):
        self.accelerator, self.started, self.plan, self.scheduler = accelerator, started, plan, scheduler
        self.settings, self.run_dir = started.settings, started.run_dir
        self.model_config = model_config  # taken before prepare() wraps the model (DDP, FSDP, compile)
        device, rank = accelerator.device, accelerator.process_index
        clock, self.timing_mode = make_clock(self.settings.timing, device)
        self.profiler = build_profiler(self.settings, self.run_dir, device, rank)
        self.snapshot = build_memory_snapshot(self.settings, self.run_dir, device, rank)
        self.timer = StageTimer(clock, device, profiler_labels=self.profiler.enabled)
        self.stage = self.timer  # `with metrics.stage("forward"): ...`
        self.skips = SkippedSteps(accelerator.scaler, device)
        self.loop = LoopState(device)
        self.communication = communication.NoCommunication()
        self.evaluation_positions = {"tokens": 0, "padded_tokens": 0, "padded_squares": 0, "samples": 0}
        self.env: dict = {}
        self._last_loss, self._graphs_after_first_step = None, None
        self._evaluation_graphs = 0  # torch.compile graphs made for evaluation (eval mode): not recompiles
        self.prediction = predict.Check(prediction, self.settings)  # the measured side of each predicted term

    # ---------------------------------------------------------------- before the loop

    def attach(self, model, optimizer=None) -> None:
        """The communication measurement of the prepared model (a do-nothing one unless it is DDP), and the
        prediction's check of the model and optimizer."""
        self.communication = communication.build(self.settings, self.accelerator, model, self.plan["optimizer_steps"])
        self.prediction.attach(model, optimizer)

    def resume_from(self, resumed: dict | None) -> None:
        """Continue the counters and timing totals of a checkpointed part of the same run."""
        self.loop = LoopState(self.accelerator.device, resumed)
        if resumed:
            self.timer.restore(resumed["timer"])

    def environment(self) -> dict:
        """The record's environment block: what the run really ran on and in (read once, after attach)."""
        self.env = {**environment.describe(self.accelerator, effective_precision(self.accelerator), self.started.threads),
                    "timing_mode": self.timing_mode, **self.started.environment_facts(),
                    "ddp": self.communication.settings_in_effect()}
        return self.env

    def checkpoint_state(self) -> dict:
        """What a checkpoint keeps beside Accelerate's state: the loop's position and the timing so far."""
        self.loop.skipped_steps = self._skipped_total()
        return {**self.loop.checkpoint(), "timer": self.timer.state_dict()}

    # ---------------------------------------------------------------- the loop

    def start(self) -> None:
        self.timer.start()
        self.timer.set_phase(self._phase_for(self.loop.step + 1))
        self.timer.set_memory_sampling(self._samples_memory(self.loop.step + 1))
        self.snapshot.step_finished(self.loop.step)
        if self.loop.step == 0:
            self.prediction.first_micro_batch()

    @property
    def done(self) -> bool:
        return self.loop.step >= self.plan["optimizer_steps"]

    def calibration(self):
        """The communication calibration for the coming micro-batch, or None (see trainscope.communication)."""
        return self.communication.calibration_for(self.loop.step + 1)

    def micro_batch(self, batch: dict, loss, labels) -> bool:
        """Count one trained micro-batch; True when it completed an optimizer step."""
        phase = self.timer.phase
        flops = training_flops(self.model_config, *batch["input_ids"].shape)  # from shapes: no sync
        self.loop.add_micro_batch(phase, loss, labels, batch["attention_mask"], flops)
        self.prediction.micro_batch_done(batch, self.accelerator.sync_gradients)
        if not self.accelerator.sync_gradients:
            return False
        self.loop.end_step(phase)
        step = self.loop.step
        self.profiler.step()
        self.communication.step_ended(step)
        self.snapshot.step_finished(step)  # takes the snapshot at the end of its window (phase `snapshot`)
        if step == 1 and self.settings.compile:
            self._graphs_after_first_step = modeling.compile_stats()["graphs"]
        self.timer.set_phase(self._phase_for(step + 1))
        self.timer.set_memory_sampling(self._samples_memory(step + 1))
        return True

    def _phase_for(self, step: int) -> str:
        """warmup for the first --timing-warmup-steps, snapshot while a memory snapshot records, else steady."""
        if step <= self.settings.timing_warmup_steps:
            return "warmup"
        return "snapshot" if self.snapshot.covers(step) else "steady"

    def _samples_memory(self, step: int) -> bool:
        return step == 1 or step % self.settings.memory_every == 0

    @property
    def log_due(self) -> bool:
        return self.loop.step % self.settings.log_every == 0 or self.done

    def _skipped_total(self) -> int:
        return self.loop.skipped_steps + self.skips.total()  # a sync point: log steps and checkpoints only

    def step_line(self) -> dict:
        """One step line: mean loss over the interval and all ranks; this rank's stage seconds and TFLOP/s, all
        over the timer's one clock. A collective: every rank calls it at the same step."""
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
        return {"step": self.loop.step, "epoch": self.loop.epoch, "loss": self._last_loss,
                "lr": self.scheduler.get_last_lr()[0], "micro_batches": len(interval["losses"]),
                "samples": interval["samples"] * world,
                "tokens": self.accelerator.reduce(interval["tokens"], reduction="sum").item(),
                "stage_s": timing["stage_s"], "wall_s": wall, "skipped_steps": self._skipped_total(),
                "tflops_per_device": interval["flops"] / wall / 1e12 if interval["flops"] and wall > 0 else None,
                "time": now_iso()}

    @contextlib.contextmanager
    def evaluation(self):
        """The `eval` stage; with --compile, graphs compiled in it (eval mode) are told apart from recompiles."""
        before = modeling.compile_stats()["graphs"] if self.settings.compile else 0
        with self.stage("eval"):
            yield
        if self.settings.compile:
            self._evaluation_graphs += modeling.compile_stats()["graphs"] - before

    def evaluated(self, scores: dict) -> dict:
        """Fold an evaluation's token positions into the run's and return its scores."""
        for key, value in scores.pop("positions", {}).items():
            self.evaluation_positions[key] += value
        return scores

    def validation(self, epoch: int, scores: dict) -> dict:
        scores = self.evaluated(scores)
        self.loop.evaluations.append({"epoch": epoch, "step": self.loop.step, **scores})
        return scores

    # ---------------------------------------------------------------- the summary

    def summarize(self, test_scores: dict | None, partial: bool = False, gather: bool = True) -> tuple[dict, list]:
        """Stop the clocks and summarize: every rank's figures when `gather` (a collective), this rank's alone
        otherwise (its peers may be gone). Returns the summary and the health warnings of the run."""
        if self.timer.running:
            self.timer.stop()
        snapshot = self.snapshot.finish(self.loop.step)  # written now, outside the timed steps
        self.loop.finish()
        self.loop.skipped_steps = self._skipped_total() if gather else self.loop.skipped_steps
        mine = self._rank_summary()
        per_rank = gather_object([mine]) if gather else [mine]
        result = self._summary(per_rank, self.evaluated(test_scores) if test_scores else None, snapshot)
        result["prediction_error"] = self.prediction.errors(result)  # each predicted quantity against the run
        if partial:
            result.update(partial=True, ranks_summarized=[r["rank"] for r in per_rank])
        else:
            predict.remember_communication(self.prediction.block, result, self.settings, self.started)
        warnings = health.check({"settings": asdict(self.settings), "environment": self.env, "summary": result})
        return result, warnings

    def _rank_summary(self) -> dict:
        return {"rank": self.accelerator.process_index, "timing": self.timer.summary(), "counts": self.loop.counts,
                "memory": {**self.timer.memory_summary(), "peak_rss_gib": peak_rss_bytes() / GIB},
                "measurement_s": self.timer.paused_seconds,
                "communication": self.communication.rank_summary(self.loop.counts, self.profiler.communication)}

    def _summary(self, per_rank: list[dict], test_scores: dict | None, snapshot: dict | None) -> dict:
        phase = "steady" if self.loop.counts["steady"]["optimizer_steps"] else "warmup"
        throughput = summary.throughput(per_rank, phase)
        return {
            "world_size": self.accelerator.num_processes,
            "optimizer_steps": self.loop.step,
            "skipped_steps": self.loop.skipped_steps,
            "timing": {"mode": self.timing_mode, "warmup_steps": min(self.settings.timing_warmup_steps, self.loop.step),
                       "across_ranks": {p: summary.combine_ranks(per_rank, p) for p in ("run", *PHASES)},
                       "per_rank": per_rank},
            "throughput": throughput,
            "mfu": mfu(throughput["tflops_per_device"], self.env.get("device_name", ""),
                       self.env.get("effective_precision", "fp32")),
            "memory": summary.memory_across_ranks(per_rank),
            "validation": self.loop.evaluations,
            "test": test_scores,
            "evaluation_tokens": dict(self.evaluation_positions),
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


def table_lines(record: dict, run_dir) -> list[str]:
    """The end-of-run table: stages (median / max over ranks), throughput, MFU, memory, accuracy, warnings."""
    view = RunView(record)
    run = view.timing("run")
    several = view.world_size > 1
    rows = [f"{'stage':<10} {'seconds':>9} {'share':>7}" + ("  (median / max over ranks)" if several else "")]
    for stage in (*STAGES, "other"):
        seconds, share = run["seconds"][stage], run["shares"][stage]
        rows.append(f"{stage:<10} {seconds['median']:>9.2f} {share['median']:>7.1%}"
                    + (f"  max {seconds['max']:.2f}s" if several else ""))
    rows.append(f"{'wall':<10} {run['wall_s']['median']:>9.2f}")
    peak, kind = view.peak_memory
    threads, test = view.threads, view.test
    rows += [
        f"throughput {view.samples_per_s or 0:.1f} samples/s, {view.tokens_per_s or 0:.0f} tokens/s "
        f"({view.env['world_size']} x {view.device_name}, {view.precision}, timing: {view.env['timing_mode']}, "
        f"{threads['torch_threads']} threads per process ({threads['threads_source']}))",
        f"model FLOPs {view.throughput.get('tflops_per_device') or 0:.3f} TFLOP/s per device, MFU "
        + (f"{view.mfu:.1%}" if view.mfu is not None else f"unknown (no peak for {view.device_name})"),
        f"peak memory {peak:.2f} GiB ({kind})",
    ]
    if test:
        rows.append(f"test accuracy {test['accuracy']:.4f}, macro-F1 {test['macro_f1']:.4f}")
    rows += [*communication.table_lines(view.communication), *predict.error_lines(view.prediction_error),
             f"record: {run_dir / 'record.json'}"]
    if view.profile:
        rows.append(f"profile: {view.profile['directory']} (tensorboard --logdir, or open a .pt.trace.json "
                    "in ui.perfetto.dev); top operators by self time:")
        rows += [f"  {op['milliseconds']:9.2f} ms  {op['calls']:6d}x  {op['name']}"
                 for op in operator_rows(view.profile["top_operators"][:8])]
    rows += [f"warning [{w['code']}]: {w['message']}" for w in view.warnings]
    return rows


def operator_rows(top_operators: list[dict]) -> list[dict]:
    """The profiler's top operators with their self time in milliseconds (device time on CUDA, else CPU)."""
    return [{"name": op["name"], "calls": op["calls"],
             "milliseconds": (op["self_device_s"] if op["self_device_s"] is not None else op["self_cpu_s"]) * 1e3}
            for op in top_operators]
