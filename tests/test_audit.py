"""The compiled-work audit (MaxOffload/audit.py): matmul FLOPs read from optimized HLO text, by hand on a
written module, on a CPU-compiled scan, and on XLA's GPU lowering of ragged_dot (a dense dot over every
expert). The audit of the real training step is in tests/test_aot.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxOffload import audit
from MaxOffload.models import components

# Every dot below is [4, 8] x [8, 2]: 2 x 4 x 2 x 8 = 128 FLOPs.
MODULE = """HloModule jit_step, entry_computation_layout={(f32[4,8]{1,0}, f32[8,2]{1,0})->f32[4,2]{1,0}}

%fused_dot (p0: f32[4,8], p1: f32[8,2]) -> f32[4,2] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,2]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,2]{1,0} dot(f32[4,8]{1,0} %p0, f32[8,2]{1,0} %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp(layers_0_1)/while/body/mlp/dot_general" source_file="x.py" source_line=1}
}

%body (t: (s32[], f32[4,8], f32[8,2])) -> (s32[], f32[4,8], f32[8,2]) {
  %t = (s32[], f32[4,8]{1,0}, f32[8,2]{1,0}) parameter(0)
  %a = f32[4,8]{1,0} get-tuple-element(%t), index=1
  %b = f32[8,2]{1,0} get-tuple-element(%t), index=2
  %fusion = f32[4,2]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot
  ROOT %out = (s32[], f32[4,8]{1,0}, f32[8,2]{1,0}) tuple(%i, %a, %b)
}

%cond (t.1: (s32[], f32[4,8], f32[8,2])) -> pred[] {
  %t.1 = (s32[], f32[4,8]{1,0}, f32[8,2]{1,0}) parameter(0)
  ROOT %lt = pred[] compare(%x, %y), direction=LT
}

%loose_body (u: (s32[], f32[4,8], f32[8,2])) -> (s32[], f32[4,8], f32[8,2]) {
  %u = (s32[], f32[4,8]{1,0}, f32[8,2]{1,0}) parameter(0)
  %c = f32[4,8]{1,0} get-tuple-element(%u), index=1
  %d = f32[8,2]{1,0} get-tuple-element(%u), index=2
  %dot.3 = f32[4,2]{1,0} dot(%c, %d), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/router/dot_general"}
  ROOT %out.1 = (s32[], f32[4,8]{1,0}, f32[8,2]{1,0}) tuple(%i, %c, %d)
}

