"""This package applies parallelism to plain models from outside (the models hold none).

    dims            ParallelDims: degrees, validation, the (pp, dp_replicate, dp_shard, cp, tp) DeviceMesh
    parallelize     parallelize_model: TP plan → EP → activation checkpointing → FSDP / HSDP / DDP
    pipeline        pipeline stages run by torch's schedules (GPipe, 1F1B, interleaved, zero bubble, DualPipeV),
                    the last stage's loss per micro-batch with global denominators (stages: relayrl.models.stage)
    context_parallel  sequences sharded over cp ranks (contiguous / zigzag), Ulysses (all-to-all over heads)
    ring_attention  K, V blocks around the cp ring, online-softmax merge, causal block skipping
    expert_parallel MoE experts split over ep ranks (borrowed from dp_shard x cp), dropless all-to-all dispatch
    tensor_parallel the TP plan as data (HF module-name patterns → styles), applied with DTensor
    data_parallel   apply_fsdp (fully_shard per layer + root), apply_ddp (replicate); grads summed
    vocab_parallel  logprobs / entropy from vocab-sharded logits, without gathering the vocab
    collectives     differentiable f / g / gather / scatter / sequence-parallel collectives
    launch          process-group setup and teardown; run a function on N local processes
    host_memory     the process's allocator policy: freed memory kept for the next step, not re-faulted
    cpu_kernels     the process's CPU kernels, chosen once (oneDNN or MKL per linear product, pointwise compiled
                    or eager); the models take the choice (relayrl.single_controller.process_setup hands it over)

Import the submodules directly; this package imports nothing so that `relayrl.parallel.launch`
stays cheap for code that only starts processes. Its modules import torch, the standard library and
relayrl's ground floor only, and they must never import another relayrl layer (models,
single_controller, the trainer, the engine, ...): those layers import them.
"""
