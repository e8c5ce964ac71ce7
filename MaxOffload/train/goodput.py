"""Where a run's wall time went, over all its restarts: goodput = productive step time / wall time.

Each time train.py runs (a segment of the run: the first start, then every resume after a preemption, a crash or a
restart) process 0 appends one line to OUTPUT/goodput.jsonl when it ends, done, preempted or stopped: its wall time
(from the trainer's start), compiling, checkpoint restores and saves it waited for, evaluation, its steps' time, and
the steps an earlier segment trained past the checkpoint this one resumed from (trained again: lost). `totals` sums
the lines; what no bucket holds (start-up, data, the loop's own time) is `other_s`. A run that starts from step 0
starts the file afresh. A killed segment writes no line (its lost steps stand for it); the time between segments (a
job waiting in the queue) is nobody's wall time here.
"""
import json
import os

from MaxOffload.train import metrics

FILE = "goodput.jsonl"
BUCKETS = ("compile_s", "checkpoint_s", "evaluation_s", "steps_s", "lost_s")


def lost_steps(output_dir, step):
    """(steps, seconds) an earlier segment logged past `step` in OUTPUT/metrics.jsonl: what a resume from `step`
    trains again."""
    times = [row["step_time_s"] for _, row in metrics.step_rows(os.path.join(output_dir, "metrics.jsonl"))[0]
             if row["step"] > step and isinstance(row.get("step_time_s"), (int, float))]
    return len(times), float(sum(times))


def record(output_dir, row, fresh):
    """Appends this segment's `row` ({wall_s, the BUCKETS, lost_steps, start_step, end_step, ended}) to
    OUTPUT/goodput.jsonl (a new file when `fresh`); returns the totals over the file."""
    path = os.path.join(output_dir, FILE)
    with open(path, "w" if fresh else "a") as f:
        f.write(json.dumps(row) + "\n")
    rows = []
    with open(path, errors="replace") as f:
        for line in f:
            try:
                found = json.loads(line)
            except ValueError:
                continue
            if isinstance(found, dict) and all(isinstance(found.get(k), (int, float)) for k in ("wall_s", *BUCKETS)):
                rows.append(found)
    return totals(rows)


def totals(rows):
    """The segments' sums. Steps are trained again only after a segment that did not end gracefully (killed: it
    wrote no line), so their time is in no segment's wall time: it is added to the wall time as lost (what that
    segment ran at least). goodput = the steps' time / the wall time."""
    sums = {key: sum(r[key] for r in rows) for key in ("wall_s", *BUCKETS)}
    wall = sums["wall_s"] + sums["lost_s"]
    other = sums["wall_s"] - sums["compile_s"] - sums["checkpoint_s"] - sums["evaluation_s"] - sums["steps_s"]
    return {"segments": len(rows), "restarts": max(len(rows) - 1, 0), "wall_s": wall,
            "productive_s": sums["steps_s"], "compile_s": sums["compile_s"], "checkpoint_s": sums["checkpoint_s"],
            "evaluation_s": sums["evaluation_s"], "lost_s": sums["lost_s"],
            "lost_steps": sum(r.get("lost_steps", 0) for r in rows), "other_s": other,
            "goodput": sums["steps_s"] / wall if wall > 0 else None}


def describe(t):
    return (f"goodput {t['goodput']:.1%}: steps {t['productive_s']:.1f} s of {t['wall_s']:.1f} s wall over "
            f"{t['segments']} segment(s) (compile {t['compile_s']:.1f} s, checkpoints {t['checkpoint_s']:.1f} s, "
            f"evaluation {t['evaluation_s']:.1f} s, {t['lost_steps']} steps lost {t['lost_s']:.1f} s, "
            f"other {t['other_s']:.1f} s)")
