"""Accelerator facts: the one table behind MFU, the deviceless GPU and TPU compiles (the GPU's XLA target config
is generated here), the planner and the step-time timeline.

Sources: vendor datasheets for HBM, bandwidth, peak and host link; XLA's published GPU target
specs for the H100 and GB200 compiler fields (SMs, L2, clock, memory size). Other GPUs' compiler
fields are marked `derived` below: taken from the nearest published spec with the vendor's SM
count and memory size — good enough for memory planning, not for kernel timing.
TPUs: Google Cloud's system-architecture pages (docs.cloud.google.com/tpu/docs/v5e, v5p, v6e: peak bf16/int8,
HBM, ICI, DRAM and chips per host, NICs); `hbm_bytes` is what libtpu's compiler allows (its out-of-memory
message for the deviceless v5e:1x1, v5p:1x1x1 and v6e:1x1 targets: 15.75, 95.74 and 31.25 GiB); the v5e's host
link was measured on the lent chip (benchmarks/results/tpu_v5e_2026-12-05/).

A target's topology: GPUs, SLICESxHOSTSxGPUS (slices are NVLink domains joined by the network); TPUs, the
slice's chip grid (v5e/v6e AxB, v5p AxBxC) with `num_slices` slices joined by the data-center network.
"""
import math
import re
import dataclasses

GB = 10**9

# The achievable share of each peak below, for the step-time timeline (MaxOffload/timeline/) and the planner's
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
# TPUs: the same three shares fitted to six step times measured on the lent v5e (Llama-8B width, two sizes x remat /
# offload / keep; benchmarks/results/tpu_v5e_2026-12-05/predict_vs_measured.md, benchmarks/predict_vs_measured.py
# --target v5e): fitted within 7%, each left out within 8.4%. A stopgap, not rates: the HBM and link shares sit at
# their bound (1.0) and the matmul share (0.90, 177 TFLOP/s) is above what an 8192^3 matmul reached on the chip
# (165), so the simulation counts more work or bytes per XLA:TPU kernel than the chip spends (its kernels are priced
# serially at max(FLOPs, bytes); XLA:TPU fuses more). Re-fit when more TPU measurements come.
TPU_CALIBRATION = {"matmul_efficiency": 0.90, "hbm_efficiency": 1.0, "link_efficiency": 1.0}


def calibration_for(accelerator):
    """The achievable shares of `accelerator`'s peaks (CALIBRATION for GPUs, TPU_CALIBRATION for TPUs)."""
    return TPU_CALIBRATION if accelerator.platform == "tpu" else CALIBRATION


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator. On TPUs the `nvlink_*` fields are the inter-chip interconnect (ICI: every chip of a slice
    is in one domain), `network_bandwidth` the data-center network (DCN) share per chip, `gpus_per_node` the chips
    per host and `host_ram_per_gpu` the host's DRAM per chip."""
    name: str
    hbm_bytes: int  # what XLA sees as device memory
    hbm_bandwidth: float  # bytes/s
    bf16_peak_flops: float  # dense, per device (FP8's is twice it on Hopper and Blackwell: fp8_peak_flops)
    host_link_bandwidth: float  # bytes/s per direction, device <-> host
    host_link: str
    gpus_per_node: int
    host_ram_per_gpu: int  # bytes of CPU memory per GPU (pinned-host budget)
    sm_count: int = 0  # sm_count .. compute_capability: the GPU compiler's fields (none for TPUs)
    l2_cache_bytes: int = 0
    clock_ghz: float = 0.0
    compute_capability: tuple = ()
    derived: bool = False  # compiler fields not from a published XLA spec
    # Collective links, bytes/s per direction per GPU (vendor figures): NVLink within the NVLink domain (a slice of
    # the topology: one 8-GPU node for Hopper/B200, the 72-GPU rack for GB200/GB300 NVL72), the scale-out network
    # (one 400 Gb/s ConnectX-7 NIC per GPU; GB300's ConnectX-8 800 Gb/s) across slices.
    nvlink_bandwidth: float = 450 * GB  # NVLink 4: 900 GB/s bidirectional
    network_bandwidth: float = 50 * GB
    nvlink_domain: int = 8  # GPUs one NVLink domain joins (the rest talk over the network)
    platform: str = "gpu"  # "gpu" | "tpu": which deviceless compiler and which XLA flags apply
    int8_peak_flops: float = None  # dense int8 OP/s (TPUs' low-precision peak)
    grid_dims: int = 0  # TPUs: the dimensions of a slice's chip grid (v5e/v6e 2D torus: 2; v5p 3D: 3)
    fp8_peak: float = None  # dense FP8 FLOP/s where it is not twice BF16's (TPUs: no faster FP8 path)

    def peak_for(self, flops, fp8_flops):
        """The peak FLOP/s that `flops` of work count against when `fp8_flops` of them run in FP8 (mixed_peak)."""
        return mixed_peak(self.bf16_peak_flops, self.fp8_peak_flops, flops, fp8_flops)

    @property
    def fp8_peak_flops(self):
        """Dense FP8 tensor-core FLOP/s: twice BF16's on every GPU here (H100/H200 1,979 TFLOP/s, B200 4.5
        PFLOP/s, GB200 5 PFLOP/s in NVIDIA's datasheets); TPUs' own figure (v5p: 459, the same as BF16's)."""
        return self.fp8_peak if self.fp8_peak is not None else 2 * self.bf16_peak_flops


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
    # TPUs: ICI per direction is half the bidirectional per-chip figure; DCN per chip is the host's NICs shared by
    # its chips (v5e: 2 x 100 Gb/s for 8 chips; v5p: 50 Gb/s per chip; v6e: 4 x 200 Gb/s for 8 chips, derived).
    # Host link: v5e measured on the lent chip (device -> host inside a jitted step); v5p PCIe Gen4 x16 and v6e
    # PCIe Gen5 x16 (its page names Gen5) are nominal per-direction rates, not readings.
    "v5e": Accelerator("TPU v5 lite", 16_911_433_728, 819e9, 197e12, 13 * GB, "PCIe (measured)", 8, 512 * 2**30 // 8,
                       nvlink_bandwidth=200 * GB, network_bandwidth=25 * GB // 8, nvlink_domain=256,
                       platform="tpu", int8_peak_flops=393e12, fp8_peak=197e12, grid_dims=2),
    "v5p": Accelerator("TPU v5", 102_800_595_927, 2765e9, 459e12, 32 * GB, "PCIe Gen4 x16", 4, 448 * GB // 4,
                       nvlink_bandwidth=600 * GB, network_bandwidth=50 * GB // 8, nvlink_domain=8960,
                       platform="tpu", int8_peak_flops=918e12, fp8_peak=459e12, derived=True, grid_dims=3),
    "v6e": Accelerator("TPU v6 lite", 33_554_432_000, 1638e9, 918e12, 64 * GB, "PCIe Gen5 x16", 8,
                       1536 * 2**30 // 8, nvlink_bandwidth=400 * GB, network_bandwidth=100 * GB // 8,
                       nvlink_domain=256, platform="tpu", int8_peak_flops=1836e12, fp8_peak=918e12, derived=True,
                       grid_dims=2),
}

