"""Everything about the package is in pyproject.toml, except its one compiled part: the fused kernels
(model/engines/_kernels.c, plain C: the packed attention, the residual add + LayerNorm and rotary positions,
called through ctypes by model/engines/fused.py). They are optional: where they cannot be built (no C compiler,
an old one) the install goes on, and the model runs torch's kernels instead (`/info` says which)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "model.engines._kernels",
            sources=["model/engines/_kernels.c"],
            extra_compile_args=["-O3", "-Wall", "-Wno-psabi"],
            libraries=["m"],
            optional=True,
        )
    ]
)
