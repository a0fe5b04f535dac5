"""Bad input: one line naming the key, file or value; exit code 2; no traceback; nothing written."""
import pytest

from helpers import BIN, hvdtrain, run_cmd

pytestmark = pytest.mark.workers

CASES = [
    # (overrides, words the message must contain)
    (["train.learning_rate=1"], ["unknown config key 'train.learning_rate'"]),
    (["colour=blue"], ["unknown config key 'colour'"]),
    (["train.lr=fast"], ["'train.lr'", "a number"]),
    (["train.micro_batch_size=2.5"], ["'train.micro_batch_size'", "an integer"]),
    (["train.precision=fp8"], ["'train.precision'", "'bf16'"]),
    (["model.n_head=3"], ["'model.n_head'", "divisor"]),
    (["model.arch=llama", "model.n_head=3"], ["'model.n_head'", "divisor"]),
    (["model.arch=llama", "model.n_head=4", "model.n_kv_head=3"], ["'model.n_kv_head'", "divisor of model.n_head (4)"]),
    (["model.n_kv_head=1"], ["'model.n_kv_head'", "with model.arch gpt2", "a knob of llama, mixtral only"]),
    (["model.experts=4"], ["'model.experts'", "with model.arch gpt2", "a knob of mixtral only"]),
    (["model.arch=mixtral", "model.experts=4", "model.experts_per_token=5"],
     ["'model.experts_per_token'", "an integer in [1, model.experts (4)]", "5"]),
    (["model.arch=mixtral", "model.experts=1"], ["'model.experts'", "an integer >= model.experts_per_token (2)"]),
    (["model.arch=mixtral", "model.router_aux_loss_coef=-1"], ["'model.router_aux_loss_coef'", "a number >= 0"]),
    (["parallel.expert_parallel=2"], ["'parallel.expert_parallel'", "1 with model.arch 'gpt2'"]),
    (["model.arch=mixtral", "model.experts=4", "parallel.expert_parallel=3"],
     ["'parallel.expert_parallel'", "a divisor of model.experts (4)"]),
    (["model.arch=mixtral", "model.d_ff=172", "train.precision=bf16", "parallel.shard=optimizer"],
     ["'model.d_ff'", "a multiple of 8 (and model.d_model too) with model.arch mixtral"]),
    (["model.arch=mixtral", "parallel.expert_parallel=2", "train.optimizer=lamb", "train.weight_decay=0.01"],
     ["'train.optimizer'", "'adamw' with parallel.expert_parallel > 1"]),
    (["model.arch=mixtral", "parallel.tensor_parallel=2"],
     ["'parallel.tensor_parallel'", "1 with model.arch 'mixtral' (its layers are not split yet)"]),
    (["model.arch=llama", "model.n_head=4", "model.n_kv_head=1", "parallel.tensor_parallel=2"],
     ["'parallel.tensor_parallel'", "a divisor of model.n_kv_head (1)"]),
    (["model.arch=bert", "model.tie_embeddings=false"], ["'model.tie_embeddings'", "model.arch bert"]),
    (["model.arch=t5"], ["'model.arch'", "'llama'"]),
    (["model.local_attention=64"], ["'model.local_attention'", "a knob of modernbert only"]),
    (["train.max_steps=0"], ["'train.max_steps'", ">= 1"]),
    (["train.micro_batch_size=512"], ["global batch (512", "larger than the training set (256 blocks"]),
    (["train.global_batch_size=0"], ["'train.global_batch_size'", "an integer >= 1"]),
    (["train.seed=-1"], ["'train.seed'", "an integer in [0, 2^32 - 1]", "-1"]),
    (["model.arch=llama", "model.d_model=36", "model.n_head=4"],
     ["'model.n_head'", "model.d_model (36)", "even head dimension model.d_model / model.n_head"]),
    (["data.source=/no/such/corpus.txt"], ["/no/such/corpus.txt"]),
    (["trainlr"], ["override 'trainlr'", "key.sub=value"]),
]


def assert_one_line_error(proc, words, out_dir):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hvdtrain: error: ")
    for w in words:
        assert w in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out_dir.exists(), "nothing may be written for a bad input"


@pytest.mark.parametrize("overrides,words", CASES, ids=[c[0][0] for c in CASES])
def test_bad_input_single_worker(tmp_path, tiny_config, overrides, words):
    config = tiny_config()
    out = tmp_path / "run"
    assert_one_line_error(hvdtrain("train", config, f"out_dir={out}", *overrides), words, out)


