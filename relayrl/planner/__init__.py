"""relayrl plan: memory, communication and compute of training and rollout layouts, from a model's
shape alone (no weights, no devices).

    Layout, Workload                 what is planned (relayrl.planner.layout / workload)
    train_memory(shape, layout, w)   bytes per rank: params, grads, optim (exact for relayrl's trainer),
                                     activations, transient, with every term explained
    engine_kv(shape, tp, ...)        the rollout engine's KV arithmetic, as relayrl's engine does it
    engine_weight_bytes(...)         the engine's weights per rank (LoRA adapters; merge mode's base copies)
    make_plan(...)                   every layout of the GPUs ranked; rollout TP degrees; placement with the
                                     engine TP degree that fits beside the trainer (relayrl.planner.rollout)
    TEXT_FIGURES                     the reading's 70B figures checked (relayrl.planner.texts)

It imports relayrl.models (shapes), relayrl.sync (layouts, adapters), relayrl.config and
relayrl.errors only; only the CLI imports it.
"""

from relayrl.planner.activations import korthikanti_layer_bytes
from relayrl.planner.kv import EngineKV, engine_kv, engine_weight_bytes
from relayrl.planner.layout import Layout
from relayrl.planner.memory import TrainMemory, train_memory
from relayrl.planner.search import Plan, make_plan
from relayrl.planner.workload import StateBytes, Workload

__all__ = ["EngineKV", "Layout", "Plan", "StateBytes", "TrainMemory", "Workload", "engine_kv", "engine_weight_bytes",
           "korthikanti_layer_bytes", "make_plan", "train_memory"]
