"""Hardware catalog: TOML data files (accelerators, links, hosts, storage, systems, engine profiles).

Owns loading, validation (every number must carry a source) and resolving `--hardware NAME|FILE`
into one `Hardware` bundle. Knows nothing of models or layouts. Built-in files live in catalog/;
users add their own with the same schema (see docs/planner.md). Entry point: `resolve_hardware`.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import PlanError

# kind -> field -> (type, required). Numbers need a matching entry in the entry's `source` table.
_SCHEMA: dict[str, dict[str, tuple[type, bool]]] = {
    "accelerator": {
        "name": (str, True), "vendor": (str, False), "memory_gb": (float, True), "mem_bw_gbs": (float, False),
        "bf16_tflops": (float, False), "fp8_tflops": (float, False), "fp4_tflops": (float, False),
        "fp32_tflops": (float, False),
    },
    "link": {"name": (str, True), "gbs": (float, True), "latency_us": (float, True)},
    "host": {
        "name": (str, True), "memory_gb": (float, True), "mem_bw_gbs": (float, True),
        "mem_efficiency": (float, True), "bf16_tflops": (float, False),
    },
    "storage": {"name": (str, True), "read_gbs": (float, True), "capacity_tb": (float, True)},
    "system": {
        "name": (str, True), "accelerator": (str, True), "scale_up_link": (str, True),
        "scale_out_link": (str, True), "host_link": (str, True), "host": (str, True), "storage": (str, True),
        "engine": (str, False), "node_devices": (int, True), "scale_up_devices": (int, True),
        "drives_per_node": (int, True),
    },
    "engine": {
        "name": (str, True), "mem_efficiency": (float, True), "gemm_efficiency": (float, True),
        "gemm_half_m": (float, True), "gemm_half_n": (float, True), "lowbit_gemm_efficiency": (float, True),
        "attn_efficiency": (float, True), "link_efficiency": (float, True),
        "host_link_efficiency": (float, True), "storage_efficiency": (float, True), "kernel_us": (float, True),
        "kernels_kda": (float, True), "kernels_mla": (float, True), "kernels_dense": (float, True),
        "kernels_moe": (float, True), "kernels_attn_res": (float, True), "reserve_fraction": (float, True),
        "reserve_gb": (float, True), "prefill_chunk": (int, True), "activation_values": (float, True),
        # optional (absent: mem_efficiency, or 0): a fused MoE call's own streaming rate for low-bit
        # experts, its time per output row and the engine's time per routed expert; ops per forward
        # pass outside the layers (embedding, lm_head, sampling)
        "expert_mem_efficiency": (float, False), "expert_row_ns": (float, False), "expert_us": (float, False),
        "kernels_step": (float, False),
        # optional: a faster kernel_us for passes whose weights fit in a cache of cache_mb (a CPU's L3)
        "kernel_us_cached": (float, False), "cache_mb": (float, False),
        # optional: the fixed time per layer of a decode step whose layers run in one native call
        # (moeswap's engine/native_step.py), replacing the per-layer op counts and expert_us there
        "native_layer_us": (float, False),
    },
}
NONE = "none"  # a system without a host tier or scale-up fabric (one CPU machine) says "none"


@dataclass(frozen=True)
class Entry:
    """One validated catalog entry: its fields, the source of each number, and the file it came from."""

    kind: str
    id: str
    fields: dict[str, Any]
    sources: dict[str, str]
    origin: str

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["fields"][name]
        except KeyError:
            raise AttributeError(name) from None

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


@dataclass
class Catalog:
    entries: dict[str, dict[str, Entry]] = field(default_factory=lambda: {k: {} for k in _SCHEMA})

    def add_file(self, path: Path | str, text: str | None = None) -> list[Entry]:
        path = str(path)
        try:
            raw = tomllib.loads(text if text is not None else Path(path).read_text())
        except FileNotFoundError:
            raise PlanError(f"hardware file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise PlanError(f"hardware file {path} is not valid TOML ({e})") from None
        return self.add_entries(raw, path)

    def add_entries(self, raw: dict[str, Any], path: str) -> list[Entry]:
        """Validate and add {kind: {id: fields + source table}} (a catalog file's tables), from `path`."""
        added = []
        for kind, table in raw.items():
            if kind not in _SCHEMA:
                raise PlanError(f"{path}: unknown table [{kind}]; expected one of {', '.join(_SCHEMA)}")
            for eid, body in table.items():
                entry = _validate(kind, eid, body, path)
                self.entries[kind][eid] = entry  # later files override earlier ones: user files win
                added.append(entry)
        return added

    def get(self, kind: str, eid: str) -> Entry:
        try:
            return self.entries[kind][eid]
        except KeyError:
            known = ", ".join(sorted(self.entries[kind])) or "none"
            raise PlanError(f"unknown {kind} {eid!r}; known: {known}") from None

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])


