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
   gap, seconds), and trainer -> engine across two processes on the device, once with gloo staging the
   buckets through host memory and once with CUDA IPC handles (sync.transport=ipc): engine logprobs vs
   the trainer's, seconds.
6. the whole GRPO loop on the device (parallel.device, one process, the engine colocated: its sync is in-place
   device copies), a few steps of each:
     grpo_demo   the demo's job on its built-in defaults (relayrl.jobs.demo: a few SFT steps of its
                 warm-start, then its GRPO recipe) with a bf16 engine and the fp32 trainer
     grpo_0.5b   a random model of Qwen2.5-0.5B's shape (config only, no download: 24 layers, hidden 896,
                 14 heads / 2 KV heads, vocabulary 151936, tied embeddings) with a bf16 engine and a bf16
                 (autocast) trainer
   each printing the stages' seconds (time/*), MFU (throughput/mfu_*), the engine-vs-trainer logprob gap
   (mismatch/*), CUDA memory (memory/*), reward and loss: the first step (warm-up) apart from the mean of the
   others. With vllm importable, the same loop with rollout.backend=vllm beside it (parity: the gap, the
   rollout's time, rewards) and greedy tokens of both engines compared.

7. fleet: 2 engine replicas, each in a rollout worker process (relayrl.roles.fleet), on the node's GPUs as a run
   places them (relayrl.roles.fleet_replicas.replica_devices after a trainer of one rank: cuda:1.. where the node
   has more than one GPU, else both on cuda:0): each replica's device, tokens/s of the fleet against one replica,
   and the share of samples equal to one in-process engine's (seeded; on a GPU, batch-dependent kernels may round
   differently, so it is reported, not asserted).

--small shrinks every model (the 0.5B shape to 2 layers of width 112, its vocabulary kept) and the loops' work
so that the CPU smoke test takes a minute or two.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from relayrl.engine import LLMEngine, SamplingParams
from relayrl.engine.model_runner import ModelRunner, prepare
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

    workers.call(ModelRunner.load_weights, list(load_state_dict(path).items()))
    workers.call(ModelRunner.allocate_kv_cache, 256, local.block_size)
    seqs = [Sequence(i, p, SamplingParams(), local.block_size) for i, p in enumerate(prompts(4))]
    for s in seqs:
        local.block_manager.allocate(s)
    ids, batch = prepare(seqs, True, local.block_size, None)
    logits = [ranks.call(ModelRunner.run, ids, batch) for ranks in (workers, local.ranks.group)]
    diff = (logits[0] - logits[1]).abs().max().item()
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
    for name, ipc in (("two_processes_fp32", False), ("two_processes_fp32_cuda_ipc", True)):
        if ipc and not device.startswith("cuda"):
            res[name] = {"skipped": "needs cuda"}
            continue
        store = serve_store()
        got = launch(_sync_two_processes, 2, store.address, path, device, ids.cpu().tolist(), ipc, timeout=300)
        store.close()
        res[name] = {"canary_gap_max": float((got[1][0] - ref)[:, 1:].abs().max()), "seconds": round(got[1][1], 4)}
    return res


def _sync_two_processes(rank: int, world: int, store, path: str, device: str, rows, ipc: bool = False):
    """Process 0: the trainer (its tensors on the device); process 1: the engine (on the device). ipc: the buckets
    cross as CUDA IPC handles (sync.transport=ipc), else staged through host memory over gloo."""
    from relayrl.engine.model_runner import ModelRunner
    from relayrl.models.config import ModelShape
    from relayrl.sync import EngineLayout, Members, SyncComm, SyncSpec, TrainerLayout, sync_step
    from relayrl.sync.transfer import trainer_locals

    model = load_pretrained(path).to(device)
    spec = SyncSpec(shape=ModelShape.of(model.config), trainer=TrainerLayout(), engine=EngineLayout(1),
                    members=Members(1, 1, colocated=False), dtype=torch.float32, ipc=ipc)
    comm = SyncComm(store, rank, 2)
    if rank == 0:
        sync_step(spec, comm=comm, trainer_rank=0, local=trainer_locals(model))
        comm.close()
        return None
    runner = ModelRunner(model.config, torch.float32, device=device)
    t = time.perf_counter()
    sync_step(spec, comm=comm, engine_rank=0, params=runner.params())
    took = time.perf_counter() - t
    comm.close()
    return runner.score(rows), took


# ---------------------------------------------------------------------------- 6. the GRPO loop on the device
QWEN25_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64, qkv_bias=True,
                  tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)
# the smoke test's stand-in: the same family, heads and vocabulary (the big lm_head, undecodable samples), 2 thin layers
QWEN25_05B_SMALL = {**QWEN25_05B, "hidden_size": 112, "intermediate_size": 224, "num_hidden_layers": 2,
                    "head_dim": 8, "max_position_embeddings": 512}
REPORTED = ("time/", "throughput/mfu_", "throughput/gen_tokens_per_s", "throughput/peak_gflops", "mismatch/",
            "memory/", "reward/mean", "loss", "grad_norm", "sync/", "flops/")


def random_05b_dir(small: bool) -> str:
    """A randomly initialised model of Qwen2.5-0.5B's shape with a char tokenizer (its ids are a prefix of the
    vocabulary; sampled ids beyond it decode to nothing, which rewards 0: the loop's cost is what is measured)."""
    from relayrl.models import save_pretrained
    from relayrl.models.config import ModelConfig
    from relayrl.models.tokenizer import build_char_tokenizer
    from relayrl.models.transformer import CausalLM

    d = tempfile.mkdtemp()
    tok = build_char_tokenizer(os.path.join(d, "tok"), "0123456789+-*= ", model_type="qwen2")
    cfg = ModelConfig(**(QWEN25_05B_SMALL if small else QWEN25_05B), bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = CausalLM(cfg)
    model.reset_parameters(std=0.02, seed=0)
    out = os.path.join(d, "qwen2.5-0.5b-shape")
    save_pretrained(model, out, tokenizer_dir=os.path.join(d, "tok"))
    return out


def run_loop(cfg, steps: int) -> list[dict]:
    """`steps` steps of the driver's loop (sync, rollout, reward, advantage, update; no eval or checkpoint)."""
    from relayrl.jobs.build import build_driver

    run_dir = tempfile.mkdtemp()
    driver, roles, _, _ = build_driver(cfg, Path(run_dir))
    try:
        return [driver.train_step() for _ in range(steps)]
    finally:
        roles.close()


def summarize(steps: list[dict]) -> dict:
    """The reported figures: step 1 (warm-up: kernels, allocator, peaks) and the mean of the later steps."""
    def pick(m: dict) -> dict:
        return {k: round(float(v), 6) for k, v in sorted(m.items()) if k.startswith(REPORTED)}

    later = steps[1:] or steps
    mean = {k: sum(pick(m)[k] for m in later) / len(later) for k in pick(later[0])}
    return {"steps": len(steps), "first_step": pick(steps[0]), "mean_after_first": {k: round(v, 6)
                                                                                     for k, v in mean.items()}}


def grpo_config(model: dict, device: str, *, rollout: dict, trainer: dict, data: dict, algo: dict | None = None,
                backend: str = "relayrl", sync: dict | None = None):
    from relayrl.controller.config import RunConfig

    return RunConfig.from_dict({
        "model": model, "data": data, "algo": algo or {},
        "rollout": {**rollout, "engine_dtype": "bfloat16", "backend": backend},
        "trainer": trainer, "parallel": {"device": device.split(":")[0]}, "sync": sync or {},
        "run": {"steps": 1000, "loggers": [], "out_dir": tempfile.mkdtemp()},
    })


def with_vllm(make_cfg, steps: int, res: dict) -> None:
    """The same loop with rollout.backend=vllm beside relayrl's, when vllm imports."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        res["vllm"] = f"skipped: {e}"
        return
    v = summarize(run_loop(make_cfg("vllm"), steps))
    r = res["mean_after_first"]
    res["vllm"] = v
    res["parity"] = {k: {"relayrl": r.get(k), "vllm": v["mean_after_first"].get(k)}
                     for k in ("mismatch/logp_abs_mean", "mismatch/logp_abs_max", "time/rollout", "time/step",
                               "throughput/gen_tokens_per_s", "reward/mean")}


def greedy_parity(path: str, device: str, prompts_: list[list[int]], max_tokens: int) -> dict:
    """relayrl's bf16 engine vs vLLM's, greedy: the share of each sample's tokens before the two first differ."""
    try:
        from relayrl.engine.vllm_backend import VLLMEngine

        v = VLLMEngine(path, dtype=torch.bfloat16, gpu_memory_utilization=0.3)
    except ImportError as e:
        return {"skipped": str(e)}
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ours = LLMEngine.from_pretrained(path, device=device, dtype=torch.bfloat16).generate(prompts_, sp)
    theirs = v.generate(prompts_, sp)
    agree = []
    for a, b in zip(ours, theirs, strict=True):
        x, y = a.samples[0].token_ids, b.samples[0].token_ids
        n = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        agree.append(n / max(len(x), 1))
    return {"greedy_prefix_agreement_mean": sum(agree) / len(agree), "all_equal": sum(a == 1.0 for a in agree)}


def check_grpo_demo(device: str, small: bool, steps: int | None) -> dict:
    """The demo's job: a few steps of its SFT warm-start, then its GRPO recipe, on the device."""
    from relayrl.jobs.demo import GRPO, SFT
    from relayrl.jobs.sft import SFTJobConfig, run_sft

    steps = steps or (2 if small else 4)
    data = {**GRPO["data"], **({"n_train": 256, "n_eval": 8} if small else {})}
    sft_cfg = SFTJobConfig.from_dict({**SFT, "data": data, "eval": {"max_tokens": 6},
                                      "sft": {**SFT["sft"], "steps": 2 if small else 30, "out_dir": tempfile.mkdtemp(),
                                              "tensorboard": False, "device": device.split(":")[0]}})
    sft = run_sft(sft_cfg, show_progress=False)
    rollout = {**GRPO["rollout"], **({"prompts_per_step": 4, "group_size": 4} if small else {})}
    trainer = {**GRPO["trainer"], **({"micro_batch_size": 8} if small else {})}

    def make(backend: str):
        return grpo_config({"path": sft["model_dir"]}, device, rollout=rollout, trainer=trainer, data=data,
                           algo=GRPO["algo"], backend=backend)

    res = summarize(run_loop(make("relayrl"), steps))
    res["sft_eval_accuracy"] = sft["eval_last"]["eval/accuracy"]
    with_vllm(make, steps, res)
    return res


def check_grpo_05b(device: str, small: bool, steps: int | None) -> dict:
    """A random model of Qwen2.5-0.5B's shape through the loop: bf16 engine, bf16 autocast trainer."""
    steps = steps or (2 if small else 4)
    t = time.perf_counter()
    path = random_05b_dir(small)
    built = time.perf_counter() - t
    data = {"task": "arith", "n_train": 512, "n_eval": 8}
    rollout = ({"prompts_per_step": 2, "group_size": 2, "max_tokens": 8} if small else
               {"prompts_per_step": 16, "group_size": 8, "max_tokens": 128})
    trainer = {"lr": 1e-6, "bf16": True, "micro_batch_size": 4 if small else 16}

    # a random model's near-uniform logits over 151936 tokens: its bf16 canary gap is not the trained demo's
    # (sync.gap_bound's default comes from those); the gap is reported (sync/canary_gap), the checksums still
    # place every piece on the first sync
    def make(backend: str):
        return grpo_config({"path": path}, device, rollout=rollout, trainer=trainer, data=data, backend=backend,
                           sync={"gap_bound": 0.25})

    res = {"model_build_s": round(built, 1), **summarize(run_loop(make("relayrl"), steps))}
    with_vllm(make, steps, res)
    if "parity" in res:
        res["greedy"] = greedy_parity(path, device, prompts(16), 64)
    return res


def engine_device(engine: LLMEngine) -> str:
    """Where a rollout worker's engine computes (run in the worker: RolloutRole._engine)."""
    return str(next(iter(engine.runner.model.parameters())).device)


def check_fleet(path: str, device: str) -> dict:
    from relayrl.models.tokenizer import load_tokenizer
    from relayrl.roles.fleet import RolloutFleet
    from relayrl.roles.fleet_replicas import replica_devices
    from relayrl.single_controller.liveness import GroupOptions

    kind = device.split(":")[0]
    gpus = replica_devices(torch.cuda.device_count(), 1, 1) if kind == "cuda" else None
    ids = prompts(16)
    params = [SamplingParams(n=4, temperature=1.0, max_tokens=32, seed=100 + i, ignore_eos=True) for i in range(16)]
    one = LLMEngine.from_pretrained(path, device=device, seed=0)
    want = [[s.token_ids for s in o.samples] for o in one.generate(ids, params)]
    del one
    out: dict = {}
    for n in (1, 2):
        fleet = RolloutFleet.own_processes(n, path, {"seed": 0}, GroupOptions(threads=1), load_tokenizer(path),
                                           device=kind, gpus=gpus)
        try:
            fleet.generate(ids[:n], params[:n])  # warm-up
            t = time.perf_counter()
            outs = fleet.generate(ids, params)
            wall = time.perf_counter() - t
            got = [[s.token_ids for s in o.samples] for o in outs]
            out[f"replicas{n}_tokens_per_s"] = round(sum(len(x) for g in got for x in g) / wall, 1)
            out[f"replicas{n}_devices"] = [role._engine(engine_device) for role in fleet.replicas]
            out[f"replicas{n}_samples_equal_to_one_engine"] = round(
                sum(a == b for ga, gb in zip(got, want, strict=True) for a, b in zip(ga, gb, strict=True))
                / sum(len(g) for g in want), 3)
        finally:
            fleet.close()
    out["ratio_2_vs_1"] = round(out["replicas2_tokens_per_s"] / out["replicas1_tokens_per_s"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="the tiny model instead of the ~25M one")
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps of each loop (default: 4; 2 with --small)")
    ap.add_argument("--only", nargs="*", default=None, help="run only these checks (names as printed)")
    a = ap.parse_args()
    path = model_dir(a.small)
    results = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
               "torch": torch.__version__}
    checks = (("nccl", check_nccl), ("greedy_fp32", check_greedy), ("bf16", check_bf16),
              ("throughput", check_throughput), ("sync", check_sync),
              ("grpo_demo", lambda p, d: check_grpo_demo(d, a.small, a.steps)),
              ("grpo_0.5b", lambda p, d: check_grpo_05b(d, a.small, a.steps)), ("fleet", check_fleet))
    for name, fn in checks:
        if a.only and name not in a.only:
            continue
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
