from setuptools import find_packages, setup

with open("requirements.txt") as f:
    requirements = [line.strip() for line in f if line.strip() and not line.startswith("#")]

DATA = ["tokenizers>=0.19", "sentencepiece>=0.2"]
# The deviceless GPU compile (python -m MaxOffload.aot) needs XLA's GPU compiler: the JAX CUDA plugin,
# version-matched to jaxlib (no GPU, driver or nvidia-* libraries needed to compile). With another
# jaxlib, install the plugin of that version; the aot tool says exactly which.
JAX_VERSION = "0.10.2"
AOT = [f"jax=={JAX_VERSION}", f"jaxlib=={JAX_VERSION}", f"jax-cuda13-plugin=={JAX_VERSION}",
       f"jax-cuda13-pjrt=={JAX_VERSION}"]

setup(
    name="MaxOffload",
    version="0.1.0",
    description="JAX training for very large LLMs with activation host offloading",
    packages=find_packages(include=["MaxOffload", "MaxOffload.*"]),
    python_requires=">=3.11",
    install_requires=requirements,
    # Tokenizers read from local files by `python -m MaxOffload.data.prepare` (tokenizer.json, SentencePiece
    # .model) are optional: imported only when such a file is given. The test extra includes them because
    # tests/test_data.py trains tiny tokenizers of both kinds and prepares a corpus with each.
    # The test extra includes both: tests prepare corpora with each tokenizer kind and compile for GB200.
    # pytest-xdist runs the suite's files on both cores of a small machine (most tests wait on subprocesses).
    # bench: benchmarks/offload_sweep.py draws its bar chart with matplotlib (the tests do not need it).
    extras_require={"data": DATA, "aot": AOT, "bench": ["matplotlib>=3.7"],
                    "test": ["pytest>=8", "pytest-xdist>=3", *DATA, *AOT]},
)
