"""Which rank owns each routed expert of each MoE layer: contiguous ranges, or balanced from a routing
trace (`moeswap trace` output, experts/trace.py) so that hot experts land on different ranks.

Knows nothing of torch.distributed or models beyond the config's layer and expert counts. Entry points:
`contiguous(config, world)`, `balanced(trace, config, world)`, `Placement.owner(layer, expert)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeswap.config import ModelConfig


@dataclass(frozen=True)
class Placement:
    """owners[layer][expert] -> rank, for every model layer ([] where the layer has no routed experts)."""

    world: int
    owners: tuple[tuple[int, ...], ...]
    kind: str  # "contiguous" | "balanced"

    def owner(self, layer: int, expert: int) -> int:
        return self.owners[layer][expert]

    def owned(self, rank: int, layer: int) -> list[int]:
        return [e for e, r in enumerate(self.owners[layer]) if r == rank]

    def describe(self) -> dict:
        """JSON-ready: the kind and each layer's owners (exchanged in the start-up fingerprint)."""
        return {"kind": self.kind, "world": self.world, "owners": [list(o) for o in self.owners]}


def _moe_layers(config: ModelConfig) -> set[int]:
    from moeswap.models import build_model

    model = build_model(config, device="meta")
    return {b.layer_idx for b in model.moe_blocks()}


def _check_world(config: ModelConfig, world: int) -> int:
    E = config.moe.num_experts
    if world < 1 or E % world:
        raise ValueError(f"expert parallelism over {world} ranks: the world size must divide the {E} routed "
                         f"experts per layer (as the planner's EP layouts require)")
    return E


def contiguous(config: ModelConfig, world: int) -> Placement:
    """Rank r owns experts [r*E/N, (r+1)*E/N) of every MoE layer (torchtitan's and vLLM's default)."""
    E = _check_world(config, world)
    moe = _moe_layers(config)
    row = tuple(e * world // E for e in range(E))
    return Placement(world, tuple(row if i in moe else () for i in range(config.num_layers)), "contiguous")


def balanced(trace, config: ModelConfig, world: int) -> Placement:
    """Per layer, experts by descending use in `trace` (ties: lower id first) each go to the rank with the
    least use so far among those with fewer than E/N experts (ties: lower rank): every rank owns E/N
    experts, and the hot ones spread (greedy longest-processing-time)."""
    E = _check_world(config, world)
    moe = _moe_layers(config)
    counts = trace.expert_counts()
    per_rank = E // world
    owners: list[tuple[int, ...]] = []
    for i in range(config.num_layers):
        if i not in moe:
            owners.append(())
            continue
        use = counts[i] if i < len(counts) and counts[i] else [0] * E
        load, held, row = [0] * world, [0] * world, [0] * E
        for e in sorted(range(E), key=lambda e: (-use[e], e)):
            r = min((r for r in range(world) if held[r] < per_rank), key=lambda r: (load[r], r))
            row[e] = r
            load[r] += use[e]
            held[r] += 1
        owners.append(tuple(row))
    return Placement(world, tuple(owners), "balanced")


def make_placement(config: ModelConfig, world: int, trace_path: str | None = None) -> Placement:
    """`balanced` from the trace file at `trace_path` (checked against the model), else `contiguous`."""
    if not trace_path:
        return contiguous(config, world)
    from moeswap.experts.trace import read_trace

    trace = read_trace(trace_path).check_model(config, f"--ep-placement {trace_path}")
    return balanced(trace, config, world)
