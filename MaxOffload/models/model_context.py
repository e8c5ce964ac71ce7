"""What every layer of a model is built with, received once: the parallel layout (parallel/layout.ParallelLayout:
the mesh, the logical-axis rules, the expert exchange; NONE without a mesh) and the weight matmuls' numerics
(models/matmul.Numerics: the compute dtype, bf16 | fp8 | mxfp8, the activations stored in FP8). models.build
makes one and hands it to the family's constructor, which hands it to each layer; a layer keeps it as `self.ctx`
and computes through it (`project`, `dense`, `tag`, `constrain`), so neither the layout nor the numerics is a
parameter of the layers' functions. (Not to be confused with the *context* axes of context parallelism, which the
layout names: `ctx.layout.context`.)
"""
import dataclasses

from MaxOffload.models import matmul
from MaxOffload.parallel.layout import NONE, ParallelLayout


@dataclasses.dataclass(frozen=True)
class ModelContext:
    layout: ParallelLayout = NONE
    numerics: matmul.Numerics = matmul.Numerics()

    @classmethod
    def of(cls, config, layout=None, numerics=None):
        """The context of a model configuration: `layout` (None: no mesh) and `numerics` (None: bf16 in the
        configured compute dtype)."""
        return cls(layout or NONE, numerics or matmul.Numerics(config.compute_dtype))

    def with_numerics(self, **changes):
        """The same context with some numerics fields changed (e.g. mode="fp8" where MXFP8 cannot run)."""
        return dataclasses.replace(self, numerics=dataclasses.replace(self.numerics, **changes))

    def dense(self, x, w, spec, part):
        """einsum(spec, x, w) of an activation and a weight value for model part `part` (models/matmul.dense)."""
        return matmul.dense(x, w, spec, part, self.numerics)

    def weight(self, param):
        """A weight parameter's value for its matmul under the numerics (models/matmul.weight: gathered whole but
        for its tensor-parallel split under MXFP8)."""
        return matmul.weight(param, self.numerics, self.layout)

    def project(self, x, param, spec, part):
        """`dense` of x and a weight *parameter* (its value for the matmul: `weight`)."""
        return self.dense(x, self.weight(param), spec, part)

    def grouped(self, rows, w, sizes, capacity, kernel):
        """The routed experts' matmul (models/matmul.grouped)."""
        return matmul.grouped(rows, w, sizes, capacity, kernel, self.numerics)

    def tag(self, x, name):
        """x tagged as activation `name` for the remat/offload policies (matmul.Numerics.tag)."""
        return self.numerics.tag(x, name)

    def constrain(self, x, axes):
        """x placed by its logical `axes` (parallel/layout.ParallelLayout.constrain)."""
        return self.layout.constrain(x, axes)


DEFAULT = ModelContext()
