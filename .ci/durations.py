"""Prints where a pytest run's time went, from its JUnit XML (pytest --junitxml): each test file's summed time
(setup, call and teardown of its tests), longest first, and the worker-minutes in all. .ci/run prints it after
each stack, so a CI log says which files to cut when CI runs long.
    python .ci/durations.py RESULTS.xml [TOP]"""
import collections
import sys
import xml.etree.ElementTree as ET


def main(path, top=25):
    per_file, count = collections.Counter(), collections.Counter()
    for case in ET.parse(path).iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.test_aot[.TestClass] -> test_aot.py
        name = next((p for p in parts if p.startswith("test_")), parts[-1]) + ".py"
        per_file[name] += float(case.get("time") or 0)
        count[name] += 1
    total = sum(per_file.values())
    print(f"--- time by test file ({total / 60:.1f} worker-minutes, {sum(count.values())} tests):")
    for name, seconds in per_file.most_common(top):
        print(f"{seconds:8.1f} s {100 * seconds / total:5.1f}%  {count[name]:4d} tests  {name}")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
