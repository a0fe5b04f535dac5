"""The parallelisms: the Horovod layer (init, reduction, token normalisation, broadcasts), pipeline
stages, elastic jobs, the sharded optimizer."""
