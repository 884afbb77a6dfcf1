"""Builds the optional C extension; everything else is in pyproject.toml.

``optional=True``: where no C compiler is available the build skips it and the receivers
read binary requests with protobuf's parser alone (``otlp/decode.py``), which stays the
reference either way.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "durable_sessions_collector.otlp._wire",
            ["src/durable_sessions_collector/otlp/_wire.c"],
            optional=True,
        ),
    ]
)
