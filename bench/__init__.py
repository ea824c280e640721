"""specdec demo, benchmarks and load tests."""