def _validate(kind: str, eid: str, body: Any, origin: str) -> Entry:
    where = f"{origin}: [{kind}.{eid}]"
    if not isinstance(body, dict):
        raise PlanError(f"{where} must be a table")
    schema = _SCHEMA[kind]
    sources = body.get("source", {})
    if not isinstance(sources, dict):
        raise PlanError(f"{where}.source must be a table of field = \"where the number comes from\"")
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key == "source":
            continue
        if key not in schema:
            raise PlanError(f"{where}: unknown field {key!r}; expected {', '.join(schema)}")
        typ, _ = schema[key]
        if typ is str:
            if not isinstance(value, str):
                raise PlanError(f"{where}: field {key!r} must be a string, got {value!r}")
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise PlanError(f"{where}: field {key!r} must be a finite non-negative number, got {value!r}")
            if typ is int and int(value) != value:
                raise PlanError(f"{where}: field {key!r} must be a whole number, got {value!r}")
            if not str(sources.get(key, "")).strip():
                raise PlanError(f"{where}: number {key!r} has no source; add {key} = \"...\" under [{kind}.{eid}.source]")
            value = typ(value)
        out[key] = value
    missing = [k for k, (_, req) in schema.items() if req and k not in out]
    if missing:
        raise PlanError(f"{where}: missing required field(s) {', '.join(missing)}")
    return Entry(kind, eid, out, {k: str(v) for k, v in sources.items()}, origin)


def builtin_catalog() -> Catalog:
    cat = Catalog()
    folder = resources.files("moeswap.planner") / "catalog"
    for item in sorted(folder.iterdir(), key=lambda p: p.name):
        if item.name.endswith(".toml"):
            cat.add_file(f"catalog/{item.name}", item.read_text())
    return cat


