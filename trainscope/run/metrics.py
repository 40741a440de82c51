"""The one metrics component of a training run: it measures and summarizes, nothing else; a new measurement goes
here, never into train.py. How it works: docs/design.md#in-the-code-the-metrics-component-trainscoperunmetricspy.
"""

import contextlib
import math
import sys

import torch
from accelerate.utils import gather_object

from trainscope.core import environment
from trainscope.core.environment import compile_stats, compiled_with
from trainscope.core.faults import NonFiniteLoss
from trainscope.core.paths import GIB
from trainscope.core.precision import effective_precision, loop_autocast, seen_in_the_loop
from trainscope.core.record_view import option_words
from trainscope.core.records import now_iso
from trainscope.measure import attention, flops_source, operations, summary
from trainscope.measure.communication import block as communication_block
from trainscope.measure.communication import measured as communication
from trainscope.measure.flops import FULL, mfu, training_of
from trainscope.measure.flops_source import BatchFacts
from trainscope.measure.memory import peak_rss_bytes
from trainscope.measure.profiling import build_memory_snapshot, build_profiler
from trainscope.measure.timing import PHASES, StageTimer, make_clock
from trainscope.run import after_loop
from trainscope.run.driver import Driver
from trainscope.run.events import LoopEvents
from trainscope.run.loop import LoopState


