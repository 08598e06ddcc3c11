"""What the frontend reports about requests: per-request timelines, OpenTelemetry traces, Prometheus metrics."""
