"""One rank of the expert-parallel tests, started by test_expert_parallel.py with torchrun's environment
variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). argv[1]: a JSON job; writes its results with
torch.save to job["out"] + f".{rank}" (or {"error": message} when it fails)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def main() -> None:
    job = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    out = f"{job['out']}.{rank}"
    torch.set_num_threads(1)
    import moeswap
    from moeswap.distributed.runtime import init_expert_parallel, shutdown
    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.models.loader import LoadOptions, load_model

    if job.get("train"):
        return train_step(job, rank, out)
    if job.get("split_lora"):
        return split_lora_step(job, rank, out)
    if job.get("train_rows"):
        return train_rows(job, rank, out)
    if job.get("dp_serve"):
        return dp_serve(job, rank, out)
    for key, run in (("dp_train", dp_train_steps), ("data_parallel", data_parallel_runs)):
        if job.get(key):
            try:
                return run(job, rank, out)
            except Exception as err:  # the test reads the message
                torch.save({"error": f"{type(err).__name__}: {err}"}, out)
                sys.stdout.flush()
                os._exit(3)  # no clean-up that waits on peers
    if job.get("version", {}).get(str(rank)):
        moeswap.__version__ = job["version"][str(rank)]  # a rank started from another moeswap release
    model_dir = job["models"][rank] if "models" in job else job["model"]
    result: dict = {"runs": []}
    ep = None
    try:
        for budget in job["budgets"]:
            options = LoadOptions(dtype="float32", expert_memory=budget, prefetch=job.get("prefetch", "none"))
            model, store = load_model(model_dir, options)
            if ep is None:
                ep = init_expert_parallel(model, model_dir, options, job.get("trace"), timeout_s=job["timeout"])
            else:  # the same process group and placement for the next model
                from moeswap.distributed.ep import apply_expert_parallel

                fresh = apply_expert_parallel(model, None, ep.placement)
                fresh.diagnose, fresh.heartbeat = ep.diagnose, ep.heartbeat
            run = {}
            with torch.no_grad():
                run["logits"] = model(torch.tensor([job["prompt"]]))[0]
                if job.get("die") == rank:
                    os._exit(17)  # a rank lost mid-job: the others are in or about to enter an exchange
                if job.get("hang") == rank:
                    time.sleep(job["hang_s"])  # alive (its heartbeat runs) but never comes to the exchange
                    os._exit(0)
                if job.get("die") is not None or job.get("hang") is not None:
                    model(torch.tensor([job["prompt"]]))
            gen = generate(model, job["prompt"][:12], GenerationConfig(max_tokens=job["max_tokens"], stop_ids=()))
            run["tokens"] = gen.tokens
            run["native_steps"] = gen.native_steps
            run["executor"] = gen.expert_executor
            run["resident"] = sorted((k.layer, k.expert) for k in store.fast.keys())
            run["disk_reads"] = store.stats.disk_reads
            run["ep"] = model.expert_parallel.stats.as_dict()
            run["owners"] = [list(o) for o in model.expert_parallel.placement.owners]
            store.close()
            result["runs"].append(run)
        shutdown(ep)
    except Exception as err:  # the test reads the message
        result = {"error": f"{type(err).__name__}: {err}"}
        torch.save(result, out)
        sys.stdout.flush()
        os._exit(3)  # no clean-up that waits on peers
    torch.save(result, out)


def data_parallel_runs(job: dict, rank: int, out: str) -> None:
    """Data-parallel attention with token dispatch: prompt i on rank i % world, for each budget its logits
    (one forward pass over the whole prompt) and greedy tokens; every rank saves every prompt's results."""
    from moeswap.distributed.cli import data_parallel_map
    from moeswap.distributed.ep import apply_expert_parallel
    from moeswap.distributed.runtime import init_expert_parallel, shutdown
    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.models.loader import LoadOptions, load_model

    prompts, result, ep = job["prompts"], {"runs": []}, None
    for budget in job["budgets"]:
        options = LoadOptions(dtype="float32", expert_memory=budget)
        model, store = load_model(job["model"], options)
        if ep is None:
            ep = init_expert_parallel(model, job["model"], options, None, timeout_s=job["timeout"], data_parallel=True)
        else:  # the same process group and placement for the next model
            fresh = apply_expert_parallel(model, None, ep.placement, data_parallel=True)
            fresh.diagnose, fresh.heartbeat = ep.diagnose, ep.heartbeat

        def one(i, model=model):
            with torch.no_grad():
                logits = model(torch.tensor([prompts[i]]))[0]
            if job.get("die") == rank:
                os._exit(17)  # lost between its forward passes: the other rank is in an exchange or enters one
            gen = generate(model, prompts[i], GenerationConfig(max_tokens=job["max_tokens"][i], stop_ids=()))
            return {"logits": logits, "tokens": gen.tokens, "rank": rank, "native_steps": gen.native_steps,
                    "executor": gen.expert_executor}

        run = {"results": data_parallel_map(model.expert_parallel, len(prompts), one)}
        run["resident"] = sorted((k.layer, k.expert) for k in store.fast.keys())
        run["disk_reads"] = store.stats.disk_reads
        run["dispatch"] = model.expert_parallel.dispatch.stats.as_dict()
        store.close()
        result["runs"].append(run)
    shutdown(ep)
    torch.save(result, out)