class RunMetrics:
    def __init__(
        self,
        accelerator,
        started,
        plan: dict,
        model_config,
        driver: Driver | None = None,
        scheduler=None,
        flops=None,
        optimizer=None,
    ):
        self.accelerator, self.started, self.plan, self.scheduler = accelerator, started, plan, scheduler
        self.optimizer = optimizer  # its learning rate for the step lines where there is no scheduler
        self.options, self.run_dir = started.settings, started.run_dir
        self.model_config = model_config  # taken before prepare() wraps the model (DDP, FSDP, compile)
        device, rank = accelerator.device, accelerator.process_index
        clock, self.timing_mode = make_clock(self.options.timing, device)
        self.profiler = build_profiler(self.options, self.run_dir, device, rank)
        self.snapshot = build_memory_snapshot(self.options, self.run_dir, device, rank)
        self.timer = StageTimer(clock, device, profiler_labels=self.profiler.enabled)
        self.loop = LoopState(device)
        self.communication = communication.NoCommunication()
        self.evaluation_positions = {"tokens": 0, "padded_tokens": 0, "padded_squares": 0, "samples": 0}
        self.env: dict = {}
        self.model = None
        self.run_shapes: dict | None = None  # the matmuls and one layer measured at the run's shapes, after the loop
        self._last_loss, self._graphs_after_first_step = None, None
        self._line_step = 0  # the optimizer step of the latest step line
        self.non_finite_losses: dict | None = None  # {micro_batches, first}: losses recorded non-finite, not raised
        self._evaluation_graphs = 0  # torch.compile graphs made for evaluation (eval mode): not recompiles
        self._evaluated = False  # an evaluation ran (a compiled model's first one compiles)
        self.compiled: dict | None = None  # how the model is compiled (read from the objects at attach), None: eager
        self.driver = driver or Driver()
        self.prediction = self.driver.prediction_check()  # the measured side of each predicted term
        self.training = FULL  # what the step trains (trainscope.measure.flops): read from the model at attach
        self._given_flops = flops
        self.flops = flops_source.NoFlops()  # where the model FLOPs come from: chosen at attach, from the model
        self.events = LoopEvents(None, None)  # the loop's forwards and optimizer steps: hooked at attach
        self.operations = operations.NoWatch()  # the model's inputs kept in warm-up: set with the environment
        self.loop_peak_rss: int | None = None  # the peak RSS before the model was timed alone after the loop
        self.scaler, self.kernels = None, None  # the loop's own GradScaler; the attention kernels seen (attach)
        self._autocast = False  # the loop's own autocast dtype at its first training forward (False: none seen yet)

    # ---------------------------------------------------------------- before the loop

    def attach(self, model, optimizer=None, scaler=None) -> None:
        """The FLOPs source of the model as it trains; the hooks that count the loop's optimizer steps and see its
        forwards (trainscope.run.events); the communication measurement of the prepared model (a do-nothing one
        unless it is DDP), and the prediction's check of the model and optimizer. The model is kept for the
        measurements at the run's shapes after the loop (a copy of one layer is profiled, never the model)."""
        self.model = model
        unwrapped = self.accelerator.unwrap_model(model)
        # activation checkpointing as the model's modules hold it (transformers' gradient_checkpointing_enable sets
        # each layer stack's flag: what is_activation_checkpointing, or is_gradient_checkpointing before 5.18, reads)
        checkpointing = any(getattr(module, "gradient_checkpointing", None) is True for module in unwrapped.modules())
        self.compiled = compiled_with(self.accelerator, model)
        self.training = training_of(unwrapped, checkpointing)
        self.flops = flops_source.source_for(
            unwrapped, self.model_config, self._given_flops, self.driver.unpadded, lambda: self.training, checkpointing
        )
        self.events = LoopEvents(model, optimizer, scaler)
        self.scaler = scaler
        if model is not None and self.compiled is None:  # a compiled model's attention is its compiler's kernels
            self.kernels = attention.KernelWatch(model)
        self.events.forward_listeners.append(self._forward_started)
        self.events.step_listeners.append(self.flops.end)
        self.communication = communication.build(self.options, self.accelerator, model)
        self.prediction.attach(model, optimizer)

    def _forward_started(self, args, kwargs) -> None:
        """A training forward began: the FLOPs counter counts it if its shape is new and the run still warms up; the
        first one shows the loop's own autocast."""
        if self._autocast is False:
            self._autocast = loop_autocast(self.accelerator.device.type)
        self.flops.forward_started(args, kwargs, counting_allowed=self.timer.phase == "warmup")

    def detach(self) -> None:
        """The hooks off the model and the optimizer, a count still open closed: the run ended."""
        self.flops.end()
        self.events.close()
        self.operations.close()
        if self.kernels is not None:
            self.kernels.close()

    def resume_from(self, resumed: dict | None) -> None:
        """Continue the counters and timing totals of a checkpointed part of the same run."""
        self.loop = LoopState(self.accelerator.device, resumed)
        self._line_step = self.loop.step
        if resumed:
            self.timer.restore(resumed["timer"])

    def environment(self) -> dict:
        """The record's environment block: what the run really ran on and in (read once, after attach); the machine's
        measured matmul peak joins it after the loop, at the run's own shapes (`summarize`)."""
        effective = effective_precision(self.accelerator)
        self.env = {
            **environment.describe(self.accelerator, effective, self.started.threads),
            "timing_mode": self.timing_mode,
            **self.started.facts,
            "ddp": self.communication.settings_in_effect(),
        }
        # the warm-up's last training micro-batch, kept where the model is to be timed alone after the loop
        model = self.accelerator.unwrap_model(self.model) if self.model is not None else None
        sharded = "FSDP" in str(self.accelerator.distributed_type)
        asked = option_words("time_model", None, self.driver.options)
        not_asked = f"not timed: {asked} times the run's model alone after the loop (trainscope tune asks for it)"
        self.operations = (
            operations.watch(model, lambda: self.timer.phase, self.compiled is not None, sharded)
            if self.options.time_model
            else operations.NoWatch(not_asked)
        )
        return self.env

    def any_rank(self, flag: bool) -> bool:
        """Whether any rank's flag is set (a collective; every rank calls it at the same point)."""
        total = self.accelerator.reduce(torch.tensor(int(flag), device=self.accelerator.device), reduction="sum")
        return bool(total.item())  # a sync point, once, after the loop

    def checkpoint_state(self) -> dict:
        """What a checkpoint keeps beside Accelerate's state: the loop's position and the timing so far."""
        self._fold_skips()
        return {**self.loop.checkpoint(), "timer": self.timer.state_dict()}

    def _fold_skips(self) -> None:
        """The device's count of skipped steps into the loop's (a sync point)."""
        self.loop.skipped_steps = self._skipped_total()
        if self.events.skips is not None:
            self.events.skips.count.zero_()

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
        """The run took its steps (the optimizer's steps, those it took since the loop's last call counted too)."""
        steps = self.plan["optimizer_steps"]
        return steps is not None and self.loop.step + len(self.events.pending) >= steps

    def micro_batch(self, batch, loss, samples: int | None = None, tokens: int | None = None) -> None:
        """Count one trained micro-batch: its samples and tokens (read from the batch where not given), its FLOPs."""
        facts = BatchFacts(batch, samples, tokens)
        self.loop.add_micro_batch(self.timer.phase, loss, facts, self.flops.micro_batch(facts))
        self.prediction.micro_batch_done(batch, self.accelerator.sync_gradients)

    def end_step(self) -> None:
        """One optimizer step ended: the step's counters, the profiler's and the memory snapshot's windows, the next
        step's phase."""
        phase = self.timer.phase
        self.loop.end_step(phase)
        step = self.loop.step
        self.profiler.step()
        self.communication.step_ended(step, phase, paused=self.timer.paused)
        self.snapshot.step_finished(step)  # takes the snapshot at the end of its window (phase `snapshot`)
        if step == 1 and self.compiled:
            self._graphs_after_first_step = compile_stats()["graphs"]
        self.timer.set_phase(self._phase_for(step + 1))
        self.timer.set_memory_sampling(self._samples_memory(step + 1))

    def _skipped_total(self) -> int:
        return self.loop.skipped_steps + self.events.skipped_total()  # a sync point: log steps and checkpoints only

    def _phase_for(self, step: int) -> str:
        """warmup for the first --timing-warmup-steps, snapshot while a memory snapshot records, else steady."""
        if step <= self.options.timing_warmup_steps:
            return "warmup"
        return "snapshot" if self.snapshot.covers(step) else "steady"

    def _samples_memory(self, step: int) -> bool:
        return step == 1 or step % self.options.memory_every == 0

    @property
    def log_due(self) -> bool:
        return self.loop.step % self.options.log_every == 0 or self.done

    def step_line(self) -> dict:
        """One step line: mean loss over the interval and all ranks; this rank's stage seconds and TFLOP/s, all
        over the timer's one clock. A collective: every rank calls it at the same step."""
        interval, timing = self.loop.take_interval(), self.timer.take_interval()
        world = self.accelerator.num_processes
        losses = torch.stack(interval["losses"]).float()
        if world > 1:  # gathered before any check, so every rank sees the same losses and stops together
            losses = self.accelerator.gather(losses)
        self._last_loss = losses.mean().item()  # the line's one sync point: any non-finite loss makes the mean so
        non_finite = 0 if math.isfinite(self._last_loss) else self._non_finite(losses.view(world, -1))
        tokens, wall, self._line_step = interval["tokens"], timing["wall_s"], self.loop.step
        if tokens is not None:
            tokens = (self.accelerator.reduce(tokens, reduction="sum") if world > 1 else tokens).item()
        return {
            "step": self.loop.step,
            "epoch": self.loop.epoch,
            "loss": self._last_loss,
            "lr": self._learning_rate(),
            "micro_batches": len(interval["losses"]),
            "samples": interval["samples"] * world,
            "tokens": tokens,
            "stage_s": timing["stage_s"],
            "wall_s": wall,
            "skipped_steps": self._skipped_total(),
            "exposed_communication_s": self.communication.take_interval(),
            "tflops_per_device": interval["flops"] / wall / 1e12 if interval["flops"] and wall > 0 else None,
            "time": now_iso(),
            **({"non_finite_losses": non_finite} if non_finite else {}),
        }

    def _non_finite(self, gathered: torch.Tensor) -> int:
        """The interval's non-finite losses: raised where the driver stops on one (train.py), else recorded (the
        summary's `non_finite_losses`) and warned once, the run going on as the loop does -- a loss scaler skips the
        step it overflowed in. The line's loss is then the mean of the finite ones (None where none is)."""
        finite = torch.isfinite(gathered).all(dim=0)
        first, count = int((~finite).nonzero()[0]), int((~finite).sum())
        since, step, trained = self._line_step + 1, self.loop.step, gathered.shape[1]
        said = (
            f"loss became {gathered[:, first].tolist()} at optimizer "
            + (f"step {step}" if since == step else f"steps {since}-{step}")
            + (f" (micro-batch {first + 1} of {trained})" if trained > 1 else "")
        )
        if self.driver.stop_on_non_finite:
            raise NonFiniteLoss(f"{said}: {self.driver.non_finite}")
        if self.non_finite_losses is None:
            if self.accelerator.is_main_process:
                print(f"warning [non_finite_loss]: {said}; recorded, and the run goes on as the loop does "
                      f"(if it should not: {self.driver.non_finite})", file=sys.stderr, flush=True)  # fmt: skip
            self.non_finite_losses = {"micro_batches": 0, "first": said}
        self.non_finite_losses["micro_batches"] += count
        kept = gathered[torch.isfinite(gathered)]
        self._last_loss = kept.mean().item() if kept.numel() else None
        return count

    def _learning_rate(self) -> float | None:
        if self.scheduler is not None:
            return self.scheduler.get_last_lr()[0]
        groups = getattr(self.optimizer, "param_groups", None)
        return float(groups[0]["lr"]) if groups else None

    @contextlib.contextmanager
    def evaluation(self):
        """The `eval` stage. Of a compiled model, graphs compiled in it (eval mode) are told apart from recompiles, and
        the first evaluation, which compiles the eval graphs, is timed in the warm-up phase: never in the steady
        figures."""
        before = compile_stats()["graphs"] if self.compiled else 0
        compiling = self.compiled is not None and not self._evaluated
        phase = self.timer.phase
        if compiling:
            self.timer.set_phase("warmup")
        with self.timer("eval"):
            yield
        if compiling:
            self.timer.set_phase(phase)
        self._evaluated = True
        if self.compiled:
            self._evaluation_graphs += compile_stats()["graphs"] - before

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

    def summarize(self, test_scores: dict | None, partial: bool = False, gather: bool = True) -> dict:
        """Stop the clocks and summarize: every rank's figures when `gather` (a collective), this rank's alone
        otherwise (its peers may be gone)."""
        if self.timer.running:
            self.timer.stop()
        self._fold_seen()
        snapshot = self.snapshot.finish(self.loop.step)  # written now, outside the timed steps
        self.loop.finish()
        if gather:
            self._fold_skips()
        if gather and not partial:  # every rank at once, after the timed loop: trainscope's own cost after it
            self.run_shapes = after_loop.run_shapes(self)
        mine = self._rank_summary(final=gather and not partial)
        per_rank = gather_object([mine]) if gather else [mine]
        result = self._summary(per_rank, self.evaluated(test_scores) if test_scores else None, snapshot)
        result["prediction_error"] = self.prediction.errors(result)  # each predicted quantity against the run
        if partial:
            result.update(partial=True, ranks_summarized=[r["rank"] for r in per_rank])
        else:
            self.driver.summarized(self.prediction.block, result, self.started)
        return result

    def _fold_seen(self) -> None:
        """What the loop's forwards showed, into the environment: the precision it ran in (before anything after the
        loop is measured in it) and the attention kernels torch picked, with how the FLOPs count them."""
        if self.env:
            device, scaler = self.accelerator.device.type, self.accelerator.scaler
            self.env.update(seen_in_the_loop(self.env, device, self._autocast, scaler, self.scaler))
            self.env["sdpa_kernels"] = self.kernels.block(self.flops.basis) if self.kernels is not None else None

    def _rank_summary(self, final: bool = False) -> dict:
        """This rank's figures. `final`: every rank finished the run and is here, so the communication measurement
        times its buckets' transfer now (a collective), after the memory peaks were read."""
        memory = {**self.timer.memory_summary(), "peak_rss_gib": (self.loop_peak_rss or peak_rss_bytes()) / GIB}
        return {
            "rank": self.accelerator.process_index,
            "timing": self.timer.summary(),
            "counts": self.loop.counts,
            "memory": memory,
            "measurement_s": self.timer.paused_seconds,
            "communication": self.communication.rank_summary(self.loop.counts, self.profiler.communication, final),
        }

    def _summary(self, per_rank: list[dict], test_scores: dict | None, snapshot: dict | None) -> dict:
        phase = "steady" if self.loop.counts["steady"]["optimizer_steps"] else "warmup"
        throughput = summary.throughput(per_rank, phase)
        throughput.update(real_token_throughput(throughput, self.flops, len(per_rank)))
        model_flops = self._model_flops(throughput, len(per_rank))
        communication_summary = communication_block.combine(per_rank, throughput)
        device_name, shapes = self.env.get("device_name", ""), self.run_shapes
        return {
            "world_size": self.accelerator.num_processes,
            "optimizer_steps": self.loop.step,
            "skipped_steps": self.loop.skipped_steps,
            "timing": {
                "mode": self.timing_mode,
                "warmup_steps": min(self.options.timing_warmup_steps, self.loop.step),
                "across_ranks": {p: summary.combine_ranks(per_rank, p) for p in ("run", *PHASES)},
                "per_rank": per_rank,
            },
            "throughput": throughput,
            "mfu": mfu(throughput["tflops_per_device"], device_name, self.env.get("effective_precision", "fp32")),
            "model_flops": model_flops,
            "measured_peak": after_loop.measured_peak(self.env, throughput, per_rank, phase, shapes, model_flops),
            "memory": summary.memory_across_ranks(per_rank),
            "validation": self.loop.evaluations,
            "test": test_scores,
            "evaluation_tokens": dict(self.evaluation_positions),
            "final_train_loss": self._last_loss,
            "non_finite_losses": self.non_finite_losses,
            "wall_s": per_rank[0]["timing"]["run"]["wall_s"],
            "profile": (
                {
                    "directory": str(self.run_dir / "profile"),
                    "window": self.profiler.window,
                    "top_operators": self.profiler.top_operators,
                    "breakdown": self.profiler.breakdown,
                }
                if self.profiler.enabled
                else None
            ),
            "memory_snapshot": snapshot,
            "compile": self._compile_summary(),
            "communication": communication_summary,
            "device_time": summary.device_time(
                per_rank, phase, self.timing_mode, shapes, self.training.recomputed, communication_summary
            ),
        }

    def _model_flops(self, throughput: dict, world: int) -> dict:
        """What the model FLOPs count (trainscope.measure.flops): the share of the encoder's matmul weights trained, LoRA's
        adapters, whether the first layer's input gets a gradient; and what activation checkpointing recomputed,
        per device and second, which the model FLOPs leave out (as PaLM's MFU)."""
        wall = throughput.get("train_wall_s") or 0.0
        recomputed = self.flops.recomputed(throughput.get("padded_tokens") or 0, throughput.get("padded_squares") or 0)
        return {
            "basis": self.flops.basis,
            **self.flops.details(),
            "trained_share": self.training.trained_share,
            "adapter_weights": self.training.adapter_weights,
            "input_gradient": self.training.input_gradient,
            "recomputed": self.training.recomputed,
            "recomputed_tflops_per_device": recomputed / wall / world / 1e12 if recomputed and wall > 0 else 0.0,
        }

    def _compile_summary(self) -> dict | None:
        if self.compiled is None:
            return None
        stats = compile_stats()
        first = self._graphs_after_first_step
        return {
            "dynamic": self.compiled["dynamic"],
            "compile_s": stats["compile_s"],
            "graphs": stats["graphs"],
            "graphs_after_first_step": first,
            "evaluation_graphs": self._evaluation_graphs,
            "recompiles": max(0, stats["graphs"] - first - self._evaluation_graphs) if first is not None else None,
        }


def real_token_throughput(throughput: dict, source, ranks: int) -> dict:
    """The useful work beside the work done: training FLOPs on real tokens only (trainscope.measure.flops.real_training_flops)
    per device per second, and the share of the counted FLOPs that went to padding positions (all of padding's with
    padded layers; attention's on the padded layout with --unpad). None where the model's shape is unknown."""
    real = source.real(throughput.get("tokens"), throughput.get("squares"), throughput.get("samples"))
    wall, counted = throughput.get("train_wall_s"), throughput.get("flops")
    return {
        "real_flops": real,
        "real_tflops_per_device": real / wall / ranks / 1e12 if real and wall and wall > 0 else None,
        "padding_flops_share": max(0.0, 1.0 - real / counted) if real and counted else None,
    }
