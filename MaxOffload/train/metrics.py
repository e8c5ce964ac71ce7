"""Where per-step figures go: a progress line on the console, metrics.jsonl, TensorBoard events."""
import json
import os
import sys
import time

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from MaxOffload.errors import ConfigError
from MaxOffload.jsonfile import COUNT, problem


def _duration(seconds):
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def step_rows(path):
    """(line, row) of each readable line of metrics.jsonl (a JSON object with its step), and how many lines were not
    (a crash or a full disk cut the last one short; an edit)."""
    rows, torn = [], 0
    if not os.path.exists(path):
        return rows, torn
    with open(path, errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                row = None
            if problem(row, {"step": COUNT}):
                torn += 1
            else:
                rows.append((line, row))
    return rows, torn


def _lines_up_to(path, step, say=print):
    """The lines of metrics.jsonl for steps <= `step`. An unreadable line is dropped, with one line saying so."""
    rows, torn = step_rows(path)
    if torn:
        say(f"{path}: dropped {torn} unreadable line(s) (cut short by an earlier crash or a full disk, or edited)")
    return [line if line.endswith("\n") else line + "\n" for line, row in rows if row["step"] <= step]


class MetricsLogger:
    """Every step to metrics.jsonl (one JSON object per line) and TensorBoard; a console line every N."""

    def __init__(self, output_dir, total_steps, log_every, stream=None, enabled=True, resume_from=0):
        """enabled=False (processes other than 0 of a multi-process job): writes nothing.
        resume_from=N: keep the lines of steps <= N from an earlier run (later ones are redone)."""
        self.total_steps, self.log_every, self.enabled = total_steps, log_every, enabled
        self.stream = (stream or sys.stdout) if enabled else open(os.devnull, "w")
        path = os.path.join(output_dir, "metrics.jsonl") if enabled else os.devnull
        kept = _lines_up_to(path, resume_from) if resume_from and enabled else []
        self.jsonl = open(path, "w", buffering=1)  # line-buffered: a killed run keeps its lines
        self.jsonl.writelines(kept)
        self.tensorboard = None
        if enabled:
            events = os.path.join(output_dir, "tensorboard")
            try:
                self.tensorboard = EventFileWriter(events)
            except Exception as e:  # noqa: BLE001 - tensorboard's writer raises OSError or its own kinds
                self.jsonl.close()
                raise ConfigError(f"cannot write TensorBoard events to {events} ({type(e).__name__}: {e}); make it "
                                  "a writable directory, or choose another run.output_dir") from None
        self.started = time.perf_counter()

    def _scalars(self, step, values, prefix=""):
        if self.tensorboard is None:
            return
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=prefix + k, simple_value=float(v))
                                             for k, v in values.items() if v is not None])
        self.tensorboard.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def _append(self, row):
        """One line of metrics.jsonl; a failed write (a full disk) is a ConfigError naming the file."""
        try:
            self.jsonl.write(json.dumps(row) + "\n")
        except OSError as e:
            raise ConfigError(f"cannot append step {row['step']} to {self.jsonl.name} ({e.strerror or e}); free space "
                              "there (or make it writable), then rerun: it resumes from its last checkpoint, if any") from None

    def log_step(self, step, metrics):
        """step: the 1-based number of the finished step; metrics: name -> float."""
        self._append({"step": step, **metrics})
        self._scalars(step, metrics, "train/")
        if step % self.log_every == 0 or step == self.total_steps or step == 1:
            self.stream.write(self._progress_line(step, metrics) + "\n")
            self.stream.flush()

    def log_row(self, step, row, scalars, prefix):
        """A row of its own beside the steps' (e.g. a window's straggler figures) and its TensorBoard scalars."""
        self._append({"step": step, **row})
        self._scalars(step, scalars, prefix)

    def log_eval(self, step, metrics):
        self._append({"step": step, **{f"eval_{k}": v for k, v in metrics.items()}})
        self._scalars(step, metrics, "eval/")
        self.stream.write(f"eval  step {step:>{len(str(self.total_steps))}} | "
                          + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()) + "\n")
        self.stream.flush()

    def _progress_line(self, step, m):
        width = len(str(self.total_steps))
        done = step / self.total_steps
        bar = "#" * int(done * 20) + "-" * (20 - int(done * 20))
        elapsed = time.perf_counter() - self.started
        eta = elapsed / step * (self.total_steps - step)
        mfu = f"{m['mfu'] * 100:.1f}%" if m.get("mfu") is not None else "n/a"
        return (f"step {step:>{width}}/{self.total_steps} [{bar}] {done:4.0%} | loss {m['loss']:.4f} "
                f"| gnorm {m['grad_norm']:.3f} | lr {m['learning_rate']:.2e} | {m['step_time_s']:.3f} s/step "
                f"| {m['tokens_per_sec_per_device']:,.0f} tok/s/dev | {m['tflops_per_sec_per_device']:.3f} "
                f"TFLOP/s/dev | MFU {mfu} | eta {_duration(eta)}")

    def close(self):
        try:
            self.jsonl.close()
        except OSError:
            pass  # its failed write was raised already (line-buffered: nothing else is pending)
        if self.tensorboard is not None:
            self.tensorboard.close()
