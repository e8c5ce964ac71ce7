"""Where a run's wall time went, over all its restarts: goodput = productive step time / wall time.

Each time train.py runs (a segment of the run: the first start, then every resume after a preemption, a crash or a
restart) process 0 appends one line to OUTPUT/goodput.jsonl when it ends, done, preempted or stopped: its wall time
(from the trainer's start), compiling, checkpoint restores and saves it waited for, evaluation, its steps' time, and
the steps an earlier segment trained past the checkpoint this one resumed from (trained again: lost). `totals` sums
the lines; what no bucket holds (start-up, data, the loop's own time) is `other_s`. A run that starts from step 0
starts the file afresh. A killed segment writes no line (its lost steps stand for it); the time between segments (a
job waiting in the queue) is nobody's wall time here, except a restart in the same allocation
(launchers/slurm/nvl72.sbatch, launch.restarts): the time from the failed job step's end to this segment's start is
its `restart_s`, with the restart's number and cause.
"""
import dataclasses
import json
import os
import time

from MaxOffload.train import metrics

FILE = "goodput.jsonl"
BUCKETS = ("compile_s", "checkpoint_s", "evaluation_s", "steps_s", "lost_s")
# what the Slurm launcher tells a job step it starts again: the restart's number, its cause, when the failed one ended
RESTART_ENV = ("MAXOFFLOAD_STEP_RESTART", "MAXOFFLOAD_STEP_RESTART_CAUSE", "MAXOFFLOAD_STEP_FAILED_AT")


@dataclasses.dataclass(frozen=True)
class Segment:
    """This run of train.py: when it began (time.perf_counter) and, when the launcher started it again after a failed
    job step, {restart, restart_cause, restart_s}."""
    began: float
    restart: dict | None

    @classmethod
    def start(cls, environ):
        began, now = time.perf_counter(), time.time()
        number, cause, failed_at = (environ.get(name, "") for name in RESTART_ENV)
        if not number.isdigit() or int(number) < 1:
            return cls(began, None)
        try:
            waited = max(0.0, now - float(failed_at))
        except ValueError:  # no time given: the restart is counted, its time is not
            waited = 0.0
        return cls(began, {"restart": int(number), "restart_cause": cause or "unknown", "restart_s": waited})

    def elapsed(self):
        return time.perf_counter() - self.began

    def describe(self):
        """The line a restarted segment starts with (None when it is no restart)."""
        if self.restart is None:
            return None
        r = self.restart
        return (f"restart {r['restart']} of this job (launch.restarts), {r['restart_s']:.0f} s after the job step "
                f"failed: {r['restart_cause']}")


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
    segment ran at least), and so is a restart's time between a failed job step and its segment. goodput = the
    steps' time / the wall time."""
    sums = {key: sum(r[key] for r in rows) for key in ("wall_s", *BUCKETS)}
    restart = sum(r["restart_s"] for r in rows if isinstance(r.get("restart_s"), (int, float)))
    wall = sums["wall_s"] + sums["lost_s"] + restart
    other = sums["wall_s"] - sums["compile_s"] - sums["checkpoint_s"] - sums["evaluation_s"] - sums["steps_s"]
    return {"segments": len(rows), "restarts": max(len(rows) - 1, 0), "wall_s": wall,
            "productive_s": sums["steps_s"], "compile_s": sums["compile_s"], "checkpoint_s": sums["checkpoint_s"],
            "evaluation_s": sums["evaluation_s"], "restart_s": restart, "lost_s": sums["lost_s"],
            "lost_steps": sum(r.get("lost_steps", 0) for r in rows), "other_s": other,
            "goodput": sums["steps_s"] / wall if wall > 0 else None}


def describe(t):
    return (f"goodput {t['goodput']:.1%}: steps {t['productive_s']:.1f} s of {t['wall_s']:.1f} s wall over "
            f"{t['segments']} segment(s) (compile {t['compile_s']:.1f} s, checkpoints {t['checkpoint_s']:.1f} s, "
            f"evaluation {t['evaluation_s']:.1f} s, restarts {t['restart_s']:.1f} s, {t['lost_steps']} steps lost "
            f"{t['lost_s']:.1f} s, other {t['other_s']:.1f} s)")