ENTRY %main (x: f32[4,8], w: f32[8,2]) -> f32[4,2] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,2]{1,0} parameter(1)
  %while = (s32[], f32[4,8]{1,0}, f32[8,2]{1,0}) while(%tuple), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"},"known_init_step":{"init":"0","step":"1"}}
  %while.2 = (s32[], f32[4,8]{1,0}, f32[8,2]{1,0}) while(%tuple), condition=%cond, body=%loose_body, metadata={op_name="jit(step)/loose"}
  %gemm = (f32[4,2]{1,0}, s8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp(unembed))/dot_general"}, backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %kernel = f32[4,2]{1,0} custom-call(%x, %w), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/attention_scores/fused"}
  %placement = f32[4,8]{1,0} custom-call(%x), custom_call_target="annotate_device_placement"
  ROOT %dot.2 = f32[4,2]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp(layers_0_1))/checkpoint/rematted_computation/projections/dot_general"}
}
"""


@pytest.mark.stack("py311", "py312")
def test_a_written_module_is_counted_by_hand():
    c = audit.count(MODULE)
    by_part = {}
    for m in c.matmuls:
        by_part[(m.component, m.phase, m.kind)] = by_part.get((m.component, m.phase, m.kind), 0) + m.flops
    assert by_part == {
        (components.MLP, "forward", "dot"): 3 * 128,  # inside a fusion, inside a loop of 3 trips
        (components.ROUTER, "forward", "dot"): 128,  # a loop without a known trip count: once, and listed
        (components.UNEMBED, "backward", "cublas"): 128,  # a cuBLAS custom call, from its dimension numbers
        (components.PROJECTIONS, "recompute", "dot"): 128,
    }
    assert c.total == 6 * 128
    assert c.unknown_trip_counts == ["jit(step)/loose"]
    assert c.kernels == {"__gpu$xla.gpu.triton": 1}  # its FLOPs are not in the HLO; not a placement call
    assert c.dense_ragged_dots == []

    report = audit.audit(MODULE, {components.MLP: 3 * 128, components.PROJECTIONS: 64, components.UNEMBED: 128,
                                  components.ROUTER: 128})
    assert report["compiled_matmul_flops"] == 768 and report["ratio"] == pytest.approx(768 / 704)
    assert report["recompute_flops"] == 128
    assert report["components"][components.PROJECTIONS]["ratio"] == 2.0
    assert report["warnings"] == []  # projections: 2x, but all of the excess is recomputation
    over = audit.audit(MODULE, {components.MLP: 128, components.PROJECTIONS: 128, components.UNEMBED: 128,
                                components.ROUTER: 128})
    assert len(over["warnings"]) == 1 and over["warnings"][0].startswith("mlp: 3.00x its model FLOPs")
    padded = audit.audit(MODULE, {components.MLP: 128, components.PROJECTIONS: 128, components.UNEMBED: 128,
                                  components.ROUTER: 128}, {components.MLP: 3.0})  # e.g. a capacity's padding
    assert padded["warnings"] == []


# tokamax's Triton ragged_dot as jax 0.10 prints it (the op JSON in op_name) and as jax 0.12 does
# (metadata_payload); lhs [64, 32] x rhs [4, 32, 16] grouped: 2 x 64 x 32 x 16 = 65,536 FLOPs per call
_RAGGED = ('{\\"op\\":{\\"__type\\":\\"tokamax._src.ops.ragged_dot.pallas_triton.PallasTritonRaggedDot\\"},'
           '\\"arguments\\":{\\"lhs\\":\\"bf16[64,32]\\",\\"rhs\\":\\"bf16[4,32,16]\\",'
           '\\"ragged_dot_dimension_numbers\\":{\\"dot_dimension_numbers\\":[[[1],[1]],[[],[]]],'
           '\\"lhs_ragged_dimensions\\":[0],\\"rhs_group_dimensions\\":[0]}}}')
# ... and its weight gradient: lhs [64, 32], rhs (the output gradient) [64, 16], contracted over the rows
_RAGGED_DRHS = _RAGGED.replace("bf16[4,32,16]", "bf16[64,16]").replace("[[[1],[1]]", "[[[0],[0]]").replace(
    '\\"rhs_group_dimensions\\":[0]', '\\"rhs_group_dimensions\\":[]')
KERNEL_MODULE = f"""HloModule jit_step

%fused_dot.7 (p0: f32[4,8], p1: f32[8,2]) -> f32[4,2] {{
  %p0 = f32[4,8]{{1,0}} parameter(0)
  %p1 = f32[8,2]{{1,0}} parameter(1)
  ROOT %dot.9 = f32[4,2]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="jit(step)/unembed/dot_general"}}
}}

