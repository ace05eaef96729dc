"""The training loop: AdamW over the trainable parameters, linear warm-up then cosine (or constant)
learning rate, gradient accumulation and clipping, eval before / every N steps / after, checkpoints,
and the run's record. Losses are summed over an optimizer step's target tokens and divided by their
count (so accumulation and padding change nothing), their logits computed a chunk of tokens at a time.
Everything random comes from the seed: two CPU runs with one config give the same losses bit for bit, and
a resumed run continues as the uninterrupted one.
Entry points: `train(cfg, resume=...)`, `reproduce(manifest, output)`.
"""

from __future__ import annotations

import contextlib
import math
import random
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from moeswap.atomic_dir import remove_stale_in
from moeswap.options import LoadOptions
from moeswap.procfs import peak_rss_bytes
from moeswap.train import manifest as record
from moeswap.train.budget import check_fits
from moeswap.train.checkpoint import CHECKPOINTS, latest_checkpoint, load_checkpoint, read_state, save_checkpoint
from moeswap.train.config import TrainConfig
from moeswap.train.data import IGNORE, Data, RowStream, batch, eval_rows, load_data
from moeswap.train.experts import balance_routers, balanced_biases, load_report
from moeswap.train.progress import LossLog, StepLines
from moeswap.train.targets import lora_config, prepare_model, save_trained

# Settings a resumed run may change: when and what it writes, where experts are kept. Anything else
# changes the math, and the run would no longer be the one its checkpoint continues.
# ep_mode too: like the number of ranks (not a setting), it changes only the order gradients are summed in.
RESUME_MAY_CHANGE = {"eval_interval", "save_interval", "keep_checkpoints", "ep_mode", "log_interval"}
LOAD_MAY_CHANGE = {"expert_memory", "host_memory", "expert_policy", "prefetch", "expert_profile", "drop_page_cache",
                   "expert_reads", "read_threads"}


class NonFiniteError(ValueError):
    """The loss or the gradient became NaN or infinite; the run stops before writing anything from it."""


@dataclass
class TrainResult:
    out_dir: Path
    manifest: dict[str, Any]

    @property
    def curve(self) -> list[dict[str, Any]]:
        return self.manifest["curve"]

    @property
    def losses(self) -> list[float]:
        return [p["loss"] for p in self.manifest["curve"]]


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """The learning rate of optimizer step `step` (0-based) as a fraction of the peak: (step+1)/warmup
    during warm-up, then 1 (constant) or a cosine from 1 down to min_ratio at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total - warmup - 1)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def total_steps(cfg: TrainConfig, stream: RowStream) -> int:
    """--max-steps, else the optimizer steps that cover --epochs passes over the rows (the last step may
    reach into the next pass: the row stream runs on across epochs)."""
    return cfg.max_steps or math.ceil(stream.total_rows(cfg.epochs) / cfg.rows_per_step)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def make_optimizer(params: list[tuple[str, torch.nn.Parameter]], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (norm weights, biases and gate vectors are left alone)."""
    decay = [p for _, p in params if p.ndim >= 2]
    rest = [p for _, p in params if p.ndim < 2]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                          {"params": rest, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=1e-8, foreach=False)


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _loss_sum(model, rows, pad_id: int, cfg: TrainConfig, device: torch.device) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the rows' target tokens, and their real (unpadded) token count.
    With cfg.loss_chunk the logits exist loss_chunk tokens at a time: each chunk's head projection and
    cross-entropy are recomputed in backward, so neither the [tokens, vocab] logits nor their gradient is
    ever whole (Kimi K3's 163,840-token vocabulary makes them 2.7 GB per 4,096-token row in fp32)."""
    tokens, labels = batch(rows, pad_id)
    labels, count = labels.to(device).flatten(), sum(len(ids) for ids, _ in rows)
    chunk = cfg.loss_chunk
    with _autocast(cfg, device):
        if not chunk:
            return _cross_entropy(model(tokens.to(device)).flatten(0, 1), labels), count
        hidden = model(tokens.to(device), hidden_only=True).flatten(0, 1)
    loss = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, hidden.shape[0], chunk):
        part = (hidden[i:i + chunk], labels[i:i + chunk])
        if torch.is_grad_enabled():
            loss = loss + checkpoint(_head_loss, model, cfg, *part, use_reentrant=False)
        else:
            loss = loss + _head_loss(model, cfg, *part)
    return loss, count


