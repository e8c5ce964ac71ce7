"""The parts of a model its matmul work is counted by: each is a jax.named_scope the layers open, so the
compiled program's op names say which part a matmul belongs to (MaxOffload/audit.py reads them back), and the
family's config says each part's model FLOPs (`matmul_params_by_component`, train/flops.by_component)."""

ATTENTION_SCORES = "attention_scores"  # Q.K^T and P.V
PROJECTIONS = "projections"  # attention's query/key/value/output projections (MLA: its six)
MLP = "mlp"  # the dense SwiGLU MLPs, the MoE layers' shared experts included
ROUTER = "router"  # MoE routing scores
EXPERTS = "routed_experts"  # the routed experts' grouped matmuls (and the gate-weighted combine)
UNEMBED = "unembed"  # the output projection to the vocabulary

ALL = (ATTENTION_SCORES, PROJECTIONS, MLP, ROUTER, EXPERTS, UNEMBED)


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
