"""The app: the sparsekit command (Hydra), config schema, pipeline, training loop, tracking."""
