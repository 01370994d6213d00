"""The metrics models other stages read back from upstream manifests (`manifest.Metrics`); a model only its stage
and the coordinator use lives in that stage's package."""
