"""Side-by-side timing for the benchmarks: one process, one warm-up, the median of a few runs."""
import statistics
import time


def median_seconds(fn, *args, repeats=5):
    """Median wall time of fn(*args) (a jitted function: its result waited for) after one warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
