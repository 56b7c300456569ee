"""The KServe v2 gRPC transport (``inference.GRPCInferenceService``): ``server`` is the servicer,
``codec`` converts messages, ``kserve_pb2*`` are generated from ``kserve.proto`` by grpcio-tools.

Keep ``tritonclient.grpc`` out of any process that imports these modules: both register the
``inference.*`` message names in protobuf's default pool, and the second registration fails.
The server process never imports tritonclient; tests talk to it from their own process."""
