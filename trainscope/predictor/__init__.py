"""Predict a run before it runs -- peak memory per process, the steady step time and the run's time, "fits" or
"does not fit" -- and, once it has run, how far off each predicted quantity was.

    python train.py --predict [train.py flags]      # one screen, exit 0, nothing trained, no record written

From what the run will really do, without building its weights:

* **The batches**: the training split's token lengths (tokenized as the run tokenizes, from the datasets cache),
  batched as the run batches them -- padding to the longest sequence of a random batch, to --max-seq-length with
  --pad-to-max-length, or in length-sorted megabatches with --group-by-length (transformers' own grouping) -- for
  as many micro-batches as the run trains on one process; the evaluation splits in their fixed order.
* **The step** (trainscope.trace): the model built from its configuration on fake tensors, one training step
  traced operator by operator at the run's batch and a length near the mean padded one, precision, activation
  checkpointing and LoRA included, and one evaluation batch; every operator's and tensor's power of the length
  then tells the step at each batch's length (its time) and at the longest (the memory peak). Traces are cached.
* **Time** (trainscope.op_costs): each matrix product's FLOPs over this machine's measured matmul rate at that
  shape (trainscope.peak), every other operator timed once at its real shapes, cached per machine. An operator's
  cost at another length follows the length's power in its shapes (one for a linear layer, two for attention
  scores). Plus the collate of real batches of the training split (when the loop loads them itself, --num-workers
  0), DDP's communication where this machine has measured its bandwidth (else left out, and said), evaluation
  batch by batch, and the framework's own time as the calibration runs showed it: per operator dispatched
  (Python, module calls, autograd), per step (the loop) and per evaluation pass, with a factor on the operators
  other than matrix products (timed alone, their inputs are warmer in cache than in a step).
* **Memory** (peak RSS on a CPU, the allocator's max allocated on CUDA): the process's RSS now (framework, data:
  measured where the prediction is made, before any model exists) + parameters + the step's live peak (optimizer
  state, activations kept for backward at the longest batch, temporaries of backward), and on a CPU the
  allocator's own share (glibc keeps freed heap pages, and fragments them): factor x the live peak + a constant.

The fitted terms (the allocator's share, the framework's time) come from trainscope.calibration: short runs of
other shapes, once per machine, made by themselves on first use (at most a minute, cached) or in full by `python -m
trainscope.predict --calibrate` (make predict-calibrate); uncalibrated (switched off, or failed), they are left out
and the prediction says so. Each prediction records how much of it rests on what (`sources`): derived from first
principles (the traced step at this machine's benchmarked costs), fitted (the calibration; a coefficient held at a
bound of its fit is a warning) or measured in the same run before it starts (the process's memory, the collate).

Every train.py run makes the prediction at start (the record's `prediction` block) and, at its end, the error of
each predicted quantity and term (summary `prediction_error`); `make predict-check` runs many shapes and the
report plots predicted against measured. `speedup(baseline, flags, config)` is a change's predicted speed-up.

One module per concern, each importing only those above it in this list; trainscope.predict is the front the rest of
trainscope imports, and the calibration's command:

* workload: what is predicted (settings, launch, the batches it will see, the collate measured);
* step: the step traced and costed on this machine (a phase's time at any length);
* timing, memory: the two models (the memory model also gives the largest batch that fits);
* block: the prediction a run records, made from them;
* change: a change's predicted speed-up;
* check: the measured side of each term in the run, and the prediction's error;
* screen: what is printed.
"""
