"""What a run shows: TensorBoard, console and metrics.jsonl (`metrics`), Weights & Biases,
the quiet console, attention maps."""
