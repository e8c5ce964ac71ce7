"""Writing a tool's JSON report into the run directory and telling the user where it went."""
import json
import os

from MaxOffload.errors import ConfigError


def gib(n):
    """n bytes as GiB, or MiB below one GiB, for a tool's report lines."""
    return f"{n / 2**30:,.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:,.1f} MiB"


def peak_rss():
    """This process's peak resident memory in bytes (Linux: ru_maxrss is in KiB), for a tool's report lines."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def unwritable_dir(path):
    """Creates directory `path` (and its parents) and checks a file can be written there: None, or why not."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test.{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def write_json(path, obj):
    """Written whole or not at all: a temporary file renamed over the old one (a crash or a full disk never
    leaves half a file)."""
    tmp = f"{path}.partial"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def publish(cfg, filename, report, text):
    """Prints the report's text, then writes <run.output_dir>/<filename> and says where; a file that cannot be
    written is one ConfigError line after the complete report."""
    path = os.path.join(cfg.run.output_dir, filename)
    print(text, flush=True)
    try:
        write_json(path, report)
    except OSError as e:
        raise ConfigError(f"could not write {path} ({e.strerror}); the report above is complete: give a writable "
                          "run.output_dir to keep it as JSON") from None
    print(f"wrote {path}")
