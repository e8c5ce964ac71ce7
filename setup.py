from setuptools import find_packages, setup

with open("requirements.txt") as f:
    requirements = [line.strip() for line in f if line.strip() and not line.startswith("#")]

setup(
    name="MaxOffload",
    version="0.1.0",
    description="JAX training for very large LLMs with activation host offloading",
    packages=find_packages(include=["MaxOffload", "MaxOffload.*"]),
    python_requires=">=3.11",
    install_requires=requirements,
    extras_require={"test": ["pytest>=8"]},
)
