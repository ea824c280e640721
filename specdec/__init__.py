"""specdec: split speculative decoding over gRPC. Shared code of both services."""
