"""gRPC client SDK for via-sd (``viasd.client``); needs only grpcio, protobuf and pydantic."""
