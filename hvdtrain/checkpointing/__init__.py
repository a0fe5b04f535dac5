"""Checkpoint files (safetensors + JSON, manifest, checksums) and the export to Hugging Face
folders."""