ENTRY %main (x: bf16[64,32], w: bf16[4,32,16], s: s32[4]) -> bf16[64,16] {{
  %x = bf16[64,32]{{1,0}} parameter(0)
  %w = bf16[4,32,16]{{2,1,0}} parameter(1)
  %s = s32[4]{{0}} parameter(2)
  %pallas_call = bf16[64,16]{{1,0}} custom-call(%x, %w, %s), custom_call_target="__gpu$xla.gpu.triton", metadata={{op_name="jit(step)/routed_experts/tokamax:{_RAGGED}/pallas_call" source_file="k.py"}}
  %pallas_call.1 = bf16[4,32,16]{{2,1,0}} custom-call(%x, %x, %s), custom_call_target="__gpu$xla.gpu.triton", metadata={{op_name="jit(step)/transpose(jvp(routed_experts))/pallas_call" metadata_payload="tokamax:{_RAGGED_DRHS}"}}
  %pallas_call.2 = bf16[64,32]{{1,0}} custom-call(%y, %w, %s), custom_call_target="__gpu$xla.gpu.triton", operand_layout_constraints={{bf16[64,16]{{1,0}}, bf16[4,16,32]{{2,1,0}}, s32[4]{{0}}}}, metadata={{op_name="jit(step)/transpose(jvp(routed_experts))/shard_map/pallas_call" scheduling_name="pallas_call.2"}}, backend_config={{debug = false, grid_x = 3 : i32, ir = "ML\\EFR\\00", name = "_ragged_dot_kernel", num_stages = 4 : i32}}
  %a = f32[4,8]{{1,0}} parameter(3)
  %b = f32[8,2]{{1,0}} parameter(4)
  %fusion.7 = f32[4,2]{{1,0}} fusion(%a, %b), kind=kOutput, calls=%fused_dot.7
  ROOT %fusion.7.remat = f32[4,2]{{1,0}} fusion(%a, %b), kind=kOutput, calls=%fused_dot.7
}}
"""


@pytest.mark.stack("py311", "py312")
def test_tokamax_kernels_are_counted_from_their_shapes_and_xla_remat_clones_are_recompute():
    c = audit.count(KERNEL_MODULE)
    got = sorted((m.kind, m.component, m.phase, m.flops) for m in c.matmuls)
    assert got == sorted([
        ("PallasTritonRaggedDot", components.EXPERTS, "forward", 65536),  # the JSON in the op name (jax 0.10)
        ("PallasTritonRaggedDot", components.EXPERTS, "backward", 65536),  # in metadata_payload (jax 0.12)
        ("PallasTritonRaggedDot", components.EXPERTS, "backward", 65536),  # by the Triton kernel's name (no JSON)
        ("dot", components.UNEMBED, "forward", 128),
        ("dot", components.UNEMBED, "recompute", 128),  # inside the fusion XLA's rematerialization cloned
    ])
    assert c.counted_kernels == {"PallasTritonRaggedDot": 3} and c.kernels == {} and c.dense_ragged_dots == []
    report = audit.audit(KERNEL_MODULE, {components.EXPERTS: 3 * 65536, components.UNEMBED: 128})
    assert report["recompute_flops"] == 128 and report["warnings"] == []
    assert any(line.startswith("  kernels counted from their shapes") for line in audit.format_audit(report))


# tokamax's flash attention, q [2, 128, 4, 16] (b, T, heads, d), k/v [2, 128, 2, 16] (GQA), causal: forward
# 2 x 2 x 4 x (128 x 129 / 2) x (16 + 16) pairs' work = 4,227,072 FLOPs; the VJP 2 x 2 x 4 x 8,256 x (3 x 16 +
# 2 x 16) = 10,567,680 (its recomputed QK^T and dV, dP, dQ, dK)
_FLASH = ('{\\"op\\":{\\"__type\\":\\"tokamax._src.ops.attention.pallas_triton.PallasTritonFlashAttention\\"},'
          '\\"arguments\\":{\\"q\\":\\"bf16[2,128,4,16]\\",\\"k\\":\\"bf16[2,128,2,16]\\",'
          '\\"v\\":\\"bf16[2,128,2,16]\\",\\"mask\\":{\\"is_causal\\":true}}}')
FLASH_MODULE = f"""HloModule jit_step

ENTRY %main (q: bf16[2,128,4,16], k: bf16[2,128,2,16], v: bf16[2,128,2,16]) -> bf16[2,128,4,16] {{
  %q = bf16[2,128,4,16]{{3,2,1,0}} parameter(0)
  %k = bf16[2,128,2,16]{{3,2,1,0}} parameter(1)
  %v = bf16[2,128,2,16]{{3,2,1,0}} parameter(2)
  %pallas_call = bf16[2,128,4,16]{{3,2,1,0}} custom-call(%q, %k, %v), custom_call_target="__gpu$xla.gpu.triton", metadata={{op_name="jit(step)/projections/attention_scores/shard_map/tokamax:{_FLASH}/pallas_call"}}
  ROOT %pallas_call.1 = (bf16[2,128,4,16]{{3,2,1,0}}, bf16[2,128,4,16]{{3,2,1,0}}, bf16[2,128,4,16]{{3,2,1,0}}) custom-call(%q, %k, %v, %q), custom_call_target="__gpu$xla.gpu.triton", operand_layout_constraints={{bf16[2,128,4,16]{{3,2,1,0}}, bf16[2,128,2,16]{{3,2,1,0}}, bf16[2,128,2,16]{{3,2,1,0}}, bf16[2,128,4,16]{{3,2,1,0}}}}, metadata={{op_name="jit(step)/transpose(jvp(x))/projections/attention_scores/shard_map/pallas_call"}}, backend_config={{debug = false, name = "pallas_flash_attention_vjp", num_stages = 2 : i32}}
}}
"""


@pytest.mark.stack("py311", "py312")
def test_flash_attention_kernels_are_counted_from_their_shapes():
    """The forward by its op JSON (jax 0.10), the VJP by its Triton kernel's name and operands (where the JSON is
    dropped): the causal pairs T (T + 1) / 2, GQA's query heads."""
    c = audit.count(FLASH_MODULE)
    got = sorted((m.kind, m.component, m.phase, m.flops) for m in c.matmuls)
    assert got == sorted([("PallasTritonFlashAttention", components.ATTENTION_SCORES, "forward", 4_227_072),
                          ("PallasTritonFlashAttentionVjp", components.ATTENTION_SCORES, "backward", 10_567_680)])
    lines = audit.format_audit(audit.audit(FLASH_MODULE, {components.ATTENTION_SCORES: 1}))
    assert any(line.startswith("  kernels counted from their shapes: PallasTritonFlashAttention x1") for line in lines)


