"""`train.py ARGS` for many argument lists in this one process (one Python + JAX start-up for all of them),
each with its own stdout and stderr captured at the file descriptors (C++ and logging output included):
    python tests/helpers/train_many.py CASES.json RESULTS.json
CASES.json: a list of argument lists; RESULTS.json: a list of {"returncode", "stdout", "stderr"}. For the tests
of one-line errors, where starting Python and JAX would be most of each run's time. An exception that escapes
train.main is printed as its traceback and counts as exit status 1, as it would from the command line."""
import json
import os
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import train  # noqa: E402


def run(argv):
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            try:
                code = train.main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: BLE001 - a traceback is what the test must see
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        err.seek(0)
        return {"returncode": code, "stdout": out.read(), "stderr": err.read()}


if __name__ == "__main__":
    os.chdir(ROOT)
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    results = [run(argv) for argv in cases]
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)
