"""Builds the optional native span hand-over; everything else is in pyproject.toml.

``optional=True``: where no C compiler (or no POSIX threads) is available the build
skips the extension and ``checking="process"`` uses its pure-Python sender.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "durable_sessions._native",
            ["src/durable_sessions/_native.c"],
            optional=True,
        )
    ]
)
