"""Causal attention on this machine's TPU, kernel by kernel, side by side in one run (issue 47's kernel table):

    python benchmarks/tpu/attention.py [--json PATH] [--repeats 10] [--sweep [--only NAME,NAME]]

One forward + backward (the value of sum(attention . w) and the gradients of q, k, v; bf16 inputs) at three shapes:

    llama8b_gqa      Llama-3.1-8B: 4 x 2,048 tokens, 32 heads, 8 kv heads, head dim 128
    deepseek_small   DeepSeek small's MLA: 4 x 2,048 tokens, 16 heads, q/k head dim 96, v 64
    deepseek_v3_tp4  DeepSeek-V3's MLA per chip at a 4-way tensor split: 1 x 4,096 tokens, 32 heads, q/k 192, v 128

by each kernel:

    xla               models/attention/plain.causal_attention (model.attention=xla): query blocks of 512 against the keys
                      they can see
    xla_whole         the same in one block: the whole causal square of scores, masked (the plain einsum issue 47's
                      kernel table timed as "XLA")
    splash_512        jax's Pallas splash kernel (models/attention/splash.py), blocks of 512, splash's separate
                      dq and dkv backward kernels (MaxText's defaults)
    splash_512_fused  blocks of 512, the fused backward
    splash            what model.attention=auto runs on TPUs: the largest block of 1024/512/256/128 that divides the
                      sequence, the fused backward
    splash_padded     the same with the head dims padded with zeros to multiples of 128 lanes (MLA's 96 / 64, 192)

--sweep: instead of those kernels, XLA's and splash's fused kernel under each block-size choice of SWEEP (the forward
kernel's query / key blocks and key compute block, the fused backward's; blocks that do not divide the sequence
are left out), to choose the blocks per family by measurement.

Median of --repeats timed calls after a warm-up, every kernel in this one process; temporaries from the compiled
program's memory analysis; TFLOP/s of the causal half's matmuls (3 x 2 (d + dv) per visible pair and head);
largest |out - xla's out|. Prints a markdown table and writes --json.
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from MaxOffload.cli import ArgumentParser, tool  # noqa: E402  (after the path, like a tool run from a checkout)
from benchmarks.common import median_seconds  # noqa: E402

SHAPES = {"llama8b_gqa": dict(batch=4, length=2048, heads=32, kv_heads=8, qk_dim=128, v_dim=128),
          "deepseek_small": dict(batch=4, length=2048, heads=16, kv_heads=16, qk_dim=96, v_dim=64),
          "deepseek_v3_tp4": dict(batch=1, length=4096, heads=32, kv_heads=32, qk_dim=192, v_dim=128)}
KERNELS = {"xla": None, "xla_whole": "whole", "splash_512": ("splash:512", False),
           "splash_512_fused": ("splash:512", True), "splash": ("splash", True), "splash_padded": ("splash", True, True)}
# --sweep: name -> (block_q, block_kv, block_kv_compute, block_q_dkv, block_kv_dkv, block_kv_dkv_compute), the fused
# backward; "q1024" is what model.attention=auto runs at these lengths
SWEEP = {"q1024": (1024, 1024, 1024, 1024, 1024, 1024), "q2048": (2048, 1024, 1024, 1024, 1024, 1024),
         "q512": (512, 1024, 1024, 1024, 1024, 1024), "kv2048": (1024, 2048, 1024, 1024, 1024, 1024),
         "kv2048_c2048": (1024, 2048, 2048, 1024, 1024, 1024), "q2048_kv2048": (2048, 2048, 1024, 1024, 1024, 1024),
         "kv_c512": (1024, 1024, 512, 1024, 1024, 1024), "dkv_q2048": (1024, 1024, 1024, 2048, 1024, 1024),
         "dkv_kv2048": (1024, 1024, 1024, 1024, 2048, 1024), "dkv_q512": (1024, 1024, 1024, 512, 1024, 512),
         "dkv_c512": (1024, 1024, 1024, 1024, 1024, 512), "q2048_dkv_q2048": (2048, 1024, 1024, 2048, 1024, 1024)}
BLOCK_FIELDS = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute")


def attention_fn(name):
    from MaxOffload.models.attention.plain import causal_attention
    from MaxOffload.models.attention.splash import splash_attention

    if name in SWEEP:
        sizes = dict(zip(BLOCK_FIELDS, SWEEP[name]))
        return lambda q, k, v: splash_attention(q, k, v, None, block_sizes=sizes)
    if KERNELS[name] is None:
        return lambda q, k, v: causal_attention(q, k, v, None)
    if KERNELS[name] == "whole":
        return lambda q, k, v: causal_attention(q, k, v, None, block=q.shape[1])
    kernel, fused, *padded = KERNELS[name]
    return lambda q, k, v: splash_attention(q, k, v, None, kernel=kernel, fused_backward=fused,
                                            pad_heads=bool(padded))


def step(name):
    """((loss, out), (dq, dk, dv)): one forward and one backward. The output comes out of the differentiated function
    (has_aux): computed beside it, splash's forward would run twice (its plain call and its VJP's call that saves
    residuals are different kernels, which XLA cannot merge; until 2026-12-07 this benchmark timed that)."""
    import jax
    import jax.numpy as jnp

    attend = attention_fn(name)

    def loss(q, k, v, w):
        out = attend(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * w), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def causal_flops(batch, length, heads, qk_dim, v_dim, **_):
    return 3 * 2 * (qk_dim + v_dim) * length * (length + 1) // 2 * heads * batch


def measure(name, arrays, repeats):
    import jax

    compiled = step(name).lower(*arrays).compile()
    seconds = median_seconds(compiled, *arrays, repeats=repeats)
    return jax.block_until_ready(compiled(*arrays))[0][1], seconds, compiled.memory_analysis().temp_size_in_bytes


@tool
def main(argv):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="XLA and splash under each block-size choice of SWEEP")
    parser.add_argument("--only", default="", help="--sweep: these choices of SWEEP only (comma-separated)")
    args = parser.parse_args(argv)
    only = [n for n in args.only.split(",") if n]
    unknown = [n for n in only if n not in SWEEP]
    if unknown:
        parser.error(f"--only: {unknown[0]} is not a choice of SWEEP ({', '.join(SWEEP)})")
    import jax
    import jax.numpy as jnp
    import numpy as np

    print(f"devices: {jax.devices()}", flush=True)
    rows = []
    for shape_name, s in SHAPES.items():
        rng = np.random.default_rng(0)
        dims = ((s["batch"], s["length"], s["heads"], s["qk_dim"]), (s["batch"], s["length"], s["kv_heads"], s["qk_dim"]),
                (s["batch"], s["length"], s["kv_heads"], s["v_dim"]))
        arrays = [jnp.asarray(rng.standard_normal(d), jnp.bfloat16) for d in dims]
        arrays.append(jnp.asarray(rng.standard_normal(s["v_dim"]), jnp.float32))
        reference = None
        names = ["xla", "xla_whole", *(n for n in only or SWEEP if all(s["length"] % x == 0 for x in SWEEP[n]))] \
            if args.sweep else list(KERNELS)
        for name in names:
            try:
                out, seconds, temp = measure(name, arrays, args.repeats)
            except Exception as e:  # a kernel this jax or chip cannot run: a row saying so, the others still run
                rows.append({"shape": shape_name, "kernel": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"{shape_name} {name}: FAILED {rows[-1]['error']}", flush=True)
                continue
            out = np.asarray(out.astype(jnp.float32))
            reference = out if reference is None else reference
            row = {"shape": shape_name, **s, "kernel": name, "seconds": seconds, "temp_bytes": temp,
                   "tflops": causal_flops(**s) / seconds / 1e12, "max_abs_diff_vs_xla": float(np.abs(out - reference).max())}
            rows.append(row)
            print(f"{shape_name} {name}: {seconds * 1e3:.2f} ms, {temp / 2**20:.0f} MiB temporaries, "
                  f"{row['tflops']:.1f} TFLOP/s, |out - xla| {row['max_abs_diff_vs_xla']:.3g}", flush=True)
    print("\n| shape | kernel | ms (fwd + bwd) | xla / this | xla_whole / this | temporaries MiB | TFLOP/s (causal half) "
          "| max abs diff vs xla |")
    print("|---|---|---|---|---|---|---|---|")
    bases = [{r["shape"]: r["seconds"] for r in rows if r["kernel"] == b and "seconds" in r} for b in ("xla", "xla_whole")]
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['kernel']} | failed: {r['error'][:80]} | | | | | |")
            continue
        ratios = " | ".join(f"{b[r['shape']] / r['seconds']:.2f}x" if r["shape"] in b else "-" for b in bases)
        print(f"| {r['shape']} | {r['kernel']} | {r['seconds'] * 1e3:.2f} | {ratios} | {r['temp_bytes'] / 2**20:.0f} "
              f"| {r['tflops']:.1f} | {r['max_abs_diff_vs_xla']:.3g} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "repeats": args.repeats,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
