# Two commands: `make train` and `make test`. Each one sets up what is missing first.
PYTHON ?= python3
VENV ?= .venv
NP ?= 2
RECIPE ?= recipes/gpt-tiny.yaml
BIN := $(VENV)/bin

.PHONY: setup train test test-deep test-fast test-image test-compose test-slurm bench gpu-carry clean

# venv, torch (TORCH_SPEC=... to choose a build), Horovod built for this machine, hvdtrain.
# As root on Debian/Ubuntu it apt-installs what is missing (Open MPI, ...); SETUP_ARGS=--sshd
# adds the OpenSSH server that the several-hosts test needs (CI sets it).
setup:
	$(PYTHON) scripts/install.py --venv $(VENV) $(SETUP_ARGS)

# The default recipe on $(NP) local workers, then a sample from the trained model.
train: setup
	$(BIN)/hvdtrain launch -np $(NP) $(RECIPE)
	$(BIN)/hvdtrain generate runs/gpt-tiny/hf "The Python language" --max-new-tokens 40

# Every test but the wider grids marked `deep` (to stay under 45 minutes on 2 cores: see README's
# measured times); the 25 slowest named at the end, to keep an eye on that limit.
test: setup
	$(BIN)/python -m pytest -q -m "not deep" --durations=25 tests

# The wider grids of each capability (layouts x levels x families) and the second real runs of
# guarantees make test checks in another case (an mpi twin, one more precision), beyond its key cases;
# set-up adds the `eval` extra (lm-evaluation-harness) that tests/test_lm_eval.py scores exports with.
test-deep:
	$(PYTHON) scripts/install.py --venv $(VENV) --extras test,eval $(SETUP_ARGS)
	$(BIN)/python -m pytest -q -m deep tests

# The tests that start no worker processes: seconds.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not workers" tests

# The CPU flavour of docker/Dockerfile built with buildah on a Debian 12 base and run as docs/containers.md
# runs it: doctor, 2 workers with Gloo and with MPI, a worker container reached over ssh, a launch on a
# terminal (root).
test-image: setup
	docker/test-image.sh

# docker/docker-compose.yml, unmodified, run with podman-compose on that image (built or reused):
# 2 workers, a resume, the volumes and the owner of runs/ (root; apt-installs podman when missing).
test-compose:
	docker/test-compose.sh

# docker/slurm/hvdtrain.sbatch submitted to a one-node Slurm started for the test (root).
test-slurm: setup
	docker/slurm/test-slurm.sh

bench: setup
	$(BIN)/hvdtrain bench overhead

# The files a lent GPU machine needs (no network there): see scripts/gpu-check.py.
gpu-carry: setup
	$(BIN)/python scripts/gpu-check.py --prepare

clean:
	rm -rf runs
