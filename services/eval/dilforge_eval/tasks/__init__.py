"""lm-evaluation-harness task configs shipped with the eval service (see docs/eval.md)."""