# the names JAX gives TPU chips (device_kind) per table key: "TPU v5 lite" is a v5e, "TPU v5" a v5p
TPU_KINDS = {"tpuv5lite": "v5e", "tpuv5p": "v5p", "tpuv5": "v5p", "tpuv6lite": "v6e", "tpuv6e": "v6e"}


def lookup(device_kind):
    """The table entry of a JAX device_kind ('NVIDIA H200' -> h200, 'TPU v5 lite' -> v5e), else None."""
    kind = device_kind.lower().replace(" ", "").replace("-", "")
    if kind.startswith("tpu"):
        return ACCELERATORS[TPU_KINDS[kind]] if kind in TPU_KINDS else None
    for key in sorted(ACCELERATORS, key=len, reverse=True):  # gh200 before h200
        if key in kind:
            return ACCELERATORS[key]
    return None


def usable_hbm(accelerator, mem_fraction):
    """HBM bytes a step may take: on GPUs the share launch.mem_fraction lets JAX preallocate; on TPUs all of what
    libtpu's compiler allows (`hbm_bytes` is already its figure, and the TPU runtime has no such fraction)."""
    return accelerator.hbm_bytes * (1.0 if accelerator.platform == "tpu" else mem_fraction)


def topology_problem(accelerator, topology, num_slices=1):
    """One line saying what is wrong with `topology` (and `num_slices`) for `accelerator`, else None."""
    if accelerator.platform == "tpu":
        dims = accelerator.grid_dims
        shape = "x".join("ABC"[:dims])
        if not re.match(r"^\d+" + r"x\d+" * (dims - 1) + "$", topology) or 0 in map(int, topology.split("x")):
            return (f"aot.topology={topology!r}: a {accelerator.name} slice is its chip grid {shape} (each >= 1), "
                    f"e.g. {'2x2x1' if dims == 3 else '2x2'}; more slices through aot.num_slices")
        if num_slices < 1:
            return f"aot.num_slices={num_slices}: give the number of slices, at least 1"
        return None
    if num_slices != 1:
        return (f"aot.num_slices={num_slices} is for TPU targets; a GPU topology names its slices itself: "
                "aot.topology=SLICESxHOSTSxGPUS")
    if not re.match(r"^\d+x\d+x\d+$", topology):
        return f"aot.topology={topology!r}: write SLICESxHOSTSxGPUS, e.g. 2x16x4"
    if not all(int(n) >= 1 for n in topology.split("x")):
        return f"aot.topology={topology!r}: slices, hosts and GPUs per host must each be at least 1, e.g. 2x16x4"
    return None


def slice_devices(accelerator, topology):
    """Devices in one slice (one NVLink or ICI domain at most) of `topology`."""
    dims = [int(d) for d in topology.split("x")] if topology else [1]
    return math.prod(dims) if accelerator.platform == "tpu" else math.prod(dims[1:])


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