def test_missing_and_broken_config_files(tmp_path):
    out = tmp_path / "run"
    assert_one_line_error(hvdtrain("train", tmp_path / "nope.yaml", f"out_dir={out}"), ["nope.yaml", "does not exist"], out)
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  lr: [1\n")
    assert_one_line_error(hvdtrain("train", broken, f"out_dir={out}"), ["broken.yaml", "not valid YAML"], out)


def test_bad_input_through_launch_is_reported_once(tmp_path, tiny_config):
    """Config errors are caught before any worker starts."""
    out = tmp_path / "run"
    proc = hvdtrain("launch", "-np", "2", tiny_config(), f"out_dir={out}", "train.lr=fast")
    assert_one_line_error(proc, ["'train.lr'"], out)


@pytest.mark.parametrize("arch,key", [pytest.param("mixtral model.experts=4", "expert_parallel", marks=pytest.mark.deep),
                                      ("llama model.n_head=4", "tensor_parallel")])
def test_groups_that_do_not_divide_the_workers_are_reported_once(tmp_path, tiny_config, arch, key):
    """parallel.expert_parallel=4 (tensor_parallel=4) on 2 workers: known only once the
    workers count themselves."""
    out = tmp_path / "run"
    proc = hvdtrain("launch", "-np", "2", tiny_config(), f"out_dir={out}", *f"model.arch={arch}".split(),
                    f"parallel.{key}=4")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = f"config key 'parallel.{key}': 4 does not divide the 2 workers"
    assert (proc.stdout + proc.stderr).count(message) == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()


def test_data_error_in_two_workers_is_reported_once(tmp_path, tiny_config):
    """A mistake only the workers can see (the data is smaller than one global batch): every
    rank stops with exit 2, only rank 0 prints."""
    out = tmp_path / "run"
    proc = hvdtrain("launch", "-np", "2", tiny_config(), f"out_dir={out}", "train.micro_batch_size=200")
    assert proc.returncode == 2
    assert proc.stdout.count("larger than the training set") + proc.stderr.count("larger than the training set") == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()


def test_existing_checkpoints_survive_an_incompatible_resume(tmp_path, tiny_config):
    """Resuming into a run folder with another model shape is refused; the checkpoint is untouched."""
    config = tiny_config({"train": {"max_steps": 2}})
    out = tmp_path / "run"
    assert hvdtrain("train", config, f"out_dir={out}").returncode == 0
    before = {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    proc = hvdtrain("train", config, f"out_dir={out}", "model.d_model=64", "train.max_steps=4")
    assert proc.returncode == 2 and "'model.d_model'" in proc.stderr and "Traceback" not in proc.stderr
    after = {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    assert before == after


def test_adasum_is_refused_with_the_reason(tmp_path, tiny_config):
    out = tmp_path / "run"
    proc = hvdtrain("launch", "-np", "2", tiny_config(), f"out_dir={out}", "horovod.op=adasum")
    assert_one_line_error(proc, ["'horovod.op'", "adasum", "'average'"], out)


def test_a_fresh_run_never_mixes_with_an_earlier_run_in_its_folder(tmp_path, tiny_config):
    """checkpoint.resume=false into a folder that holds a run: refused, nothing of it touched."""
    config = tiny_config({"train": {"max_steps": 4}, "checkpoint": {"every": 2}})
    out = tmp_path / "run"
    assert hvdtrain("train", config, f"out_dir={out}").returncode == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = hvdtrain("train", config, f"out_dir={out}", "checkpoint.resume=false", "train.max_steps=2")
    assert proc.returncode == 2 and "checkpoint.resume is false" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert before == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}


@pytest.mark.parametrize("key,value", [("model.max_position", 32),
                                       pytest.param("data.validation_fraction", 0.5, marks=pytest.mark.deep),
                                       pytest.param("data.synthetic_samples", 128, marks=pytest.mark.deep)])
def test_resume_refuses_a_change_of_shape_or_data(tmp_path, tiny_config, key, value):
    config = tiny_config({"train": {"max_steps": 2}})
    out = tmp_path / "run"
    assert hvdtrain("train", config, f"out_dir={out}").returncode == 0
    proc = hvdtrain("train", config, f"out_dir={out}", f"{key}={value}", "train.max_steps=4")
    assert proc.returncode == 2 and f"'{key}'" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_crafted_pickle_in_a_run_folder_never_runs(tmp_path, tiny_config):
    """A state.pt that would create a marker file when unpickled: resume and export refuse it
    with one line, and the marker never appears."""
    import pickle
    marker = tmp_path / "marker"

    class MakesAMarker:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    out = tmp_path / "run"
    folder = out / "checkpoints" / "step_00000002"
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(pickle.dumps({"step": MakesAMarker()}))
    for proc in (hvdtrain("train", tiny_config(), f"out_dir={out}"),
                 hvdtrain("export", out, tmp_path / "exported")):
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "pickle" in proc.stderr, proc.stderr
    assert not marker.exists()


def test_out_dir_that_is_a_file_is_refused(tmp_path, tiny_config):
    target = tmp_path / "a-file"
    target.write_text("mine")
    proc = hvdtrain("train", tiny_config(), f"out_dir={target}")
    assert proc.returncode == 2 and "out_dir" in proc.stderr and "is a file" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and target.read_text() == "mine"
    proc = hvdtrain("export", tmp_path, target)
    assert proc.returncode == 2 and "export folder" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.deep
def test_a_checkpoint_write_that_fails_half_way_keeps_the_earlier_ones(tmp_path, tiny_config):
    """A file-size limit (as a full disk would) stops the step-6 checkpoint half way: one line,
    non-zero exit, no temporary folder left, and the step-4 checkpoint still resumes."""
    from hvdtrain.checkpointing import checkpoint
    config = tiny_config({"train": {"max_steps": 8}, "checkpoint": {"every": 2, "keep": 5}})
    out = tmp_path / "run"
    assert hvdtrain("train", config, f"out_dir={out}", "train.stop_at_step=4").returncode == 0
    size_kb = (checkpoint.newest_intact_checkpoint(out) / "model.safetensors").stat().st_size // 1024
    # Under horovodrun's Gloo: a lone process would start MPI, which needs files over the limit.
    proc = run_cmd(["bash", "-c", f"ulimit -f {size_kb // 2} && exec {BIN / 'hvdtrain'} launch -np 1 --gloo "
                                  f"{config} out_dir={out}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not write the checkpoint of step 6" in lines[0], proc.stderr
    assert [p.name for p in checkpoint.checkpoint_dir(out).iterdir()] and \
        not [p for p in checkpoint.checkpoint_dir(out).iterdir() if p.name.startswith(".")]
    assert checkpoint.newest_intact_checkpoint(out).name == "step_00000004"
    assert hvdtrain("train", config, f"out_dir={out}").returncode == 0
    assert checkpoint.newest_intact_checkpoint(out).name == "step_00000008"


def test_every_path_a_user_gives_is_checked_before_anything_is_written(tmp_path, tiny_config):
    """Missing, or a file where a folder is needed: one line naming it, exit code 2."""
    config, out, missing = tiny_config(), tmp_path / "run", tmp_path / "missing"
    a_file, empty = tmp_path / "a-file", tmp_path / "empty"
    a_file.write_text("mine")
    empty.mkdir()
    cases = [
        (["train", config, f"out_dir={out}", "data.source=builtin", f"data.cache_dir={a_file}"],
         ["data.cache_dir", "is a file"]),
        (["train", config, f"out_dir={out}", f"data.source={empty}"], ["data.source", "has no"]),
        (["train", config, f"out_dir={out}", f"model.pretrained={missing}"], ["model.pretrained", str(missing)]),
        (["train", config, f"out_dir={out}", f"model.pretrained={a_file}"], ["model.pretrained", str(a_file)]),
        (["export", missing, out], [str(missing)]),
        (["report", missing], [str(missing)]),
    ]
    for args, words in cases:
        assert_one_line_error(hvdtrain(*args), words, out)
    assert a_file.read_text() == "mine" and not list(empty.iterdir())


def test_an_export_that_fails_half_way_leaves_nothing_behind_and_the_run_intact(tmp_path, tiny_config):
    """A file-size limit (as a full disk would) stops the export's weights half way."""
    from hvdtrain.checkpointing import checkpoint
    out, target = tmp_path / "run", tmp_path / "exported"
    assert hvdtrain("train", tiny_config(), f"out_dir={out}").returncode == 0
    size_kb = (out / "hf" / "model.safetensors").stat().st_size // 1024
    proc = run_cmd(["bash", "-c", f"ulimit -f {size_kb // 2} && exec {BIN / 'hvdtrain'} export {out} {target}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"could not write the Hugging Face folder {target}" in lines[0], proc.stderr
    assert not target.exists() and not list(tmp_path.glob(".exported*"))
    assert checkpoint.find_problem(checkpoint.newest_intact_checkpoint(out)) is None
    assert hvdtrain("export", out, target).returncode == 0 and (target / "model.safetensors").is_file()
