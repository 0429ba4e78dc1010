"""What a relayrl process that runs models sets up once, when it starts: how it keeps freed memory, and the CPU
kernels its models run.

    configure_process()   relayrl.parallel.host_memory.apply(): freed memory kept for the next step (one line
                          for a bad RELAYRL_HOST_MEMORY); then relayrl.parallel.cpu_kernels decides (once per
                          process: the CPU's rule, a measurement, or RELAYRL_CPU_LINEAR; RELAYRL_COMPILE) and the
                          models are handed the decision as an argument: relayrl.models.linear.use_kernels,
                          relayrl.models.pointwise.use_compile

Why here: the models take the choice and never make it (they read neither the environment nor the CPU), and the
module that decides never imports the models, so the two meet in a layer above both that every process start can
call. Every worker process calls it (backends.host, when it builds its worker: a role's workers, the engine's
tensor-parallel ranks); so do the jobs and CLI commands that run models in the driver's process
(relayrl.jobs.train, relayrl.jobs.sft, `relayrl eval` / `generate`), the tests (conftest and the distributed
harness, for every rank of relayrl.parallel.launch) and each benchmark that runs models in its own processes.
A process that never calls it runs torch's kernels everywhere and compiles the pointwise pieces (their defaults).

It imports relayrl.parallel and relayrl.models only; like all of single_controller, it knows nothing of RL.
"""

from __future__ import annotations

from relayrl.models import linear, pointwise
from relayrl.parallel import cpu_kernels, host_memory


def configure_process() -> cpu_kernels.CPUKernels:
    """Decide this process's CPU kernels (on the first call; later calls hand over the same decision) and hand
    them to the models, after this process's heap policy (host_memory.apply). A bad RELAYRL_CPU_LINEAR or
    RELAYRL_COMPILE is a ValueError naming the variable."""
    host_memory.apply()
    chosen = cpu_kernels.configure()
    linear.use_kernels(chosen.linear)
    pointwise.use_compile(chosen.compile)
    return chosen