def lora_step_inputs(model_dir: str, budget: int):
    """(model, store, cfg, params, tokens, weights) of a LoRA step on every target kind, the adapter non-zero."""
    from moeswap.models.loader import load_model
    from moeswap.train.config import TrainConfig
    from moeswap.train.targets import prepare_model
    from train.test_lora_grad import ALL_TARGETS, kda_in_range, set_adapter  # tests/ is on PYTHONPATH

    cfg = TrainConfig(model=model_dir, mode="lora", target_modules=ALL_TARGETS, rank=3, alpha=6.0)
    model, store = load_model(model_dir, cfg.load.replace(expert_memory=budget))
    kda_in_range(model)
    params = prepare_model(model, cfg)
    set_adapter(model)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, 500, (2, 24), generator=gen)
    weights = torch.randn(2, 24, 512, generator=gen, dtype=torch.float64)
    return model, store, cfg, params, tokens, weights


def split_lora_step(job: dict, rank: int, out: str) -> None:
    """Two AdamW steps with clipping, each routed expert's LoRA and optimizer state on its owner only
    (distributed/lora_shards.py): the shapes each rank holds, the gradient norms, and the parameters and
    optimizer state gathered whole."""
    from moeswap.distributed.lora_shards import LoRAShards
    from moeswap.distributed.runtime import init_expert_parallel, shutdown
    from moeswap.train.loop import make_optimizer

    model, store, cfg, params, tokens, weights = lora_step_inputs(job["model"], job["budget"])
    ep = init_expert_parallel(model, job["model"], cfg.load.replace(expert_memory=job["budget"]), None,
                              timeout_s=job["timeout"])
    optimizer = make_optimizer(params, cfg)
    shards, params, optimizer = LoRAShards.split(ep, model, params, optimizer, lambda ps: make_optimizer(ps, cfg))
    norms = []
    for _ in range(2):
        (model(tokens).double() * weights).sum().backward()
        norms.append(shards.clip_gradients(params, 1e-3))  # small: the clip scales every gradient
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    held = {n: tuple(p.shape) for n, p in params if "expert_lora" in n}
    state = {tuple(st["exp_avg"].shape) for p, st in optimizer.state.items() if any(p is q for n, q in params
                                                                                    if "expert_lora" in n)}
    whole, whole_opt = shards.whole(params, optimizer)
    torch.save({"norms": norms, "held": held, "state_shapes": state, "params": {n: p.detach() for n, p in whole},
                "optimizer": whole_opt.state_dict()}, out)
    store.close()
    shutdown(ep)


SERVE_PROMPTS = [[(7 * i + 3) % 500 + 5 for i in range(30)], [(11 * i + 1) % 500 + 5 for i in range(9)],
                 [(5 * i + 2) % 500 + 5 for i in range(17)]]
SERVE_MAX_TOKENS = [6, 9, 4]


def serve_requests():
    """Greedy requests for the data-parallel serving test (ids 0, 1, 2)."""
    from moeswap.engine.scheduler import Request

    return [Request(p, n, stop_ids=(), id=i) for i, (p, n) in enumerate(zip(SERVE_PROMPTS, SERVE_MAX_TOKENS))]


