from setuptools import find_packages, setup

with open("requirements.txt") as f:
    requirements = [line.strip() for line in f if line.strip() and not line.startswith("#")]

# Tokenizers read from local files by `python -m MaxOffload.data.prepare` (tokenizer.json, SentencePiece
# .model) are optional: imported only when such a file is given.
DATA = ["tokenizers>=0.19", "sentencepiece>=0.2"]
# The deviceless GPU compile (python -m MaxOffload.aot) needs XLA's GPU compiler: the JAX CUDA plugin of
# exactly the installed jaxlib's version (no GPU, driver or nvidia-* libraries are needed to compile).
# jax's own `cuda13-local` extra pins jaxlib and the plugin to the jax version pip resolves, so the match
# is computed at install time on every stack (0.10.2 on Python 3.11, the newest jax requirements.txt admits on 3.12).
AOT = ["jax[cuda13-local]"]
# The deviceless TPU compile (python -m MaxOffload.aot --target v5e ...) and training on a TPU machine: libtpu at the
# version the installed jax pins for its own `tpu` extra (jax 0.10.2: libtpu 0.0.42; 0.12: 0.0.50), no TPU needed
# to compile. MaxOffload/platform.py starts JAX on the TPU only where a chip is attached.
TPU = ["jax[tpu]"]
# benchmarks/offload_sweep.py and moe/attention benchmarks draw their charts with matplotlib.
BENCH = ["matplotlib>=3.7"]
# The reference implementation the checkpoint conversion is tested against (tests/test_convert_hf.py): transformers
# and torch 2.13.0 on Python 3.11. `torch==2.13.0` resolves with PyPI alone (checked: pip install --dry-run
# --index-url https://pypi.org/simple -e '.[test]'), where it is PyPI's CUDA build; on the CI machine a CPU build of
# the same release (2.13.0+cpu, which the pin admits) lies in pip's find-links, so CI never fetches the CUDA build.
# .ci/run runs those tests on the py311 stack.
REFERENCE = ['torch==2.13.0; python_version < "3.12"', 'transformers>=5.0,<6; python_version < "3.12"']

setup(
    name="MaxOffload",
    version="0.1.0",
    description="JAX training for very large LLMs with activation host offloading",
    packages=find_packages(include=["MaxOffload", "MaxOffload.*"]),
    python_requires=">=3.11",
    install_requires=requirements,
    # The test extra holds every package a test imports (tests/test_install.py checks it): the tokenizers
    # (tests prepare corpora with each kind), the CUDA plugin (tests compile for GB200), libtpu (tests compile for
    # v5e), matplotlib (a test
    # runs the sweep benchmark, which draws its chart), the reference implementation (transformers, on Python 3.11),
    # pytest-xdist (the suite runs on both cores) and packaging (a test reads requirements.txt's tokamax pins).
    extras_require={"data": DATA, "aot": AOT, "tpu": TPU, "bench": BENCH,
                    "test": ["pytest>=8", "pytest-xdist>=3", "packaging>=22", *DATA, *AOT, *TPU, *BENCH,
                             *REFERENCE]},
)
