"""The front door stays a front door: the README is short, and every file it or a docs/ page names exists."""
import os
import re

from conftest import ROOT


def named_paths(text):
    """Repository paths a Markdown text names in backticks: docs/x.md, benchmarks/results/y/, configs/z.py, ..."""
    roots = ("docs/", "benchmarks/", "configs/", "launchers/", "tests/", "MaxOffload/")
    found = set()
    for item in re.findall(r"`([^`\s]+)`", text):
        path = item.split(":", 1)[0]
        if path.startswith(roots) and not any(c in path for c in "*<>{}|"):
            found.add(path)
    return found


def missing(path_of_doc):
    with open(os.path.join(ROOT, path_of_doc)) as f:
        return sorted(p for p in named_paths(f.read()) if not os.path.exists(os.path.join(ROOT, p)))


def test_the_readme_is_short_and_its_paths_exist():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"
    assert not missing("README.md")


def test_every_docs_page_names_existing_files():
    problems = {page: missing(os.path.join("docs", page)) for page in sorted(os.listdir(os.path.join(ROOT, "docs")))}
    assert not {page: paths for page, paths in problems.items() if paths}


def test_the_path_check_finds_a_missing_file():
    assert named_paths("see `docs/nowhere.md` and `configs/llama3_1.py:405b`, not `x.py`") == \
        {"docs/nowhere.md", "configs/llama3_1.py"}
    assert not os.path.exists(os.path.join(ROOT, "docs/nowhere.md"))
