"""`mtpkit bench`: offline k-sweeps, serving benchmarks against OpenAI-compatible servers,
and side-by-side comparisons with other engines on the same model and machine."""