def dp_serve(job: dict, rank: int, out: str) -> None:
    """Data-parallel serving without HTTP: rank 0 submits serve_requests() to its DataParallelLeader at once
    and steps it until done (which rank runs each, every token); the other ranks follow."""
    from moeswap.distributed.lockstep import follow, leader_scheduler, stop_followers
    from moeswap.distributed.runtime import init_expert_parallel, shutdown
    from moeswap.engine.scheduler import EngineConfig
    from moeswap.models.loader import LoadOptions, load_model

    options = LoadOptions(dtype="float32")
    model, store = load_model(job["model"], options)
    ep = init_expert_parallel(model, job["model"], options, None, timeout_s=job["timeout"], data_parallel=True)
    result: dict = {}
    if rank == 0:
        sched = leader_scheduler(ep)(model, EngineConfig(max_batch=4, max_len=256))
        for req in serve_requests():
            sched.submit(req)
        result["ranks"] = [sched._where.get(i, 0) for i in range(len(SERVE_PROMPTS))]
        tokens: dict = {}
        finish: dict = {}
        while sched.busy:
            for ev in sched.step():
                if ev.token is not None:
                    tokens.setdefault(ev.id, []).append(ev.token)
                if ev.finish_reason is not None:
                    finish[ev.id] = (ev.finish_reason, sched.finished.pop(ev.id).tokens)
        result.update(tokens=tokens, finish=finish)
        stop_followers(ep)
    else:
        follow(model, ep)
    result["dispatch"] = ep.dispatch.stats.as_dict()
    store.close()
    shutdown(ep)
    torch.save(result, out)


MICRO_BATCHES = 3  # on 2 ranks: rank 0 runs micro-batches 0 and 2, rank 1 serves its experts in the second round


def dp_lora_gradients(model_dir: str, budget: int, checkpointing: bool, join=None, die: int | None = None,
                      targets: list[str] | None = None):
    """One LoRA optimizer step's gradients over MICRO_BATCHES micro-batches of one row each (`targets`, by
    default K3's every target kind, routed experts included): (each micro-batch's loss, every gradient whole,
    the ExpertParallel).
    join(model, load options) -> ExpertParallel with token dispatch: data-parallel training as train/loop.py
    runs it (micro-batch k on rank k mod N, expert LoRA split by owner, gradients summed in micro-batch
    order); None: one process. die: that rank exits after its first forward pass, before its backward."""
    from moeswap.distributed.cli import data_parallel_map
    from moeswap.distributed.grads import StepGradients
    from moeswap.distributed.lora_shards import LoRAShards
    from moeswap.models.loader import load_model
    from moeswap.train.config import TrainConfig
    from moeswap.train.loop import make_optimizer
    from moeswap.train.targets import prepare_model
    from train.test_lora_grad import ALL_TARGETS, kda_in_range, set_adapter  # tests/ is on PYTHONPATH

    cfg = TrainConfig(model=model_dir, mode="lora", target_modules=tuple(targets or ALL_TARGETS), rank=3, alpha=6.0,
                      gradient_checkpointing=checkpointing)
    load = cfg.load.replace(expert_memory=budget)
    model, store = load_model(model_dir, load)
    try:
        ep = None if join is None else join(model, load)
        kda_in_range(model)
        params = prepare_model(model, cfg)
        set_adapter(model)
        shards = summed = None
        if ep is not None:
            shards, params, _ = LoRAShards.split(ep, model, params, make_optimizer(params, cfg),
                                                 lambda ps: make_optimizer(ps, cfg))
            summed = StepGradients(ep, params, set(shards.parts))
        gen = torch.Generator().manual_seed(5)
        tokens = torch.randint(3, 500, (MICRO_BATCHES, 20), generator=gen)
        weights = torch.randn(MICRO_BATCHES, 20, model.config.vocab_size, generator=gen, dtype=torch.float64)

        def one(k: int) -> float:
            loss = (model(tokens[k : k + 1]).double() * weights[k : k + 1]).sum()
            if ep is not None and die == ep.rank:
                os._exit(17)  # lost after its forward: the others wait for it in a backward exchange
            loss.backward()
            if summed is not None:
                summed.take(k)
            return loss.item()

        losses = data_parallel_map(ep, MICRO_BATCHES, one)
        if summed is not None:
            summed.sum(MICRO_BATCHES)
        grads = {}
        for name, p in params:
            if shards is not None and id(p) in shards.parts:  # every rank takes part in each gather
                grads[name] = shards._gather(p.grad if p.grad is not None else torch.zeros_like(p),
                                             shards.parts[id(p)][2])
            else:
                grads[name] = p.grad
        return losses, grads, ep
    finally:
        store.close()


