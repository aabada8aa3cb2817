"""End-to-end benchmarks against HF transformers (``autodeploy bench``)."""
