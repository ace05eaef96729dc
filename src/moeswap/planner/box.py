"""`--box`: one machine described in a few numbers, without a catalog file and a source per number.

`cores=16,ram=256GB,drive=7GB/s[,mem_bw=80GB/s][,disk=4TB][,gpu=h100]`, or a TOML file with the same keys
(`cores = 16`, `ram = "256GB"`, ...). Owns parsing that description (one-line PlanErrors) and turning it
into ordinary catalog entries with id `box`: every number the user gave carries the source "[user]", every
number filled in for them "[assumption]" (so the plan lists it). Without `gpu` the CPU is the device: its
RAM holds the dense weights, the caches and the experts that fit, the rest live on the drive, and the engine
is moeswap's CPU engine. With `gpu` (a catalog system or accelerator name) the box is one such accelerator
beside a host of that RAM, cores and DRAM bandwidth. Entry points: `parse_box`, `add_box`.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PlanError
from .hardware import NONE, Catalog

BOX = "box"  # the id of every entry a box adds, and the system `--hardware` then names
KEYS = ("cores", "ram", "drive", "mem_bw", "disk", "gpu")
REQUIRED = ("cores", "ram", "drive")

# What a box gets for numbers it does not give; each is listed as an assumption in the plan.
MEM_BW_PER_CORE_GBS = 5.0
MEM_BW_WHY = ("[assumption] 5 GB/s of DRAM bandwidth per core (a 16-core box on two DDR5-5600 channels: "
              "90 GB/s); give mem_bw= for yours")
BF16_TFLOPS_PER_CORE = 0.1
FLOPS_WHY = ("[assumption] 0.1 TFLOP/s per core: AVX-512 FMA at ~3 GHz peaks at 0.19 fp32 TFLOP/s, and "
             "moeswap's CPU kernels widen bf16 and low-bit weights to fp32")
DISK_TB = 4.0
DISK_WHY = "[assumption] 4 TB free on the drive (K3's MXFP4 experts are 1.45 TB); give disk= for yours"
HOST_MEM_EFFICIENCY = 0.78  # as the catalog's DDR5 hosts
HOST_LINK = "pcie5-x16"  # a GPU whose catalog system names no host link

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30,
          "ti": 2.0**40}
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgt]i?)b(/s)?", re.IGNORECASE)


@dataclass(frozen=True)
class Box:
    cores: int
    ram_gb: float
    drive_gbs: float  # sequential read rate of the drive experts spill to
    mem_bw_gbs: float | None = None  # DRAM bandwidth; None: MEM_BW_PER_CORE_GBS per core (an assumption)
    disk_tb: float | None = None  # free space on that drive; None: DISK_TB (an assumption)
    gpu: str | None = None  # a catalog system or accelerator name; None: the CPU is the device
    bf16_tflops: float | None = None  # the CPU's rate; None: BF16_TFLOPS_PER_CORE per core (an assumption)
    drive_measured: bool = False  # drive_gbs was measured (used as is) rather than rated (engine efficiency)
    origin: str = "--box"  # how the user described it, for sources and errors

    @property
    def mem_bw(self) -> float:
        return self.mem_bw_gbs if self.mem_bw_gbs is not None else self.cores * MEM_BW_PER_CORE_GBS

    @property
    def cpu_tflops(self) -> float:
        return self.bf16_tflops if self.bf16_tflops is not None else self.cores * BF16_TFLOPS_PER_CORE


def _quantity(key: str, text: str, rate: bool, where: str) -> float:
    want = "a rate with its unit, e.g. 7GB/s" if rate else "a size with its unit, e.g. 256GB"
    m = _QUANTITY.fullmatch(text.strip())
    if m is None or bool(m.group(3)) != rate:
        raise PlanError(f"{where} {key}={text}: expected {want}")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()] / 1e9  # GB or GB/s
    if not math.isfinite(value) or value <= 0:
        raise PlanError(f"{where} {key}={text}: expected a positive {('rate' if rate else 'size')}")
    return value


def _from_pairs(pairs: list[tuple[str, str]], where: str) -> Box:
    seen: dict[str, str] = {}
    for key, value in pairs:
        if key not in KEYS:
            raise PlanError(f"{where}: unknown key {key!r}; expected {', '.join(KEYS)}")
        if key in seen:
            raise PlanError(f"{where}: {key} is given twice")
        seen[key] = value
    missing = [k for k in REQUIRED if k not in seen]
    if missing:
        raise PlanError(f"{where}: missing {', '.join(missing)} (e.g. cores=16,ram=256GB,drive=7GB/s)")
    cores = seen["cores"].strip()
    if not cores.isdigit() or int(cores) < 1:
        raise PlanError(f"{where} cores={cores}: expected a whole number of CPU cores, at least 1")
    gpu = seen.get("gpu", "").strip() or None
    return Box(
        cores=int(cores), ram_gb=_quantity("ram", seen["ram"], False, where),
        drive_gbs=_quantity("drive", seen["drive"], True, where),
        mem_bw_gbs=_quantity("mem_bw", seen["mem_bw"], True, where) if "mem_bw" in seen else None,
        disk_tb=_quantity("disk", seen["disk"], False, where) / 1e3 if "disk" in seen else None,
        gpu=gpu, origin=where.rstrip(":"),
    )


def parse_box(spec: str) -> Box:
    """A box from `key=value,...` or from a TOML file holding the same keys."""
    if spec.endswith(".toml") or Path(spec).is_file():
        where = f"--box {spec}:"
        try:
            raw = tomllib.loads(Path(spec).read_text())
        except OSError as e:
            raise PlanError(f"--box {spec}: cannot read it ({e.strerror or e})") from None
        except tomllib.TOMLDecodeError as e:
            raise PlanError(f"--box {spec}: not valid TOML ({e})") from None
        pairs = []
        for key, value in raw.items():
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise PlanError(f"{where} {key} must be a number or a string like \"256GB\", got {value!r}")
            pairs.append((key, str(value)))
        return _from_pairs(pairs, where)
    pairs = []
    for part in spec.split(","):
        if not part.strip():
            continue
        key, eq, value = part.partition("=")
        if not eq or not value.strip():
            raise PlanError(f"--box: {part.strip()!r} is not key=value (e.g. cores=16,ram=256GB,drive=7GB/s)")
        pairs.append((key.strip(), value.strip()))
    return _from_pairs(pairs, "--box")


def _gpu_system(cat: Catalog, gpu: str) -> tuple[str, dict[str, Any]]:
    """(accelerator id, the catalog system that uses it or {}) for a system or accelerator name."""
    systems = cat.entries["system"]
    if gpu in systems:
        return systems[gpu].accelerator, systems[gpu].fields
    if gpu in cat.entries["accelerator"]:
        users = [s.fields for s in systems.values() if s.accelerator == gpu]
        return gpu, users[0] if len(users) == 1 else {}
    raise PlanError(f"--box gpu={gpu}: unknown; known systems: {', '.join(cat.names('system'))}; accelerators: "
                    f"{', '.join(cat.names('accelerator'))}")


def add_box(cat: Catalog, box: Box, engine: str | None = None) -> str:
    """Add the box's entries (id `box`) to `cat`; returns the system id to plan on. `engine`: the profile
    to start from (default: moeswap's CPU engine without a GPU, the GPU system's profile with one)."""
    user = f"[user] {box.origin}"
    gave = lambda key, value: f"{user} {key}={value:g}"  # noqa: E731
    ram_src = gave("ram", box.ram_gb) + " GB"
    bw_src = gave("mem_bw", box.mem_bw) + " GB/s" if box.mem_bw_gbs is not None else MEM_BW_WHY
    flops_src = FLOPS_WHY if box.bf16_tflops is None else gave("bf16_tflops", box.cpu_tflops)
    drive_how = "measured" if box.drive_measured else "rated"
    entries: dict[str, dict[str, Any]] = {
        "storage": {BOX: {"name": f"user drive ({box.drive_gbs:g} GB/s {drive_how})", "read_gbs": box.drive_gbs,
                          "capacity_tb": box.disk_tb if box.disk_tb is not None else DISK_TB,
                          "source": {"read_gbs": gave("drive", box.drive_gbs) + f" GB/s ({drive_how})",
                                     "capacity_tb": DISK_WHY if box.disk_tb is None else gave("disk", box.disk_tb) + " TB"}}},
    }
    one = {k: f"{user}: one box" for k in ("node_devices", "scale_up_devices", "drives_per_node")}
    system: dict[str, Any] = {"scale_up_link": NONE, "scale_out_link": NONE, "storage": BOX, "node_devices": 1,
                              "scale_up_devices": 1, "drives_per_node": 1, "source": one}
    cpu = f"{box.cores} cores, {box.ram_gb:g} GB RAM"
    if box.gpu is None:
        entries["accelerator"] = {BOX: {
            "name": f"user CPU ({cpu})", "vendor": "user", "memory_gb": box.ram_gb, "mem_bw_gbs": box.mem_bw,
            "bf16_tflops": box.cpu_tflops, "fp32_tflops": box.cpu_tflops,
            "source": {"memory_gb": ram_src, "mem_bw_gbs": bw_src, "bf16_tflops": flops_src, "fp32_tflops": flops_src}}}
        system.update(name=f"user box: {cpu}, {box.drive_gbs:g} GB/s drive", accelerator=BOX, host_link=NONE,
                      host=NONE)
        base = engine or "moeswap-cpu"
    else:
        accel, gpu_system = _gpu_system(cat, box.gpu)
        entries["host"] = {BOX: {
            "name": f"user host ({cpu})", "memory_gb": box.ram_gb, "mem_bw_gbs": box.mem_bw,
            "mem_efficiency": HOST_MEM_EFFICIENCY, "bf16_tflops": box.cpu_tflops,
            "source": {"memory_gb": ram_src, "mem_bw_gbs": bw_src, "bf16_tflops": flops_src,
                       "mem_efficiency": "[hw.md] sustained DDR5 ~70-85 % of peak; midpoint, as the catalog's hosts"}}}
        host_link = gpu_system.get("host_link") or HOST_LINK
        system.update(name=f"user box: 1 x {cat.get('accelerator', accel).name}, {cpu}, {box.drive_gbs:g} GB/s drive",
                      accelerator=accel, host_link=HOST_LINK if host_link == NONE else host_link, host=BOX)
        base = engine or gpu_system.get("engine") or "default"
    profile = cat.get("engine", base)
    fields = {**profile.fields, "source": dict(profile.sources)}
    if box.drive_measured:  # a measured read rate is what the drive gives: no rating to discount
        fields["storage_efficiency"] = 1.0
        fields["source"]["storage_efficiency"] = f"{user}: the drive's rate was measured"
    if box.gpu is None:  # CPU kernels have no tensor-core tiles to under-fill at few rows (as local.py measures)
        for k in ("gemm_half_m", "gemm_half_n"):
            fields[k] = 0.0
            fields["source"][k] = "[assumption] a CPU's GEMM kernels lose no tile efficiency at decode sizes"
    fields["name"] = f"{profile.name} (for the user box)"
    entries["engine"] = {BOX: fields}
    system["engine"] = BOX
    entries["system"] = {BOX: system}
    cat.add_entries(entries, box.origin)
    return BOX
