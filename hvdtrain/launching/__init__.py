"""Starting jobs: `hvdtrain launch` (horovodrun), the guard that stops a job with its launcher, the
relay of workers' output."""
