"""Makes the generated modules of one protos/ folder import each other relatively (`from . import x_pb2`).

protoc writes `import model_config_pb2` for a .proto that imports "model_config.proto" by bare name, as Triton's
KServe protos do; inside the ringserve package that must be a relative import.
Usage: python scripts/relative_proto_imports.py GENERATED_FOLDER
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def make_relative(folder: Path) -> None:
    local = {path.stem for path in folder.glob("*_pb2.py")}
    pattern = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)
    for path in [*folder.glob("*_pb2.py"), *folder.glob("*_pb2_grpc.py"), *folder.glob("*_pb2.pyi")]:
        text = path.read_text()
        fixed = pattern.sub(lambda m: f"from . import {m[1]} as {m[2]}" if m[1] in local else m[0], text)
        if fixed != text:
            path.write_text(fixed)


if __name__ == "__main__":
    make_relative(Path(sys.argv[1]))
