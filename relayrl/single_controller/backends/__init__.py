"""Worker-group backends: where the worker processes run and how calls reach them.

local   torch.multiprocessing spawn + pipes, one machine (the default)
ray     Ray actors in placement groups, one or many machines
inline  the workers are objects in the driver's own process, called directly (no copies, no processes)

All three run the same WorkerHost (host.py; inline.py's keeps to building and closing the worker), so a worker
behaves the same on each.

The backends import relayrl.parallel, the rest of single_controller and the ground floor only (Ray on
first use); like all of single_controller, it knows nothing of RL and must never import the RL layers
(controller, trainer, engine, rewards, sync, ...).
"""
