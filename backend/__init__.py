"""The engine process host: starts the workers and runs the C++ engine loop (`ringserve._core.Engine`)."""
