"""hvdtrain: Horovod data-parallel pretraining of BERT and GPT models with PyTorch."""

__version__ = "0.1.0"