@pytest.mark.stack("py311", "py312")
def test_a_compiled_scan_with_remat_is_counted_exactly():
    """XLA:CPU's optimized module (operands printed without shapes: read from the defining instructions)."""
    def layer(x, w):
        with jax.named_scope(components.MLP):
            return jnp.tanh(x @ w)

    def loss(ws, x):
        y, _ = jax.lax.scan(lambda c, w: (jax.checkpoint(layer)(c, w), None), x, ws)
        with jax.named_scope(components.UNEMBED):
            return (y @ ws[0]).sum()

    x, ws = jnp.ones((8, 16)), jnp.ones((4, 16, 16))
    c = audit.count(jax.jit(jax.grad(loss)).lower(ws, x).compile().as_text())
    one = 2 * 8 * 16 * 16  # one [8,16] x [16,16] matmul
    by_phase = {}
    for m in c.matmuls:
        by_phase[(m.component, m.phase)] = by_phase.get((m.component, m.phase), 0) + m.flops
    # 4 layers: forward, recomputed forward, and two backward matmuls each; the unembedding's forward is
    # dead (only its gradients are needed): two backward matmuls
    assert by_phase == {(components.MLP, "forward"): 4 * one, (components.MLP, "recompute"): 4 * one,
                        (components.MLP, "backward"): 8 * one, (components.UNEMBED, "backward"): 2 * one}


@pytest.mark.stack("py311", "py312")
def test_the_gpu_lowering_of_ragged_dot_is_a_dense_dot_and_the_audit_says_so():
    """jax.lax.ragged_dot compiled deviceless for one H200: XLA multiplies every row by every expert (E x
    the grouped-GEMM FLOPs). This is what the MoE layers must not compile to."""
    from jax.sharding import NamedSharding, PartitionSpec

    from MaxOffload import deviceless

    rows, k, n, experts = 1024, 256, 128, 8
    mesh = jax.sharding.Mesh(np.array(deviceless.compile_only_devices("h200", "1x1x1")), ("x",))
    spec = NamedSharding(mesh, PartitionSpec())
    args = (jax.ShapeDtypeStruct((rows, k), jnp.bfloat16, sharding=spec),
            jax.ShapeDtypeStruct((experts, k, n), jnp.bfloat16, sharding=spec),
            jax.ShapeDtypeStruct((experts,), jnp.int32, sharding=spec))
    grads = jax.jit(jax.grad(lambda a, b, s: jax.lax.ragged_dot(a, b, s).sum(), argnums=(0, 1)))
    text = grads.lower(*args).compile().as_text()
    c = audit.count(text)
    assert len(c.dense_ragged_dots) == 2  # the two gradients (the forward's value is not needed)
    assert all(f == experts * 2 * rows * k * n for _, f in c.dense_ragged_dots)
    report = audit.audit(text, None)
    assert any(w.startswith("XLA lowered ragged_dot to a dense dot over every expert") for w in report["warnings"])
    assert {m.component for m in c.matmuls} == {components.EXPERTS}


@pytest.mark.stack("py311", "py312")
def test_text_that_is_not_hlo_is_refused():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        audit.count("not hlo")