@dataclass(frozen=True)
class Hardware:
    """Everything the memory and time models need about one system, resolved from the catalog."""

    system: Entry
    accel: Entry
    scale_up: Entry | None
    scale_out: Entry | None
    host_link: Entry | None
    host: Entry | None
    storage: Entry
    engine: Entry

    @property
    def name(self) -> str:
        return self.system.id

    @property
    def hbm_bytes(self) -> float:
        return self.accel.memory_gb * 1e9

    def flops(self, dtype: str) -> float:
        """Dense FLOP/s for a compute dtype; fp4/fp8 fall back to the next wider rate the part has."""
        for d in {"fp4": ("fp4", "fp8", "bf16"), "fp8": ("fp8", "bf16"), "bf16": ("bf16",),
                  "fp32": ("fp32", "bf16")}[dtype]:
            v = self.accel.get(f"{d}_tflops")
            if v:
                return v * 1e12
        raise PlanError(
            f"hardware {self.name!r}: accelerator {self.accel.id!r} has no bf16_tflops (not published); "
            "add it in your own catalog file to get a time estimate"
        )

    def mem_bw(self) -> float:
        v = self.accel.get("mem_bw_gbs")
        if not v:
            raise PlanError(
                f"hardware {self.name!r}: accelerator {self.accel.id!r} has no mem_bw_gbs (not published); "
                "add it in your own catalog file to get a time estimate"
            )
        return v * 1e9

    def link_for(self, group: int) -> Entry | None:
        """The link a collective over `group` consecutive devices crosses (None: no communication)."""
        if group <= 1:
            return None
        if group <= self.system.scale_up_devices and self.scale_up is not None:
            return self.scale_up
        if self.scale_out is None:
            raise PlanError(f"hardware {self.name!r} has no link between devices; use --devices 1")
        return self.scale_out

    def on_node(self, devices: int) -> int:
        """Devices of a `devices`-device deployment that share one server's host RAM, drives and CPUs."""
        return max(1, min(self.system.node_devices, devices))

    def host_bytes_per_device(self, devices: int) -> float:
        """Host RAM one device may fill with experts: the server's RAM less what the OS and the runtime
        keep (the engine profile's reserve, as on the device), shared by the server's devices."""
        if self.host is None:
            return 0.0
        ram = self.host.memory_gb * 1e9
        free = ram - self.engine.reserve_gb * 1e9 - self.engine.reserve_fraction * ram
        return max(0.0, free) / self.on_node(devices)

    def storage_bytes_per_device(self, devices: int) -> float:
        return self.storage.capacity_tb * 1e12 * self.system.drives_per_node / self.on_node(devices)

    def storage_bw_per_device(self, devices: int) -> float:
        bw = self.storage.read_gbs * 1e9 * self.system.drives_per_node / self.on_node(devices)
        return bw * self.engine.storage_efficiency

    def host_bw_per_device(self, devices: int) -> float:
        """Rate at which one device can pull experts from host RAM: its link, or its share of host DRAM."""
        if self.host is None:
            return 0.0
        dram = self.host.mem_bw_gbs * 1e9 * self.host.mem_efficiency / self.on_node(devices)
        if self.host_link is None:
            return dram
        return min(self.host_link.gbs * 1e9 * self.engine.host_link_efficiency, dram)

    def assumptions(self) -> list[str]:
        """Every number behind this plan that its source marks as an assumption, as 'entry.field: source'."""
        out = []
        for e in (self.accel, self.scale_up, self.scale_out, self.host_link, self.host, self.storage, self.system):
            if e is None:
                continue
            for k, s in sorted(e.sources.items()):
                if "assumption" in s.lower():
                    out.append(f"{e.kind}.{e.id}.{k}: {s}")
        return out


def resolve_hardware(spec: str, catalog: Catalog | None = None, engine: str | None = None) -> Hardware:
    """`spec` is a system name, an accelerator name (if one system uses it), a TOML file, or 'local'
    (a measurement that local.load_or_measure has added to `catalog`)."""
    cat = catalog or builtin_catalog()
    if spec == "local" and "local" not in cat.entries["system"]:
        raise PlanError("hardware 'local' is not measured in this catalog; `moeswap plan --hardware local` "
                        "(or plan() with hardware='local') measures this machine first")
    if spec.endswith(".toml") or Path(spec).is_file():
        added = cat.add_file(spec)
        systems = [e.id for e in added if e.kind == "system"]
        if len(systems) != 1:
            raise PlanError(
                f"hardware file {spec} defines {len(systems)} systems ({', '.join(systems) or 'none'}); "
                "pass it with --catalog and name the system with --hardware"
            )
        spec = systems[0]
    if spec not in cat.entries["system"]:
        users = [s.id for s in cat.entries["system"].values() if s.accelerator == spec]
        if len(users) == 1:
            spec = users[0]
        else:
            raise PlanError(
                f"unknown hardware {spec!r}; known systems: {', '.join(cat.names('system'))} "
                "(or a .toml file of your own, or 'local')"
            )
    sysent = cat.entries["system"][spec]

    def opt(kind: str, eid: str) -> Entry | None:
        return None if eid == NONE else cat.get(kind, eid)

    return Hardware(
        system=sysent,
        accel=cat.get("accelerator", sysent.accelerator),
        scale_up=opt("link", sysent.scale_up_link),
        scale_out=opt("link", sysent.scale_out_link),
        host_link=opt("link", sysent.host_link),
        host=opt("host", sysent.host),
        storage=cat.get("storage", sysent.storage),
        engine=cat.get("engine", engine or sysent.get("engine") or "default"),
    )
