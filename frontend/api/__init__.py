"""The frontend's gRPC surface: the Generation, TorchServe and health services, validation and transport security."""
