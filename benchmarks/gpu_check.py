"""GPU checks for a lent GPU machine (one script, a few minutes): run as

    python benchmarks/gpu_check.py [--out results.json]          # on a GPU machine
    python benchmarks/gpu_check.py --device cpu --small          # the same checks, CPU smoke test

1. nccl: a one-rank nccl group all-reduces, and the engine's TP worker path (tensor_parallel_size=1
   in a worker process, nccl) returns the same logits as the in-process runner.
2. fp32 engine on the device: greedy tokens equal the plain model's full recomputation.
3. bf16 numerics: bf16 engine vs fp32 trainer logprobs on the sampled tokens (the mismatch the
   driver reports as mismatch/logp_abs_*), and the same for a bf16 trainer.
4. throughput: relayrl's engine vs the vLLM backend (when vllm imports) on an RL-shaped workload,
   tokens/s and their ratio.
5. weight sync on the device: the planned sync into an in-process engine (fp32 and bf16: canary
   gap, seconds), and trainer -> engine across two processes on the device (gloo staging the
   buckets through host memory): engine logprobs vs the trainer's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from relayrl.engine import LLMEngine, SamplingParams
from relayrl.engine.model_runner import prepare
from relayrl.engine.sequence import Sequence
from relayrl.models import load_pretrained
from relayrl.models.config import TinyModelConfig
from relayrl.models.tiny import build_tiny_model
from relayrl.trainer.batch import build_rows, scatter_per_token
from relayrl.trainer.logprobs import token_logprobs


def model_dir(small: bool) -> str:
    d = tempfile.mkdtemp()
    size = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4) if small else \
        dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4)
    return str(build_tiny_model(os.path.join(d, "m"), "0123456789+-*= ", TinyModelConfig(init_std=0.2, **size)))


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 18, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def check_nccl(path: str, device: str) -> dict:
    if not device.startswith("cuda"):
        return {"skipped": "needs cuda"}
    import torch.distributed as dist

    from relayrl.engine.tp_workers import WorkerRanks
    from relayrl.parallel.launch import init_process_group
    from relayrl.parallel.rendezvous import serve_store

    hosted = serve_store()
    init_process_group(0, 1, backend="nccl", store=hosted.address)
    x = torch.ones(4, device=device)
    dist.all_reduce(x)
    dist.destroy_process_group()
    hosted.close()
    local = LLMEngine.from_pretrained(path, device=device, num_blocks=256)
    workers = WorkerRanks(local.config, torch.float32, 1, device=device)
    from relayrl.models import load_state_dict

    workers.call("load_weights", list(load_state_dict(path).items()))
    workers.call("allocate_kv_cache", 256, local.block_size)
    seqs = [Sequence(i, p, SamplingParams(), local.block_size) for i, p in enumerate(prompts(4))]
    for s in seqs:
        local.block_manager.allocate(s)
    ids, batch = prepare(seqs, True, local.block_size, None)
    diff = (workers.call("run", ids, batch) - local._call("run", ids, batch)).abs().max().item()
    workers.close()
    return {"all_reduce_ok": bool(x.sum().item() == 4), "worker_vs_inprocess_max_abs": diff}


def check_greedy(path: str, device: str) -> dict:
    model = load_pretrained(path).to(device).eval()
    eng = LLMEngine.from_pretrained(path, device=device, num_blocks=512)
    ps = prompts(8)
    outs = eng.generate(ps, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    same = 0
    with torch.no_grad():
        for p, o in zip(ps, outs, strict=True):
            ids = list(p)
            for _ in range(16):
                ids.append(int(model(torch.tensor([ids], device=device))[0, -1].argmax()))
            same += ids[len(p):] == o.samples[0].token_ids
    return {"greedy_equal": f"{same}/{len(ps)}"}


def check_bf16(path: str, device: str) -> dict:
    trainer32 = load_pretrained(path).to(device).eval()
    trainer16 = load_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    eng = LLMEngine.from_pretrained(path, device=device, dtype=torch.bfloat16, num_blocks=1024)
    outs = eng.generate(prompts(16), SamplingParams(n=4, temperature=1.0, max_tokens=32, seed=0))
    ps = [o.prompt_token_ids for o in outs for _ in o.samples]
    rs = [s.token_ids for o in outs for s in o.samples]
    ids, attn, resp = build_rows(ps, rs)
    rollout = scatter_per_token([s.logprobs for o in outs for s in o.samples], ps, ids.shape[1])
    res = {}
    with torch.no_grad():
        for name, m in (("fp32_trainer", trainer32), ("bf16_trainer", trainer16)):
            logp, _ = token_logprobs(m, ids.to(device), attn.to(device))
            gap = ((logp.cpu() - rollout).abs() * resp)
            res[name] = {"logp_abs_mean": float(gap.sum() / resp.sum()), "logp_abs_max": float(gap.max())}
    return res


def check_throughput(path: str, device: str) -> dict:
    ps = prompts(32)
    g = torch.Generator().manual_seed(1)
    long = torch.rand(32, generator=g) < 0.15  # a few long requests among short ones
    lengths = [int(x) for x in torch.where(long, 256, torch.randint(8, 64, (32,), generator=g))]
    params = [SamplingParams(n=8, temperature=1.0, max_tokens=n, ignore_eos=True, seed=i)
              for i, n in enumerate(lengths)]
    total = 8 * sum(lengths)
    res = {}
    eng = LLMEngine.from_pretrained(path, device=device, dtype=torch.bfloat16, kv_cache_fraction=0.3)
    eng.generate(ps[:2], params[:2])  # warm-up
    t = time.perf_counter()
    eng.generate(ps, params)
    res["relayrl_tok_s"] = total / (time.perf_counter() - t)
    try:
        from relayrl.engine.vllm_backend import VLLMEngine

        v = VLLMEngine(path, dtype=torch.bfloat16, gpu_memory_utilization=0.3)
        v.generate(ps[:2], params[:2])
        t = time.perf_counter()
        v.generate(ps, params)
        res["vllm_tok_s"] = total / (time.perf_counter() - t)
        res["relayrl_over_vllm"] = res["relayrl_tok_s"] / res["vllm_tok_s"]
    except ImportError as e:
        res["vllm"] = f"skipped: {e}"
    return res


def check_sync(path: str, device: str) -> dict:
    from relayrl.engine.model_runner import ModelRunner
    from relayrl.models.config import ModelShape
    from relayrl.parallel.launch import launch
    from relayrl.parallel.rendezvous import serve_store
    from relayrl.sync import EngineLayout, Members, SyncSpec, TrainerLayout, sync_step
    from relayrl.sync.transfer import trainer_locals

    model = load_pretrained(path).to(device).eval()
    rows = prompts(8)
    ids = torch.tensor([r[:4] for r in rows], device=device)
    with torch.no_grad():
        ref = token_logprobs(model, ids, torch.ones_like(ids))[0].cpu()
    res = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        runner = ModelRunner(model.config, dtype, device=device)
        spec = SyncSpec(shape=ModelShape.of(model.config), trainer=TrainerLayout(), engine=EngineLayout(1),
                        members=Members(1, 1, True), dtype=dtype)
        t = time.perf_counter()
        sync_step(spec, comm=None, trainer_rank=0, engine_rank=0, local=trainer_locals(model), params=runner.params())
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        took = time.perf_counter() - t
        gap = (runner.score(ids.cpu().tolist()) - ref)[:, 1:].abs()
        res[f"in_process_{name}"] = {"seconds": round(took, 4), "canary_gap_mean": float(gap.mean()),
                                     "canary_gap_max": float(gap.max())}
    store = serve_store()
    got = launch(_sync_two_processes, 2, store.address, path, device, ids.cpu().tolist(), timeout=300)
    store.close()
    res["two_processes_fp32"] = {"canary_gap_max": float((got[1] - ref)[:, 1:].abs().max())}
    return res


def _sync_two_processes(rank: int, world: int, store, path: str, device: str, rows) -> torch.Tensor | None:
    """Process 0: the trainer (its tensors on the device); process 1: the engine (on the device)."""
    from relayrl.engine.model_runner import ModelRunner
    from relayrl.models.config import ModelShape
    from relayrl.sync import EngineLayout, Members, SyncComm, SyncSpec, TrainerLayout, sync_step
    from relayrl.sync.transfer import trainer_locals

    model = load_pretrained(path).to(device)
    spec = SyncSpec(shape=ModelShape.of(model.config), trainer=TrainerLayout(), engine=EngineLayout(1),
                    members=Members(1, 1, colocated=False), dtype=torch.float32)
    comm = SyncComm(store, rank, 2)
    if rank == 0:
        sync_step(spec, comm=comm, trainer_rank=0, local=trainer_locals(model))
        comm.close()
        return None
    runner = ModelRunner(model.config, torch.float32, device=device)
    sync_step(spec, comm=comm, engine_rank=0, params=runner.params())
    comm.close()
    return runner.score(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="the tiny model instead of the ~25M one")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    path = model_dir(a.small)
    results = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
               "torch": torch.__version__}
    for name, fn in (("nccl", check_nccl), ("greedy_fp32", check_greedy), ("bf16", check_bf16),
                     ("throughput", check_throughput), ("sync", check_sync)):
        t = time.perf_counter()
        try:
            results[name] = fn(path, a.device)
        except Exception as e:  # report every check, even when one fails
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results[name]["seconds"] = round(time.perf_counter() - t, 1)
        print(name, json.dumps(results[name]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
