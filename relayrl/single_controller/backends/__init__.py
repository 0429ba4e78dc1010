"""Worker-group backends: where the worker processes run and how calls reach them.

local  torch.multiprocessing spawn + pipes, one machine (the default)
ray    Ray actors in placement groups, one or many machines

Both run the same WorkerHost (host.py) in each worker process, so a worker behaves the same on both.
"""
