"""Accelerator facts (vendor figures; see the docs for sources): the one table for MFU and, later,
the deviceless compile and the planner."""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    bf16_peak_flops: float  # dense, per device
    host_link_bandwidth: float  # bytes/s per direction
    host_link: str
    gpus_per_node: int


GB = 10**9
ACCELERATORS = {
    "h100": Accelerator("H100 SXM", 80 * GB, 3.35e12, 989e12, 64 * GB, "PCIe Gen5 x16", 8),
    "h200": Accelerator("H200 SXM", 141 * GB, 4.8e12, 989e12, 64 * GB, "PCIe Gen5 x16", 8),
    "gh200": Accelerator("GH200", 96 * GB, 4.0e12, 989e12, 450 * GB, "NVLink-C2C", 1),
    "b200": Accelerator("B200", 180 * GB, 8.0e12, 2.25e15, 64 * GB, "PCIe Gen6 x16", 8),
    "gb200": Accelerator("GB200 (NVL72)", 186 * GB, 8.0e12, 2.5e15, 450 * GB, "NVLink-C2C", 4),
    "gb300": Accelerator("GB300 (NVL72)", 288 * GB, 8.0e12, 2.5e15, 450 * GB, "NVLink-C2C", 4),
}


def lookup(device_kind):
    """The table entry whose key appears in a JAX device_kind ('NVIDIA H200' -> h200), else None."""
    kind = device_kind.lower().replace(" ", "").replace("-", "")
    for key in sorted(ACCELERATORS, key=len, reverse=True):  # gh200 before h200
        if key in kind:
            return ACCELERATORS[key]
    return None
