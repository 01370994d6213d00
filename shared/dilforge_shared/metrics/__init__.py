"""The metrics models eval reads back from upstream manifests (`contract.Metrics`); a model only its stage and the
coordinator use lives in that stage's package."""
