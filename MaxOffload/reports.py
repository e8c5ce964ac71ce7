"""Writing a tool's JSON report into the run directory and telling the user where it went."""
import json
import os


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def publish(cfg, filename, report, text):
    """Writes <run.output_dir>/<filename>, then prints the report's text and the path."""
    path = os.path.join(cfg.run.output_dir, filename)
    write_json(path, report)
    print(text)
    print(f"wrote {path}")
