"""Everything about the package is in pyproject.toml, except its one compiled part: the fused packed
attention kernel (model/_attention.c, plain C, called through ctypes by model/fused_attention.py). It is
optional: where it cannot be built (no C compiler, an old one) the install goes on, and the model runs torch's
attention kernel instead (`/info` says which)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "model._attention",
            sources=["model/_attention.c"],
            extra_compile_args=["-O3", "-Wno-psabi"],
            libraries=["m"],
            optional=True,
        )
    ]
)
