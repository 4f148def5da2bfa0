"""gpu-check: one command that checks every promise of cgpu on the machine's
GPU, real or simulated alike (docs/gpu-check.md)."""
