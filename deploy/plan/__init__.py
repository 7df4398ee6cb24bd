"""The plan stage: every host's files and every process's launch, a pure function of the topology (step 2)."""
