"""Optimizers (AdamW, LAMB) and the learning-rate schedule."""
