"""The single-controller layer: one driver process calls groups of worker processes as objects.

    ResourcePool    the processes (one per device) a group runs on; placements map roles to pools
    Worker          the object a group builds in each process (rank, device, process-group join)
    dispatch        how a method call is split over the workers and gathered (ONE_TO_ALL, DP_SPLIT,
                    RANK_ZERO), and the kind of its deadline
    WorkerGroup     N workers called as one; deadlines and heartbeats notice dead or hung workers
    spawn_roles     the groups of a placement (colocated roles share processes)
    DataBatch       rows of tensors plus per-row Python objects, chunked and concatenated by dispatch;
    Rows            what dispatch cuts by dp rank (len, chunk, concat): DataBatch, or a layer's own typed batch
    backends        where the processes run: local (spawned here) or Ray
    process_setup   configure_process: what a process that runs models sets up at its start (their CPU kernels)

This package is generic and knows nothing of RL: it imports relayrl.parallel (process launch and
teardown, rendezvous, the CPU kernel choice), relayrl.observe (traces), relayrl.models (process_setup
hands them their CPU kernels), relayrl.config and relayrl.errors only, never controller, trainer,
engine, rewards, sync or any other RL layer. Import the submodules directly.
"""
