"""One layer's window of the simulated step as a picture: the engines as lanes, compute's waits hatched."""
import bisect
import collections
import itertools

from MaxOffload.timeline.engines import COLLECTIVE, COMPUTE, D2H, ENGINES, H2D


def layer_window(sim):
    """(start, end, label) of one layer's iteration: the middle iteration of the loop that moves the most bytes to
    and from the host (else the longest loop), or the whole step when there is no loop."""
    if not sim.windows:
        return 0.0, max((e.end for e in sim.events), default=0.0), "the whole step"
    by_loop = collections.defaultdict(list)
    for loop, i, start, end in sim.windows:
        by_loop[loop].append((start, end, i))
    host = sorted((e.start, e.bytes) for e in sim.events if e.engine in (D2H, H2D))
    starts, total = [s for s, _ in host], list(itertools.accumulate((b for _, b in host), initial=0))

    def weight(loop):  # (host bytes whose transfers start in the loop's iterations, the iterations' time)
        spans = by_loop[loop]
        moved = sum(total[bisect.bisect_left(starts, t)] - total[bisect.bisect_left(starts, s)] for s, t, _ in spans)
        return moved, sum(t - s for s, t, _ in spans)

    loop = max(by_loop, key=weight)
    start, end, i = by_loop[loop][len(by_loop[loop]) // 2]
    return start, end, f"{loop}, iteration {i + 1} of {len(by_loop[loop])}"


def plot_window(sim, path):
    """A PNG of one layer's window (layer_window): compute, D2H, H2D and collectives as lanes. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start, end, label = layer_window(sim)
    colors = {COMPUTE: "tab:blue", D2H: "tab:orange", H2D: "tab:green", COLLECTIVE: "tab:purple"}
    fig, ax = plt.subplots(figsize=(10, 3))
    rows = {engine: len(ENGINES) - 1 - i for i, engine in enumerate(ENGINES)}
    for engine, row in rows.items():
        spans = [((max(e.start, start) - start) * 1e3, (min(e.end, end) - max(e.start, start)) * 1e3)
                 for e in sim.events if e.engine == engine and e.end > start and e.start < end]
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolor=colors[engine], edgecolor="white", linewidth=0.3)
    # the compute stream's waits, on its own lane: what each wait is for is the transfer or collective ending then
    stalls = [((e.end - e.stall - start) * 1e3, e.stall * 1e3) for e in sim.events if e.stall and start < e.end <= end]
    ax.broken_barh(stalls, (rows[COMPUTE] - 0.4, 0.8), facecolor="none", edgecolor="red", hatch="//")
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_xlabel("ms (red hatching on compute: waiting for a copy or collective)")
    ax.set_title(f"predicted, {sim.rates.name}: {label}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
