"""RingServe: an LLM serving engine.

This folder is the package in a checkout as in the wheel: frontend, backend and workers link to the top-level folders
of the same names; _core, _kernels and the generated protobuf packages (v1, torchserve, internal, kserve) are the
built parts that scripts/build-native.sh installs here.
"""

__version__ = "0.1.0"  # the distribution's version too: pyproject.toml reads it from here
