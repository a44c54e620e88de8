"""batchfs storage node: an AIStore-compatible HTTP API with GetBatch and an S3 subset."""