def dp_train_steps(job: dict, rank: int, out: str) -> None:
    """dp_lora_gradients under data-parallel expert parallelism, without and with gradient checkpointing
    (one process group, a fresh model each)."""
    from moeswap.distributed.ep import apply_expert_parallel
    from moeswap.distributed.runtime import init_expert_parallel, shutdown

    first: list = []

    def join(model, load):
        if not first:
            first.append(init_expert_parallel(model, job["model"], load, None, timeout_s=job["timeout"],
                                              data_parallel=True))
            return first[0]
        fresh = apply_expert_parallel(model, None, first[0].placement, data_parallel=True)
        fresh.diagnose, fresh.heartbeat = first[0].diagnose, first[0].heartbeat
        return fresh

    runs = []
    for checkpointing in job["checkpointing"]:
        losses, grads, ep = dp_lora_gradients(job["model"], job["budget"], checkpointing, join, job.get("die"),
                                              job.get("targets"))
        runs.append({"checkpointing": checkpointing, "losses": losses, "grads": grads,
                     "graphs_left": len(ep.dispatch._graphs), "dispatch": ep.dispatch.stats.as_dict()})
    shutdown(first[0])
    torch.save({"runs": runs}, out)


def train_rows(job: dict, rank: int, out: str) -> None:
    """`moeswap train` as torchrun starts it (train/loop.py joins the process group from this environment),
    recording for every ExpertLoRA built, in build order: (num_experts, the row counts of its lora_A/lora_B
    tensors, its experts)."""
    from moeswap.models.layers.expert_lora import ExpertLoRA
    from moeswap.train.config import TrainConfig
    from moeswap.train.loop import train

    built = []
    init = ExpertLoRA.__init__

    def recording(lora, *args, **kwargs):
        init(lora, *args, **kwargs)
        built.append((lora.num_experts, sorted({p.shape[0] for p in lora.parameters()}), lora.experts))

    ExpertLoRA.__init__ = recording
    train(TrainConfig.from_dict(job["config"]), progress=False)
    torch.save({"built": built}, out)


def train_step(job: dict, rank: int, out: str) -> None:
    """One LoRA gradient step (every target kind, routed experts included) under expert parallelism: the
    loss and, after reduce_expert_lora_grads, every LoRA gradient."""
    from moeswap.distributed.runtime import init_expert_parallel, shutdown
    from moeswap.models.loader import load_model
    from moeswap.train.config import TrainConfig
    from moeswap.train.targets import prepare_model
    from train.test_lora_grad import ALL_TARGETS, kda_in_range, set_adapter  # tests/ is on PYTHONPATH

    cfg = TrainConfig(model=job["model"], mode="lora", target_modules=ALL_TARGETS, rank=3, alpha=6.0,
                      gradient_checkpointing=job["checkpointing"])
    load = cfg.load.replace(expert_memory=job["budget"])
    model, store = load_model(job["model"], load)
    ep = init_expert_parallel(model, job["model"], load, None, timeout_s=job["timeout"])
    kda_in_range(model)
    params = dict(prepare_model(model, cfg))
    set_adapter(model)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, 500, (2, 24), generator=gen)
    weights = torch.randn(2, 24, 512, generator=gen, dtype=torch.float64)
    loss = (model(tokens).double() * weights).sum()
    loss.backward()
    ep.reduce_expert_lora_grads(model)
    torch.save({"loss": loss.detach(), "grads": {n: p.grad for n, p in params.items()},
                "owners": [list(o) for o in ep.placement.owners]}, out)
    store.close()
    shutdown(ep)


if __name__ == "__main__":
    main()
