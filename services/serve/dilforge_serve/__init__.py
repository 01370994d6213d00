"""dilforge serve: transformers' own OpenAI-compatible server over a dilforge artifact, plus SageMaker's
inference contract (GET /ping, POST /invocations on port 8080, the model in /opt/ml/model)."""
