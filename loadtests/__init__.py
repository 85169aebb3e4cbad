"""Load tests (locust) and benchmarks that write JSON + PNG under results/."""
