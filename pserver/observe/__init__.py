"""What a person watching a run reads: the run's summary and counters (metrics), Prometheus
and TensorBoard (telemetry), progress bars (progress) and `pserver status` (status)."""
