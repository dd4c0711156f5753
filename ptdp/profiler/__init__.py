"""`ptdp profile`: measure this machine and write a hardware profile the planner can use.

What is measured (PipeDream's profiler, plus what the closed-form model needs):
* per transformer-layer shard (the real `ptdp.models.transformer` code, for each t and b):
  forward and backward seconds, the attention core's forward, bytes saved for backward
  (saved-tensor hooks, de-duplicated by storage) and weight bytes;
* embedding and head (final LayerNorm, logits, vocab-parallel cross-entropy) times;
* the device: large-GEMM rate (the peak), a GEMM shape model, memory bandwidth and the
  per-kernel launch cost, so the analytic model also works for shapes not profiled;
* all-reduce and point-to-point bandwidth/latency between `--ranks` local processes (gloo
  on CPU, NCCL with 2+ GPUs), fitted as time = latency + bytes / bandwidth;
* on CPU, nodes as busy as in training (`measured.busy`): for 2, 4, ... `--ranks` ranks
  all running at once, how much slower each one's compute gets (shared cores and memory
  bandwidth), all-reduce, reduce-scatter and all-gather in concurrent groups of every size,
  and send/recv between pairs, all at once: what tensor-, data- and pipeline-parallel
  communication sees; and what a tensor group's communication adds to a layer on such a
  node (`measured.tensor_layers`, ptdp/profiler/tensor_layers.py);
* the backward split as zb-h1 runs it (input gradients now, weight gradients later), for
  layers, embedding and head;
* on CPU, what the real trainer spends per layer and micro-batch beyond the kernels
  (`calibrate_layer_overhead`), and the memory reserve with the heap glibc keeps in
  proportion to a micro-batch's activations (`calibrate_reserve`).

A tensor-parallel shard of size t is measured in one process by giving the layer a
1-process group that claims size t: the layer has exactly a t-rank's shapes and its
all-reduces become local copies, so the time is compute only (the cost model adds the
communication separately from the measured bandwidths).

The profile records the machine's fingerprint (ptdp.hardware.machine_fingerprint), so
`ptdp plan` and tools/validate_planner.py can tell when a profile comes from elsewhere. On a
GPU the datasheet peak of the --base profile stays the profile's peak (the one the trainer's
`mfu` also divides by); the measured GEMM rate becomes `efficiency.gemm_max`, its share.

This module depends on the planner (for the model YAML loader) and the trainer's model code;
nothing in ptdp.planner imports it. torch is imported inside functions only, so `ptdp
profile --help` stays fast."""
