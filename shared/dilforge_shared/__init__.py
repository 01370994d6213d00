"""dilforge's own library: the contract every stage and the coordinator share; nothing here imports torch."""
