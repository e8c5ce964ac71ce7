"""Accelerator facts: the one table behind MFU, the deviceless GPU compile (its XLA target config
is generated here), the planner and the step-time timeline.

Sources: vendor datasheets for HBM, bandwidth, peak and host link; XLA's published GPU target
specs for the H100 and GB200 compiler fields (SMs, L2, clock, memory size). Other GPUs' compiler
fields are marked `derived` below: taken from the nearest published spec with the vendor's SM
count and memory size — good enough for memory planning, not for kernel timing.
"""
import dataclasses

GB = 10**9

# The achievable share of each peak below, for the step-time timeline (MaxOffload/timeline.py) and the planner's
# cost model (MaxOffload/offload/costs.py): three constants, fitted to five step times measured side by side on one
# H200 (benchmarks/results/h200_2026-11-29; the fit and its leave-one-out errors:
# benchmarks/predict_vs_measured.py, benchmarks/results/timeline_2026-12-03). For scale, square micro-benchmarks on
# that H200 reached 0.8 (a bf16 8192^3 matmul, 790 of 989 TFLOP/s) and 0.9 (a device copy, 4.3 of 4.8 TB/s): a
# training step's kernels reach less. The link share applies to the host link, NVLink and the network alike; it was
# measured on PCIe only.
def mixed_peak(bf16_peak, fp8_peak, flops, fp8_flops):
    """The peak FLOP/s MFU counts against when `fp8_flops` of `flops` run at `fp8_peak` and the rest at
    `bf16_peak`: the time-weighted (harmonic) mean, so MFU stays the share of the step's peak time."""
    if not fp8_flops:
        return bf16_peak
    return flops / ((flops - fp8_flops) / bf16_peak + fp8_flops / fp8_peak)


CALIBRATION = {"matmul_efficiency": 0.45, "hbm_efficiency": 0.8, "link_efficiency": 0.45}


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes: int  # what XLA sees as device memory
    hbm_bandwidth: float  # bytes/s
    bf16_peak_flops: float  # dense, per device (FP8's is twice it on Hopper and Blackwell: fp8_peak_flops)
    host_link_bandwidth: float  # bytes/s per direction, device <-> host
    host_link: str
    gpus_per_node: int
    host_ram_per_gpu: int  # bytes of CPU memory per GPU (pinned-host budget)
    sm_count: int
    l2_cache_bytes: int
    clock_ghz: float
    compute_capability: tuple
    derived: bool = False  # compiler fields not from a published XLA spec
    # Collective links, bytes/s per direction per GPU (vendor figures): NVLink within the NVLink domain (a slice of
    # the topology: one 8-GPU node for Hopper/B200, the 72-GPU rack for GB200/GB300 NVL72), the scale-out network
    # (one 400 Gb/s ConnectX-7 NIC per GPU; GB300's ConnectX-8 800 Gb/s) across slices.
    nvlink_bandwidth: float = 450 * GB  # NVLink 4: 900 GB/s bidirectional
    network_bandwidth: float = 50 * GB
    nvlink_domain: int = 8  # GPUs one NVLink domain joins (the rest talk over the network)

    def peak_for(self, flops, fp8_flops):
        """The peak FLOP/s that `flops` of work count against when `fp8_flops` of them run in FP8 (mixed_peak)."""
        return mixed_peak(self.bf16_peak_flops, self.fp8_peak_flops, flops, fp8_flops)

    @property
    def fp8_peak_flops(self):
        """Dense FP8 tensor-core FLOP/s: twice BF16's on every GPU here (H100/H200 1,979 TFLOP/s, B200 4.5
        PFLOP/s, GB200 5 PFLOP/s in NVIDIA's datasheets)."""
        return 2 * self.bf16_peak_flops


ACCELERATORS = {
    "h100": Accelerator("NVIDIA H100 80GB HBM3", 84_942_979_072, 3.352e12, 989e12, 64 * GB, "PCIe Gen5 x16", 8,
                        2048 * GB // 8, 132, 52_428_800, 1.98, (9, 0)),
    "h200": Accelerator("NVIDIA H200", 150_754_820_096, 4.8e12, 989e12, 64 * GB, "PCIe Gen5 x16", 8,
                        2048 * GB // 8, 132, 52_428_800, 1.98, (9, 0), derived=True),
    "gh200": Accelerator("NVIDIA GH200 480GB", 102_005_473_280, 4.0e12, 989e12, 450 * GB, "NVLink-C2C", 1,
                         480 * GB, 132, 52_428_800, 1.98, (9, 0), derived=True, nvlink_domain=1),
    "b200": Accelerator("NVIDIA B200", 191_514_411_008, 8.0e12, 2.25e15, 64 * GB, "PCIe Gen6 x16", 8,
                        4096 * GB // 8, 148, 132_120_576, 1.965, (10, 0), derived=True, nvlink_bandwidth=900 * GB),
    "gb200": Accelerator("NVIDIA GB200", 197_897_748_480, 7.928e12, 2.5e15, 450 * GB, "NVLink-C2C", 4,
                         480 * GB // 2, 152, 135_528_448, 2.062, (10, 0), nvlink_bandwidth=900 * GB,
                         nvlink_domain=72),
    "gb300": Accelerator("NVIDIA GB300", 300_647_710_720, 8.0e12, 2.5e15, 450 * GB, "NVLink-C2C", 4,
                         480 * GB // 2, 160, 135_528_448, 2.032, (10, 3), derived=True,
                         nvlink_bandwidth=900 * GB, network_bandwidth=100 * GB, nvlink_domain=72),
}


def lookup(device_kind):
    """The table entry whose key appears in a JAX device_kind ('NVIDIA H200' -> h200), else None."""
    kind = device_kind.lower().replace(" ", "").replace("-", "")
    for key in sorted(ACCELERATORS, key=len, reverse=True):  # gh200 before h200
        if key in kind:
            return ACCELERATORS[key]
    return None


CUDA_RUNTIME, CUDNN = (13, 0), (9, 13)  # what the deviceless compile assumes the GPU machines run


def xla_target_config(a):
    """The GpuTargetConfigProto (text format) for a deviceless compile on accelerator `a`. It names a CUDA runtime
    and a cuDNN version because XLA's FP8 rewrites look at them: without a runtime version the per-tensor FP8
    dot stays a dequantize + BF16 GEMM (no cuBLASLt FP8), and below cuDNN 9.10 the MXFP8 block-scaled dot
    decomposes too. jax < 0.11 reads the cuDNN version from the top-level `dnn_version_info`, newer jax from
    `gpu_device_info.dnn_version`."""
    from MaxOffload.platform import jax_at_least

    major, minor = a.compute_capability
    dnn_major, dnn_minor = CUDNN
    new_jax = jax_at_least(0, 11)
    dnn = "" if new_jax else f"dnn_version_info {{ major: {dnn_major} minor: {dnn_minor} }}\n"
    device_dnn = f'  dnn_version: "{dnn_major}.{dnn_minor}.0"\n' if new_jax else ""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {a.sm_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(a.hbm_bandwidth)}
  l2_cache_size: {a.l2_cache_bytes}
  clock_rate_ghz: {a.clock_ghz}
  device_memory_size: {a.hbm_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
{device_dnn}}}
platform_name: "CUDA"
runtime_version {{ major: {CUDA_RUNTIME[0]} minor: {CUDA_RUNTIME[1]} }}
{dnn}device_description_str: "{a.name}"
"""
