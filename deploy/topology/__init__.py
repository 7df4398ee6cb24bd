"""The topology stage: a topology file read, checked and completed (deploy pipeline, step 1)."""
