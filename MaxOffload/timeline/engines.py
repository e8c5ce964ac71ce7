"""The simulation's vocabulary: the four engines, a target's achievable rates on them (Rates) and a span of work
one of them runs (Event)."""
import dataclasses
import re

from MaxOffload import hardware
from MaxOffload.models import components
from MaxOffload.parallel import pipeline

COMPUTE, D2H, H2D, COLLECTIVE = "compute", "d2h", "h2d", "collective"
ENGINES = (COMPUTE, D2H, H2D, COLLECTIVE)
SEGMENT = re.compile(r"layers_\d+_\d+")  # a layer segment in an op name
PIPELINE_LOOP = re.compile(rf"(^|/){pipeline.SCOPE}\)*/while$")  # the op name of the pipeline's iterations' loop


# the op name of an instruction of that loop's body itself (not of a loop nested in it)
PIPELINE_BODY = re.compile(rf"(^|/){pipeline.SCOPE}\)*/while/body/(?!.*/while/body)")


def pipeline_pass(op_name, body=False):
    """"forward" or "backward" for the op name of a pipeline stages' loop (parallel/pipeline.py) or, body=True, of an
    instruction of its body; else None."""
    found = (PIPELINE_BODY if body else PIPELINE_LOOP).search(op_name)
    if not found:
        return None
    return "backward" if "transpose(" in op_name[:found.end()] else "forward"


@dataclasses.dataclass(frozen=True)
class Rates:
    """A target's achievable rates under a calibration (bytes or FLOPs per second)."""
    name: str
    peak_flops: float  # bf16 dense, for MFU
    matmul_flops: float
    hbm_bytes: float
    host_link: float  # per direction
    nvlink: float
    network: float
    domain: int  # GPUs per NVLink domain within a slice of the topology
    fp8_matmul_flops: float = None  # FP8 GEMMs (cuBLASLt f8, cuDNN block-scaled); None: twice matmul_flops

    @classmethod
    def of(cls, accelerator, topology="1x1x1", calibration=None):
        c = {**hardware.calibration_for(accelerator), **(calibration or {})}
        slice_devices = hardware.slice_devices(accelerator, topology)
        link = c["link_efficiency"]
        return cls(accelerator.name, accelerator.bf16_peak_flops, accelerator.bf16_peak_flops * c["matmul_efficiency"],
                   accelerator.hbm_bandwidth * c["hbm_efficiency"], accelerator.host_link_bandwidth * link,
                   accelerator.nvlink_bandwidth * link, accelerator.network_bandwidth * link,
                   max(1, min(accelerator.nvlink_domain, slice_devices)),
                   accelerator.fp8_peak_flops * c["matmul_efficiency"])


@dataclasses.dataclass
class Event:
    """One kernel, transfer or collective on its engine (seconds from the step's start)."""
    engine: str
    start: float
    end: float
    name: str  # the HLO instruction
    op_name: str = ""
    flops: float = 0.0
    bytes: float = 0.0
    stall: float = 0.0  # compute time lost waiting for this transfer or collective (its exposed time)
    fp8_flops: float = 0.0  # of `flops`, those of FP8 GEMMs
    kind: str = ""  # a collective's: all-gather, reduce-scatter, ragged-all-to-all, ...
    loop: str = ""  # the op_name of the innermost while loop it runs in (its layer segment, when its own has none)

    @property
    def component(self):
        tokens = re.findall(r"[A-Za-z_]\w*", self.op_name)
        return next((t for t in reversed(tokens) if t in components.ALL), "other")

    @property
    def segment(self):
        """The layer segment it belongs to: named by its own op_name, else by its loop's (XLA leaves some
        instructions without metadata: e.g. the ragged all-to-all and the copies it makes run inside the layers'
        loops with none)."""
        found = SEGMENT.findall(self.op_name) or SEGMENT.findall(self.loop)
        return found[-1] if found else "outside the layers"