def _head_loss(model, cfg: TrainConfig, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of some tokens' final hidden states through the model's head."""
    with _autocast(cfg, hidden.device):
        logits = model.head(hidden)
    return _cross_entropy(logits, labels)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed fp32 cross-entropy of logits [N, V] against labels [N], IGNORE labels left out."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum")


def step_gradients(model, rows, pad_id: int, cfg: TrainConfig, device: torch.device, step: int,
                   ep=None, after: Callable[[int], None] | None = None) -> tuple[float, int]:
    """Accumulates into .grad the gradient of one optimizer step's mean loss over all its rows' target
    tokens, grad_accum forward passes of micro_batch rows; returns (that mean, real tokens). Under
    data-parallel expert parallelism (`ep` with token dispatch) micro-batch k runs on rank k mod N, and
    `after(k)` follows its backward (distributed/grads.py takes its gradients); the mean is summed from
    every micro-batch's loss in k order, as one process sums it."""
    targets = sum(sum(mask[1:]) for _, mask in rows)  # the whole step's: each rank divides by the global count

    def one(k: int) -> tuple[float, int]:
        loss, n = _loss_sum(model, rows[k * cfg.micro_batch:(k + 1) * cfg.micro_batch], pad_id, cfg, device)
        value = loss.item()
        if not math.isfinite(value):
            raise NonFiniteError(f"step {step + 1}: the loss is {value}; stopping without saving "
                                 f"(lower --lr, or check the data and the base model)")
        (loss / targets).backward()
        if after is not None:
            after(k)
        return value, n

    total, tokens = 0.0, 0
    for value, n in _micro_batches(ep, cfg.grad_accum, one):
        total += value
        tokens += n
    return total / targets, tokens


def _micro_batches(ep, n: int, run: Callable[[int], Any]) -> list:
    """[run(k) for k in range(n)]: here, or under data-parallel expert parallelism k on rank k mod N, every
    result gathered on every rank in k order (a rank with fewer micro-batches serves the others' experts
    until all are done)."""
    if ep is None or ep.dispatch is None:
        return [run(k) for k in range(n)]
    from moeswap.distributed.cli import data_parallel_map

    return data_parallel_map(ep, n, run)


@torch.no_grad()
def evaluate(model, rows, pad_id: int, cfg: TrainConfig, device: torch.device, ep=None) -> float | None:
    """Mean loss per target token over the eval rows (None without eval rows); dropout off. Under
    data-parallel expert parallelism the micro-batches are split over the ranks as in training."""
    if not rows:
        return None
    was_training = model.training
    model.eval()
    parts = [rows[i:i + cfg.micro_batch] for i in range(0, len(rows), cfg.micro_batch)]
    total, targets = 0.0, 0
    try:
        results = _micro_batches(ep, len(parts), lambda i: (_loss_sum(model, parts[i], pad_id, cfg, device)[0].item(),
                                                            sum(sum(mask[1:]) for _, mask in parts[i])))
    finally:
        model.train(was_training)
    for value, n in results:
        total += value
        targets += n
    value = total / targets
    if not math.isfinite(value):
        raise NonFiniteError(f"the eval loss is {value}: the model computes non-finite values")
    return value


def _check_output(out: Path, resume: bool) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from and its checked state.json, before anything loads (None: a fresh
    run, whose output directory is made empty)."""
    remove_stale_in(out / CHECKPOINTS)  # a run killed while staging a checkpoint must not block the next
    if resume:
        if (out / record.MANIFEST).exists():
            raise ValueError(f"{out}: this run has finished ({record.MANIFEST} exists); nothing to resume")
        found = latest_checkpoint(out)
        if found is None:
            raise ValueError(f"--resume: no checkpoint in {out / CHECKPOINTS} to resume from "
                             "(--save-interval N writes one every N steps; without --resume the run starts over)")
        return found, read_state(found)
    if out.exists() and (not out.is_dir() or not _holds_no_run(out)):
        raise FileExistsError(f"{out} exists and is not empty; pass --resume to continue the run it holds, "
                              "or choose another --output")
    out.mkdir(parents=True, exist_ok=True)
    return None


def _holds_no_run(out: Path) -> bool:
    """Whether `out` is empty but for what a run that stopped before its first checkpoint leaves: an empty
    checkpoints/ and its loss.csv so far (a fresh run may start there; anything else is the user's and stays
    refused)."""
    def leftover(e: Path) -> bool:
        if e.is_symlink():
            return False
        if e.name == record.LOSS_CSV and e.is_file():
            return True
        return e.name == CHECKPOINTS and e.is_dir() and not any(e.iterdir())

    return all(leftover(e) for e in out.iterdir())


def _check_same_settings(state: dict[str, Any], cfg: TrainConfig, path: Path) -> None:
    then, now = state["config"], cfg.as_dict()
    for key in now:
        if key == "load":
            for k in now["load"]:
                # (a setting newer than the checkpoint: it ran with the default)
                was = then["load"].get(k, getattr(LoadOptions(), k, None))
                if k not in LOAD_MAY_CHANGE and was != now["load"][k]:
                    raise ValueError(f"--resume: checkpoint {path} was made with {k}={was!r}, "
                                     f"this run has {now['load'][k]!r}; resume with the same settings")
        elif key not in RESUME_MAY_CHANGE and then.get(key) != now[key]:
            raise ValueError(f"--resume: checkpoint {path} was made with {key}={then.get(key)!r}, this run has "
                             f"{now[key]!r}; resume with the same settings")


def _check_same_inputs(state: dict[str, Any], cfg: TrainConfig, data_sha: list[str], base: dict[str, Any], path: Path):
    if state["data_sha256"] != data_sha:
        raise ValueError(f"--resume: the data files changed since checkpoint {path} was written "
                         "(their SHA-256 differ)")
    if state["base_digest"] != base["digest"]:
        raise ValueError(f"--resume: the base model {cfg.model} is not the one checkpoint {path} was trained on "
                         "(its fingerprint differs)")


def _no_gradient(params) -> list[str]:
    return [name for name, p in params if p.grad is None]


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool | None = None,
          on_checkpoint: Callable[[int, Path], None] | None = None, stop_after: int | None = None) -> TrainResult:
    """Runs `cfg` to the end (or continues its output's run with resume=True) and writes the trained
    weights or adapter, manifest.json, loss.csv and loss.png into cfg.output. stop_after=N: only the run's
    first N steps, on its own schedule, writing nothing but checkpoints and loss.csv so far; the result's
    manifest then holds just the curve and the evals so far (a prefix for `reproduce`). loss.csv grows a row
    per step as the run goes (train/progress.py); without a progress bar, stderr gets a line every
    cfg.log_interval steps."""
    from moeswap import tuning

    out = Path(cfg.output)
    made = [d for d in (out, *out.parents) if not d.exists()]  # what mkdir(parents=True) will make, deepest first
    try:
        with tuning.heap_for_training():  # a step's large buffers reused from the heap, not page-faulted afresh
            return _train(cfg, resume, progress, on_checkpoint, stop_after)
    except BaseException:
        # refused, failed or stopped before its first checkpoint: nothing to resume, so nothing is left
        if made and out.is_dir() and _holds_no_run(out):
            shutil.rmtree(out, ignore_errors=True)
            for parent in made[1:]:  # and the directories made above it, while nothing else went in
                with contextlib.suppress(OSError):
                    parent.rmdir()
        raise


def _train(cfg: TrainConfig, resume: bool, progress: bool | None, on_checkpoint, stop_after: int | None) -> TrainResult:
    from tqdm import tqdm

    from moeswap.models.loader import load_model
    from moeswap.text.tokenizer import load_tokenizer

    started = time.perf_counter()
    cfg.require_inputs()
    out = Path(cfg.output)
    resume_from = _check_output(out, resume)
    if resume_from is not None:
        _check_same_settings(resume_from[1], cfg, resume_from[0])
    seed_everything(cfg.seed)
    # full mode trains the dense weights themselves: they load in the compute dtype, not kept as stored bf16
    options = cfg.load if cfg.mode == "lora" else cfg.load.replace(dense_weights="compute")
    model, store = load_model(cfg.model, options)
    ep, log = None, None
    try:
        ep = _join_expert_parallel(model, cfg, options)  # under torchrun: experts split, rank 0 writes
        lead = ep is None or ep.rank == 0
        tok = load_tokenizer(cfg.model)
        data = load_data(cfg, tok)
        pad_id = tok.eos_ids[0]
        data_sha = [f.sha256 for f in data.files]
        if ep is not None:
            from moeswap.distributed.runtime import check_same_everywhere

            check_same_everywhere(ep, "training data (SHA-256 of each file)", data_sha)
        base = record.fingerprint(cfg.model)
        device = torch.device(options.device)
        # under expert parallelism each rank builds only its own experts' LoRA rows (LoRAShards.split keeps
        # them); --resume loads one process's checkpoint whole first, so it builds every row
        owned = None if ep is None or resume_from is not None else (lambda layer: ep.placement.owned(ep.rank, layer))
        check_fits(model, cfg, lora_config(cfg), experts=ep is None)  # before the allocator is asked
        params = prepare_model(model, cfg, owned)
        # routers whose selection bias follows the balancing rule: state a checkpoint must keep too
        balanced = balanced_biases(model)
        saved = params + balanced
        model.train()
        optimizer = make_optimizer(params, cfg)
        stream = RowStream(data.train, cfg.seed, cfg.seq_len, cfg.packing)
        held_out = eval_rows(data.eval)
        total = total_steps(cfg, stream)
        history: dict[str, Any] = {"step": 0, "rows": 0, "tokens": 0, "train_s": 0.0, "wall_s": 0.0,
                                   "curve": [], "eval": [], "no_gradient": None, "segments": []}
        if resume_from is not None:
            path, state = resume_from
            _check_same_inputs(state, cfg, data_sha, base, path)
            load_checkpoint(path, saved, optimizer, state)
            history = state["history"]
        else:
            history["eval"].append({"step": 0, "loss": evaluate(model, held_out, pad_id, cfg, device, ep)})
        shards = None
        if ep is not None:  # each routed expert's LoRA and AdamW state from here on only on its owner's rank
            from moeswap.distributed.lora_shards import LoRAShards

            shards, params, optimizer = LoRAShards.split(ep, model, params, optimizer,
                                                         lambda ps: make_optimizer(ps, cfg))
            saved = params + balanced
        history["segments"].append({"from_step": history["step"]})
        show = (sys.stderr.isatty() if progress is None else progress) and lead
        bar = tqdm(total=total, initial=history["step"], disable=not show, unit="step", dynamic_ncols=True,
                   desc="train", file=sys.stderr)
        if lead:  # rewritten from the history: a resumed run's rows stop at its checkpoint's step
            log = LossLog(out, history)
        lines = StepLines(cfg.log_interval if lead and not show else 0, total, history["step"])
        segment_tokens, segment_s = 0, 0.0
        end = total if stop_after is None else min(total, stop_after)
        for step in range(history["step"], end):
            t0 = time.perf_counter()
            lr = cfg.lr * lr_factor(step, total, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            rows = stream.rows(history["rows"], cfg.rows_per_step)
            summed = None
            if ep is not None and ep.dispatch is not None:  # data-parallel: every micro-batch's part, summed
                from moeswap.distributed.grads import StepGradients

                summed = StepGradients(ep, params, set() if shards is None else set(shards.parts))
            loss_mean, tokens = step_gradients(model, rows, pad_id, cfg, device, step, ep,
                                               None if summed is None else summed.take)
            if summed is not None:
                summed.sum(cfg.grad_accum)
            elif ep is not None:  # expert LoRA not split by owner (none is, today): every rank sums its gradients
                ep.reduce_expert_lora_grads(model)
            if shards is not None:  # the norm over whole gradients; zeros where an owner's experts got none
                norm = shards.clip_gradients(params, cfg.max_grad_norm)
            if history["no_gradient"] is None:
                history["no_gradient"] = _warn_no_gradient(params)
            if shards is None:
                norm = torch.nn.utils.clip_grad_norm_([p for _, p in params if p.grad is not None],
                                                      cfg.max_grad_norm or math.inf).item()
            if not math.isfinite(norm):
                raise NonFiniteError(f"step {step + 1}: the gradient norm is {norm}; stopping without saving "
                                     f"(lower --lr or set --max-grad-norm)")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if balanced:
                balance_routers(model, cfg.router_bias_rate)
            elapsed = time.perf_counter() - t0
            segment_tokens, segment_s = segment_tokens + tokens, segment_s + elapsed
            history.update(step=step + 1, rows=history["rows"] + len(rows), tokens=history["tokens"] + tokens,
                           train_s=history["train_s"] + elapsed)
            history["curve"].append({"step": step + 1, "loss": loss_mean, "lr": lr, "tokens": tokens,
                                     "grad_norm": norm, "time_s": elapsed})
            shown = dict(loss=f"{loss_mean:.4f}", tok_s=f"{segment_tokens / segment_s:.0f}")
            if balanced:  # experts are weights: no store to hit; the load balance is what to watch
                shown["load"] = f"{load_report(model)['worst_max_over_mean']:.2f}"
            else:
                shown["hit"] = f"{store.stats.hit_rate:.0%}"
            bar.set_postfix(**shown, lr=f"{lr:.2e}", refresh=False)
            bar.update(1)
            last = step + 1 == total
            loss_eval = None
            if cfg.eval_interval and (step + 1) % cfg.eval_interval == 0 and not last:
                loss_eval = evaluate(model, held_out, pad_id, cfg, device, ep)
                history["eval"].append({"step": step + 1, "loss": loss_eval})
                if loss_eval is not None and lead:
                    bar.write(f"step {step + 1}: eval loss {loss_eval:.4f}", file=sys.stderr)
            if log is not None and not last:  # the last row waits for the final eval
                log.append(history["curve"][-1], loss_eval)
            if lines.due(step + 1, end):
                done = step + 1 - lines.first
                lines.show(step + 1, loss_mean, lr, segment_tokens / segment_s,
                           history["wall_s"] + time.perf_counter() - started, segment_s / done * (total - step - 1))
            if cfg.save_interval and (step + 1) % cfg.save_interval == 0 and not last:
                # split expert LoRA: every rank hands its rows over, rank 0 writes one process's layout
                whole, whole_opt = shards.whole(saved, optimizer, root=0) if shards is not None else (saved, optimizer)
                if lead:
                    history["wall_s"] += time.perf_counter() - started
                    started = time.perf_counter()
                    path = save_checkpoint(out, step + 1, whole, whole_opt,
                                           {"history": history, "config": cfg.as_dict(), "data_sha256": data_sha,
                                            "base_digest": base["digest"]}, cfg.keep_checkpoints)
                    if on_checkpoint is not None:
                        on_checkpoint(step + 1, path)
                del whole, whole_opt
        bar.close()
        if end < total:
            evals = [e for e in history["eval"] if e["loss"] is not None]
            return TrainResult(out, {"curve": history["curve"], "eval": evals})
        if not history["eval"] or history["eval"][-1]["step"] != total:
            history["eval"].append({"step": total, "loss": evaluate(model, held_out, pad_id, cfg, device, ep)})
        if log is not None:
            log.append(history["curve"][-1], history["eval"][-1]["loss"])
            log.close()
        history["wall_s"] += time.perf_counter() - started
        if shards is not None:  # the adapter is one PEFT file: every expert's LoRA whole again, on rank 0
            params = shards.join(params, root=0)
        if not lead:  # the same parameters as rank 0's, which writes them
            return TrainResult(out, {})
        manifest = _manifest(cfg, data, base, params, history, store, segment_tokens, segment_s, ep)
        if balanced:
            manifest["expert_load"] = load_report(model)
        meta = {"base_digest": base["digest"], "steps": total}
        record.publish(out, lambda staging: save_trained(model, cfg, params, staging, base, meta), manifest)
        return TrainResult(out, record.read_manifest(out))
    finally:
        if log is not None:
            log.close()
        store.close()
        if ep is not None:
            from moeswap.distributed.runtime import shutdown

            shutdown(ep)


def _join_expert_parallel(model, cfg: TrainConfig, options):
    """This rank's ExpertParallel when started by torchrun (WORLD_SIZE > 1), else None. cfg.ep_mode
    data-parallel: each rank runs its micro-batches, its tokens dispatched to the experts' owners;
    replicated: every rank trains on the same rows. LoRA dropout draws per expert from the process's
    generator, so ranks computing different experts would draw different masks."""
    from moeswap.distributed.runtime import init_expert_parallel, launched

    if not launched():
        return None
    if cfg.mode == "full" and cfg.target_modules is None:
        raise ValueError("full mode with every parameter trains the routed experts as replicated weights, which "
                         "expert parallelism does not split yet; give --target-modules (routed experts then stay "
                         "frozen) or use --mode lora")
    if cfg.dropout:
        raise ValueError("--dropout must be 0 under expert parallelism (each rank draws only for its own experts, "
                         "so the ranks' dropout masks would differ)")
    data_parallel = cfg.ep_mode == "data-parallel"
    if data_parallel and cfg.precision != "fp32":
        raise ValueError(f"--precision {cfg.precision} is not supported with --ep-mode data-parallel yet (an owner "
                         "computing other ranks' tokens outside their forward would miss its autocast); use fp32 or "
                         "--ep-mode replicated")
    return init_expert_parallel(model, cfg.model, options, data_parallel=data_parallel)


def _warn_no_gradient(params) -> list[str]:
    """Trainable tensors the first backward left without a gradient (they would stay as loaded): an error
    when that is all of them, else a warning naming them."""
    missing = _no_gradient(params)
    if len(missing) == len(params):
        raise ValueError("no trainable parameter received a gradient: the targets are not on the loss's path")
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        warnings.warn(f"{len(missing)} of {len(params)} trainable tensors receive no gradient and stay as loaded: "
                      f"{shown}", stacklevel=3)
    return missing


def _manifest(cfg: TrainConfig, data: Data, base: dict[str, Any], params, history: dict[str, Any], store,
              segment_tokens: int, segment_s: float, ep=None) -> dict[str, Any]:
    evals = [e for e in history["eval"] if e["loss"] is not None]
    return {
        "format": record.FORMAT, "kind": "moeswap train", "mode": cfg.mode,
        "base": {"model": cfg.model, "fingerprint": base},
        "data": data.summary(), "config": cfg.as_dict(), "seed": cfg.seed,
        "environment": record.environment(),
        "trainable": {"tensors": len(params), "parameters": sum(p.numel() for _, p in params),
                      "without_gradient": history["no_gradient"] or []},
        "steps": history["step"], "tokens": history["tokens"], "wall_s": history["wall_s"],
        "train_s": history["train_s"],
        "tokens_per_s": history["tokens"] / history["train_s"] if history["train_s"] else None,
        "last_segment_tokens_per_s": segment_tokens / segment_s if segment_s else None,
        "segments": history["segments"], "peak_rss_bytes": peak_rss_bytes(),
        "expert_store": store.stats.as_dict(),  # of the last segment (a resumed run starts a fresh store)
        # of the last segment, as the store: rank 0's figures; None in one process
        "expert_parallel": None if ep is None else {
            "world_size": ep.world, "mode": "replicated" if ep.dispatch is None else "data-parallel",
            "placement": ep.placement.kind,
            "rank0": ep.stats.as_dict() if ep.dispatch is None else ep.dispatch.stats.as_dict()},
        "curve": history["curve"], "eval": evals,
        "eval_loss_before": evals[0]["loss"] if evals and evals[0]["step"] == 0 else None,
        "eval_loss_after": evals[-1]["loss"] if evals else None,
    }


def reproduce(manifest_path: str | Path, output: str | Path, *, tolerance: float = 0.0,
              progress: bool | None = None, first_steps: int | None = None) -> tuple[bool, str, TrainResult]:
    """Runs a manifest's config again into `output` (at its thread count) and compares the loss curves.
    The data files and the base model must be the recorded ones (checked first). first_steps=N: only the
    run's first N steps (on the recorded schedule) against the recorded curve's first N, and the evals
    up to step N."""
    from moeswap.train.checkpoint import file_sha256

    old = record.read_manifest(manifest_path)
    cfg = TrainConfig.from_dict(old["config"], where=f"{manifest_path}: config").replace(output=str(Path(output)))
    for f in old["data"]["files"]:
        if not Path(f["path"]).is_file():
            raise FileNotFoundError(f"--reproduce: the recorded data file {f['path']} is not there")
        if file_sha256(Path(f["path"])) != f["sha256"]:
            raise ValueError(f"--reproduce: {f['path']} is not the recorded data (its SHA-256 differs)")
    if record.fingerprint(cfg.model)["digest"] != old["base"]["fingerprint"].get("digest"):
        raise ValueError(f"--reproduce: the base model {cfg.model} is not the recorded one (its fingerprint differs)")
    threads = old.get("environment", {}).get("hardware", {}).get("torch_threads")
    if isinstance(threads, int) and threads > 0:
        torch.set_num_threads(threads)  # GEMMs sum in another order at another thread count
    if first_steps is not None:
        if not 0 < first_steps <= len(old["curve"]):
            raise ValueError(f"--first-steps must be between 1 and the recorded run's {len(old['curve'])} steps, "
                             f"got {first_steps}")
        old = {**old, "curve": old["curve"][:first_steps], "eval": [e for e in old["eval"] if e["step"] <= first_steps]}
    result = train(cfg, progress=progress, stop_after=first_steps)
    ok, message = record.check_reproduction(old, result.manifest, tolerance)
    return ok, message, result
