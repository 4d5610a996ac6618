from setuptools import find_packages, setup

setup(
    name="hetps",
    version="0.1.0",
    description="Heterogeneous parameter-server training: place ops by type, transpile, run.",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["transpiler*", "runtime*", "ops_registry*"]),
    install_requires=[
        "numpy>=1.24",
        "scipy>=1.10",
        "onnx>=1.15",
        "networkx>=3.0",
        "pyzmq>=25",
        "threadpoolctl>=3.1",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "PyYAML>=6.0",
    ],
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-timeout>=2.1",
            "paddlepaddle==3.3.1",
            "onnxruntime>=1.16",
            "ray[default]==2.60.0",
            "ruff>=0.5",
        ],
        "paddle": ["paddlepaddle==3.3.1"],
        "ray": ["ray[default]==2.60.0"],
        "gpu": ["cupy-cuda12x>=13"],
    },
    entry_points={"console_scripts": ["hetps=runtime.cli:main"]},
)
