"""moeswap planner: memory, layout and speed of a MoE model on given hardware, before buying or running it.

Python API: `plan(PlanRequest(model=..., hardware=..., devices=..., workload="serve"|"lora"))`;
CLI: `moeswap plan ...` (cli.py). Needs no weights and no accelerator: a model's shapes come from
moeswap.models built on `meta` (params.py imports torch for that, when a model is planned).
"""

from .errors import PlanError
from .plan import PlanRequest, PlanResult, plan
from .workload import Lora, Offload, Precision, Serve

__all__ = ["PlanError", "PlanRequest", "PlanResult", "plan", "Lora", "Offload", "Precision", "Serve"]
