"""The one formula for what a compiled step holds per device, from XLA's memory analysis; the aot report, the
planner and the policy sweep read it here. And the one reading of a compiler's out-of-memory refusal."""
import re

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# libtpu's refusals: "... the total memory required for HLO temporaries (18.64G) exceeds available HBM (15.75G)."
# and "Ran out of memory in memory space hbm. Used 27.60G of 15.75G hbm."
_OOM = (re.compile(r"required[^(]*\((?P<needed>[\d.]+)(?P<nu>[KMGT]?)\)? exceeds available \w+ "
                   r"\((?P<available>[\d.]+)(?P<au>[KMGT]?)\)"),
        re.compile(r"Used (?P<needed>[\d.]+)(?P<nu>[KMGT]?) of (?P<available>[\d.]+)(?P<au>[KMGT]?) hbm"))


def compiled_bytes(analysis):
    """(HBM, pinned host) bytes per device of a compiled program: arguments + outputs - the outputs aliased to
    (donated) arguments + temporaries, on each side. `analysis`: Compiled.memory_analysis()."""
    hbm = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
           + analysis.temp_size_in_bytes)
    host = (analysis.host_argument_size_in_bytes + analysis.host_output_size_in_bytes
            - analysis.host_alias_size_in_bytes + analysis.host_temp_size_in_bytes)
    return hbm, host


def out_of_memory(error):
    """{"needed", "available": bytes, "message": its first line, "of": what `needed` counts ("temporaries": the
    program's temporaries alone; "total")} when `error` is a compiler's or runtime's RESOURCE_EXHAUSTED refusal for
    device memory, else None."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    line = next((ln.strip() for ln in text.splitlines() if "RESOURCE_EXHAUSTED" in ln), text.strip())
    for pattern in _OOM:
        m = pattern.search(text)
        if m:
            return {"needed": int(float(m["needed"]) * _UNITS[m["nu"]]),
                    "available": int(float(m["available"]) * _UNITS[m["au"]]), "message": line[:300],
                    "of": "temporaries" if "temporaries" in m.group(0) else "total"}
    return {"needed": None, "available": None, "message": line[:300], "of": None}


def compile_or_refusal(compile_fn):
    """compile_fn()'s compiled program (e.g. a TrainSetup's compile_train_step), or out_of_memory's dict when the
    compiler refuses it for want of memory (libtpu does: it checks the fit at compile; XLA's GPU compiler leaves it
    to the caller). The compiler failing otherwise (an XLA bug under some flags, say) is a ConfigError: one line
    with XLA's status and what to try, where a traceback would end in the compiler's internals."""
    try:
        return compile_fn()
    except Exception as e:  # jax's runtime error type moved between versions: read the status it carries
        refusal = out_of_memory(e)
        if refusal is not None:
            return refusal
        if type(e).__name__ not in ("JaxRuntimeError", "XlaRuntimeError"):
            raise
        import jaxlib
        from MaxOffload.errors import ConfigError

        status = str(e).strip().splitlines()[0][:240] if str(e).strip() else type(e).__name__
        raise ConfigError(f"XLA's compiler (jaxlib {jaxlib.__version__}) failed on the step: {status}; a compiler "
                          "bug or a combination it does not support, not a wrong config value: try another "
                          "xla.preset (or xla.extra_flags without the flag it fails on) or another jax "
                          "version") from None


FIT_ADVICE = ("keep fewer activations (a smaller remat.policy, e.g. full; or remat.tensors.NAME=offload), a smaller "
              "train.per_device_batch_size, or more devices")


def compile_or_config_error(compile_fn, what="the training step"):
    """compile_fn()'s compiled program; a compiler's refusal for want of device memory (libtpu checks the fit at
    compile) as a ConfigError: one line with the bytes needed and available and what to change (exit 2)."""
    from MaxOffload.errors import ConfigError
    from MaxOffload.reports import gib

    refusal = compile_or_refusal(compile_fn)
    if not isinstance(refusal, dict):
        return refusal  # the compiled program
    if refusal["needed"] is None:
        raise ConfigError(f"{what} does not fit the device's memory ({refusal['message'][:160]}): {FIT_ADVICE}")
    needs = "its temporaries need" if refusal["of"] == "temporaries" else "it needs"
    raise ConfigError(f"{what} does not fit the device's memory: {needs} {gib(refusal['needed'])} of "
                      f"{gib(refusal['available'])}; {FIT_ADVICE} (python -m MaxOffload.aot checks a fit without the "
                      "chip)")


def refused_hbm(refusal, reference):
    """HBM per device a refused program needed: the refusal's total, or, where libtpu counted only temporaries,
    those + the arguments and outputs of `reference` (a compiled program of the same step: the same state)."""
    if refusal["needed"] is None:
        return None
    if refusal["of"] != "temporaries":
        return refusal["needed"]
    m = reference.memory_analysis()
    return compiled_bytes(m)[0] - m.temp_size_in_bytes + refusal["needed"]
