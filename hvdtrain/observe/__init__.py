"""What a run shows of itself: step timing, metrics.jsonl, the run log and TensorBoard, the
profiler."""
