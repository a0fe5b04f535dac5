"""The training loop and what it runs on: the step engine, what follows a step, the state a
checkpoint holds, the guards (preemption, non-finite steps, stalls), random number generators."""
