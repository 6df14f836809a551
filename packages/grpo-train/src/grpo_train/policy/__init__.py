"""The policy: HF causal LM workers (Ray actors) that score and train on batches."""
