"""Parallel layouts: parse, check and enumerate (replicas x PP x TP x DP, experts over EP).

A replica's devices form `pp` stages of `tp * dp` devices each. Attention and dense weights split
over `tp` (and are copied over `dp`); routed experts split over `ep` groups within a stage, each
expert further split over `tp*dp/ep` devices. Stages own whole AttnRes blocks unless the caller
allows layer-granular splits. Knows nothing of bytes or time. Entry points: `parse_layout`,
`check_layout`, `enumerate_layouts`, `stage_layers`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from moeswap.config import ModelConfig

from .errors import PlanError


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1  # attention data parallel inside a stage (experts still shared over the stage via EP)
    ep: int = 1
    replicas: int = 1
    dcp: bool = False  # MLA latent cache split over the TP ranks instead of copied (decode context parallel)

    @property
    def stage_devices(self) -> int:
        return self.tp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.stage_devices // self.ep

    @property
    def replica_devices(self) -> int:
        return self.pp * self.stage_devices

    @property
    def devices(self) -> int:
        return self.replicas * self.replica_devices

    @property
    def name(self) -> str:
        parts = []
        if self.replicas > 1:
            parts.append(f"R{self.replicas}")
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        if self.dp > 1:
            parts.append(f"DP{self.dp}")
        parts.append(f"TP{self.tp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        return "×".join(parts) + ("+DCP" if self.dcp else "")


_TOKEN = re.compile(r"(tep|tp|pp|dp|ep|r|dcp)(\d*)")


def parse_layout(text: str) -> Layout:
    """Parse e.g. 'tp8', 'pp4xtp8', 'tp16/ep16', 'tep16', 'r2,pp2,tp8,dcp' (case and separators free)."""
    s = text.lower().replace("×", "x")
    vals: dict[str, int] = {}
    dcp = False
    pos = 0
    for m in _TOKEN.finditer(s):
        if s[pos:m.start()].strip(" ,/x*-+_"):
            break
        key, num = m.group(1), m.group(2)
        if key == "dcp":
            if num:
                raise PlanError(f"layout {text!r}: write 'dcp' without a number (it splits the MLA cache over TP)")
            dcp = True
        else:
            if not num or int(num) < 1:
                raise PlanError(f"layout {text!r}: {key} needs a positive degree, e.g. {key}8")
            for k in ("tp", "ep") if key == "tep" else (key,):
                if k in vals:
                    raise PlanError(f"layout {text!r} gives {k} twice")
                vals[k] = int(num)
        pos = m.end()
    if s[pos:].strip(" ,/x*-+_") or pos == 0:
        raise PlanError(
            f"cannot read layout {text!r}; write degrees like 'tp8', 'pp4xtp8', 'tp16/ep16', 'r2,tp8,dcp'"
        )
    return Layout(tp=vals.get("tp", 1), pp=vals.get("pp", 1), dp=vals.get("dp", 1), ep=vals.get("ep", 1),
                  replicas=vals.get("r", 1), dcp=dcp)


def blocks(cfg: ModelConfig) -> list[int]:
    """Layer counts of the AttnRes blocks (K3: 7 x 12 + 9); one block per layer without AttnRes."""
    b = cfg.attn_res_block_size
    if not b:
        return [1] * cfg.num_layers
    return [min(b, cfg.num_layers - s) for s in range(0, cfg.num_layers, b)]


def check_layout(cfg: ModelConfig, lay: Layout, devices: int, pp_split: str = "block") -> str | None:
    """Why `lay` cannot run `cfg` on `devices` devices (one sentence), or None if it can."""
    if lay.devices != devices:
        return f"{lay.name} uses {lay.devices} devices, not the {devices} requested"
    heads = []
    if "kda" in cfg.attn_kinds:
        heads.append(("KDA", cfg.kda.num_heads))
    if "mla" in cfg.attn_kinds:
        heads.append(("MLA", cfg.mla.num_heads))
    for what, h in heads:
        if h % lay.tp:
            return f"TP {lay.tp} does not divide the {h} {what} heads"
    if lay.stage_devices % lay.ep:
        return f"EP {lay.ep} does not divide the {lay.stage_devices} devices of a stage (TP x DP)"
    if cfg.moe.num_experts % lay.ep:
        return f"EP {lay.ep} does not divide the {cfg.moe.num_experts} routed experts"
    if cfg.moe.expert_dim % lay.expert_tp:
        return f"expert width {cfg.moe.expert_dim} does not split over {lay.expert_tp} devices (TP x DP / EP)"
    if lay.dcp and lay.tp == 1:
        return "DCP splits the MLA cache over TP ranks and needs TP > 1"
    n_units = len(blocks(cfg)) if pp_split == "block" else cfg.num_layers
    if lay.pp > n_units:
        unit = "12-layer AttnRes blocks" if pp_split == "block" and cfg.attn_res_block_size else "layers"
        return f"PP {lay.pp} exceeds the {n_units} {unit} a stage must own whole (--pp-split layer allows finer stages)"
    return None


def stage_layers(cfg: ModelConfig, pp: int, pp_split: str = "block") -> list[range]:
    """Contiguous layer ranges per stage, balancing layer counts over whole blocks (or layers)."""
    units = blocks(cfg) if pp_split == "block" else [1] * cfg.num_layers
    cuts = _partition(tuple(units), pp)
    out, start, u = [], 0, 0
    for n_units in cuts:
        n_layers = sum(units[u:u + n_units])
        out.append(range(start, start + n_layers))
        start += n_layers
        u += n_units
    return out


@lru_cache(maxsize=256)
def _partition(units: tuple[int, ...], parts: int) -> tuple[int, ...]:
    """Split `units` into `parts` contiguous groups minimising the largest group sum (then earlier-heavy)."""
    n = len(units)
    prefix = [0]
    for u in units:
        prefix.append(prefix[-1] + u)
    inf = float("inf")
    # best[k][i]: minimal max-sum splitting the first i units into k groups
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    choice = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], choice[k][i] = v, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        j = choice[k][i]
        sizes.append(i - j)
        i = j
    return tuple(reversed(sizes))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(cfg: ModelConfig, devices: int, pp_split: str = "block", dcp: bool = False,
                      max_tp: int | None = None) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """All layouts for `devices`: (candidates that pass the shape checks, [(rejected, why)])."""
    ok, rejected = [], []
    for r in _divisors(devices):
        for pp in _divisors(devices // r):
            for tp in _divisors(devices // (r * pp)):
                dp = devices // (r * pp * tp)
                for ep in _divisors(tp * dp):
                    lay = Layout(tp=tp, pp=pp, dp=dp, ep=ep, replicas=r, dcp=dcp and tp > 1)
                    if dp > 1 and ep == 1:
                        continue  # attention DP only pays with experts spread by EP; skip the redundant form
                    why = check_layout(cfg, lay, devices, pp_split)
                    if why is None and max_tp and tp > max_tp:
                        why = f"TP {tp} crosses the {max_tp}-device scale-up domain (set explicitly with --layout to try it)"
                    (rejected.append((lay, why)) if why else ok.append(lay))
    return ok, rejected
