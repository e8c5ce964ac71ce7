"""Shared test helpers. Tests run on CPU; a subprocess gets its own XLA_FLAGS when it needs
several simulated devices."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_configure(config):
    config.addinivalue_line("markers", "once: the test's subject does not depend on the Python/JAX version (one-line "
                                       "errors, file formats, the launcher, reports): .ci/run runs it on one stack")


def run_cli(args, env=None, timeout=600):
    """Runs `python ARGS...` from the repository root; returns the CompletedProcess (text)."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def cli():
    return run_cli
