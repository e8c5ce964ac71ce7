"""The one formula for what a compiled step holds per device, from XLA's memory analysis; the aot report, the
planner and the policy sweep read it here."""


def compiled_bytes(analysis):
    """(HBM, pinned host) bytes per device of a compiled program: arguments + outputs - the outputs aliased to
    (donated) arguments + temporaries, on each side. `analysis`: Compiled.memory_analysis()."""
    hbm = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
           + analysis.temp_size_in_bytes)
    host = (analysis.host_argument_size_in_bytes + analysis.host_output_size_in_bytes
            - analysis.host_alias_size_in_bytes + analysis.host_temp_size_in_bytes)
    return hbm, host
