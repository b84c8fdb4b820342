"""Generated gRPC message modules for the Stargate wire protocol.

The ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` files are generated from
``stargate.proto`` and ``llm_gateway.proto``; regenerate them with
``nox -s protos``.
"""
