"""The parts of a model its matmul work is counted by: each is a jax.named_scope the layers open, so the
compiled program's op names say which part a matmul belongs to, and the
family's config says each part's model FLOPs (`matmul_params_by_component`, train/flops.by_component)."""
from MaxOffload.offload import names

ATTENTION_SCORES = "attention_scores"  # Q.K^T and P.V
PROJECTIONS = "projections"  # attention's query/key/value/output projections (MLA: its six)
MLP = "mlp"  # the dense SwiGLU MLPs, the MoE layers' shared experts included
ROUTER = "router"  # MoE routing scores
EXPERTS = "routed_experts"  # the routed experts' grouped matmuls (and the gate-weighted combine)
UNEMBED = "unembed"  # the output projection to the vocabulary

ALL = (ATTENTION_SCORES, PROJECTIONS, MLP, ROUTER, EXPERTS, UNEMBED)

# the part whose GEMM makes each tagged activation (offload/names; the planner prices its recomputation at that
# part's rate: FP8's where quant.mode runs it in FP8); names no weight GEMM makes (the layer input, the norms'
# latents, attention's output) are absent
MADE_BY = {**dict.fromkeys((names.QUERY_WA_PROJ, names.KV_WA_PROJ, names.QUERY_PROJ, names.KEY_PROJ,
                             names.VALUE_PROJ, names.QKV_PROJ, names.KV_PROJ, names.OUT_PROJ), PROJECTIONS),
           **dict.fromkeys((names.MLPWI, names.MLPWI_0, names.MLPWI_1, names.MLPWO), MLP),
           **dict.fromkeys((names.MOE_MLPWI_0, names.MOE_MLPWI_1, names.MOE_MLPWO), EXPERTS)}


def scoped(component):
    """Decorator: the function's operations traced under jax.named_scope(component)."""
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            import jax

            with jax.named_scope(component):
                return fn(*args, **kwargs)

        return inner

    return wrap
