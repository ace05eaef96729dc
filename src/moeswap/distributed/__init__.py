"""Expert parallelism on torch.distributed, applied from outside the model: placement.py (which rank owns
which routed expert), ep.py (the MoE blocks' exchange), runtime.py (process group, start-up checks,
heartbeat). Entry points: `apply_expert_parallel(model, group, placement)`, `init_expert_parallel(...)`."""

from moeswap.distributed.ep import ExpertParallel, PeerLost, apply_expert_parallel
from moeswap.distributed.placement import Placement, balanced, contiguous, make_placement

__all__ = ["ExpertParallel", "PeerLost", "Placement", "apply_expert_parallel", "balanced", "contiguous",
           "make_placement"]
