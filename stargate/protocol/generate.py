"""Regenerate the Python gRPC modules from the ``.proto`` files in this package.

Runs the protobuf compiler bundled with ``grpcio-tools`` in-process on
``stargate.proto`` and ``llm_gateway.proto``, with the project root as the only
import root (equivalent to ``python -m grpc_tools.protoc -I . ...`` run from the
project root). Because the protos live at ``stargate/protocol/*.proto`` relative
to that root, the generated modules import each other as
``from stargate.protocol import ..._pb2`` and are written to
``<output_dir>/stargate/protocol/``.

For each proto three files are produced: ``<name>_pb2.py`` (messages),
``<name>_pb2.pyi`` (type stubs) and ``<name>_pb2_grpc.py`` (grpcio stubs).

``grpcio-tools`` is a development-time dependency only, so it is imported
inside :func:`generate`; importing this module does not require it.

Usage::

    python -m stargate.protocol.generate   # regenerate in place (nox -s protos)
"""

from __future__ import annotations

import importlib.resources
import pathlib

PROJECT_ROOT = pathlib.Path(__file__).resolve().parents[2]
"""The project root, used as the protoc import root (``-I``)."""

PROTO_PACKAGE_DIR = pathlib.PurePosixPath("stargate", "protocol")
"""Location of the protos (and of the generated modules) relative to the root."""

PROTO_FILES: tuple[str, ...] = ("stargate.proto", "llm_gateway.proto")
"""The proto files compiled, by file name inside :data:`PROTO_PACKAGE_DIR`."""

GENERATED_SUFFIXES: tuple[str, ...] = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
"""File-name suffixes protoc writes for each proto (appended to the proto stem)."""


def generated_relative_paths() -> list[pathlib.PurePosixPath]:
    """Return the generated files' paths relative to an output directory."""
    return [
        PROTO_PACKAGE_DIR / f"{pathlib.PurePosixPath(proto).stem}{suffix}"
        for proto in PROTO_FILES
        for suffix in GENERATED_SUFFIXES
    ]


def generate(output_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compile both protos into ``output_dir``; return the files written.

    The files land in ``output_dir / "stargate/protocol"`` (created if
    missing), mirroring their place under the project root, so passing
    :data:`PROJECT_ROOT` regenerates the committed modules in place.

    Raises:
        RuntimeError: if protoc reports an error (its diagnostics go to stderr)
            or an expected output file is missing afterwards.
    """
    # Dev-time dependency: imported lazily. grpc_tools ships no type hints.
    from grpc_tools import protoc

    output_dir = output_dir.resolve()
    (output_dir / PROTO_PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    # Bundled well-known types (google/protobuf/*.proto), as `python -m grpc_tools.protoc` does.
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",  # argv[0], ignored by protoc
        f"-I{PROJECT_ROOT}",
        f"-I{well_known}",
        f"--python_out={output_dir}",
        f"--pyi_out={output_dir}",
        f"--grpc_python_out={output_dir}",
        *(str(PROJECT_ROOT / PROTO_PACKAGE_DIR / proto) for proto in PROTO_FILES),
    ]
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc failed with exit status {status}: {' '.join(args[1:])}")
    written = [output_dir / rel for rel in generated_relative_paths()]
    missing = [str(path) for path in written if not path.is_file()]
    if missing:
        raise RuntimeError(f"protoc did not produce: {', '.join(missing)}")
    return written


def main() -> None:
    """Regenerate the committed modules in place under the project root."""
    for path in generate(PROJECT_ROOT):
        print(path.relative_to(PROJECT_ROOT))


if __name__ == "__main__":
    main()
