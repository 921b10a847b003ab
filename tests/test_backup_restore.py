"""tf_topk.keras.BackupAndRestore: resume where training stopped, on one process or many.

One process (in this process, seconds each): resuming after a failure, at an
epoch or a batch, ends with the weights of an uninterrupted run, bitwise, with
and without TopKOptimizer; a backup at an epoch's last batch resumes at the
next epoch, whether or not the epoch's length is known; residuals are in the
backup and come back; a commit is atomic and synced to disk; the backup is
deleted or kept as asked.

Two workers (tests/workers/backup_fit.py under `python -m tf_topk.launch
--restarts 1`, slow): worker 1 is killed with SIGKILL in the middle of epoch
3 of 6; the launcher restarts both workers, which resume from the shared
backup and finish with identical weights, bitwise equal to an uninterrupted
run, for dense training and for TopKOptimizer (with momentum correction
too): the backup holds every worker's own residuals and velocities
(`tf_topk.replica_state`), and each worker gets its own back, bitwise.
"""

import io
import os
import signal
import stat
import subprocess
import time

import numpy as np
import pytest

from multiworker import (FORKSERVER, LAUNCH_CLI, PYTHON, REPO_ROOT, assert_ok, kill_recorded_workers, launch, load_json, load_weights,
                         run_script, worker_env)

keras = pytest.importorskip("keras")

import tf_topk  # noqa: E402
from tf_topk.keras import BackupAndRestore  # noqa: E402
from tf_topk.keras.backup import METADATA_NAME  # noqa: E402

EPOCHS, BATCH, SAMPLES = 6, 64, 512  # 8 batches per epoch


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x[:SAMPLES] / 16.0).astype("float32"), y[:SAMPLES].astype("int32")


def make_model(topk, exchange_mode="auto"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(0.3)
    if topk:
        optimizer = tf_topk.TopKOptimizer(optimizer, density=0.05, exchange_mode=exchange_mode)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class FailAt(keras.callbacks.Callback):
    """Raise before batch `batch` of epoch `epoch`, as a crash would stop training."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("crash")


class Epochs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.begun = []

    def on_epoch_begin(self, epoch, logs=None):
        self.begun.append(epoch)


def fit(model, data, *callbacks, epochs=EPOCHS):
    """`data`: (x, y) arrays, or (dataset,) of batches already."""
    batch_size = BATCH if len(data) == 2 else None
    return model.fit(*data, epochs=epochs, batch_size=batch_size, shuffle=False, verbose=0, callbacks=list(callbacks))


def assert_same_weights(a, b):
    for x, y in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_array_equal(x, y)


# -- one process ---------------------------------------------------------------


@pytest.mark.parametrize("bad, message", [
    (dict(backup_dir=""), "backup_dir must be a non-empty path, got ''"),
    (dict(backup_dir=None), "backup_dir must be a non-empty path, got None"),
    (dict(backup_dir="gs://bucket/run"), "backup_dir must be a path on a mounted file system, got 'gs://bucket/run'"),
    (dict(backup_dir="b", save_freq=0), "save_freq must be 'epoch' or an int >= 1 (batches), got 0"),
    (dict(backup_dir="b", save_freq="batch"), "save_freq must be 'epoch' or an int >= 1 (batches), got 'batch'"),
    (dict(backup_dir="b", save_freq=True), "save_freq must be 'epoch' or an int >= 1 (batches), got True"),
])
def test_argument_errors(bad, message):
    with pytest.raises(ValueError) as e:
        BackupAndRestore(**bad)
    assert message in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("topk, exchange_mode", [(False, "auto"), (True, "auto"), (True, "allgather_chunk")],
                         ids=["dense", "topk", "topk-14-bit-entries"])
@pytest.mark.parametrize("save_freq, resume_at", [("epoch", (2, 0)), (3, (2, 5))], ids=["epoch", "3-batches"])
def test_resume_after_a_crash_ends_as_an_uninterrupted_run(topk, exchange_mode, save_freq, resume_at, digits,
                                                           tmp_path):
    """The chunk route's residuals hold its rounding errors too: they come back with the rest."""
    backup_dir = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="crash"):
        fit(make_model(topk, exchange_mode), digits, BackupAndRestore(backup_dir, save_freq=save_freq), FailAt(2, 5))
    # Epoch mode: the backup of epoch 2's end. Every 3 batches: batches 3, 6 | 1, 4, 7 | 2, 5 of epoch 2.
    assert load_json(backup_dir / METADATA_NAME)["epoch"] == resume_at[0]

    model, backup, epochs = make_model(topk, exchange_mode), BackupAndRestore(backup_dir, save_freq=save_freq), Epochs()
    history = fit(model, digits, backup, epochs)
    assert (backup.restored_epoch, backup.restored_batch) == resume_at
    assert epochs.begun == list(range(resume_at[0], EPOCHS))  # epochs already done are not redone
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * SAMPLES // BATCH  # nor batches
    assert len(history.history["loss"]) == EPOCHS - resume_at[0]
    assert not backup_dir.exists()  # deleted at the end of a successful fit
    assert model._initial_epoch is None  # a later fit() starts where it is asked to

    reference = make_model(topk, exchange_mode)
    fit(reference, digits, BackupAndRestore(tmp_path / "reference", save_freq=save_freq))
    assert_same_weights(model, reference)


class TrainedBatches(keras.callbacks.Callback):
    """Batches actually trained in each epoch: optimizer steps, so skipped batches do not count."""

    def __init__(self):
        super().__init__()
        self.per_epoch = {}

    def on_epoch_begin(self, epoch, logs=None):
        self._start = int(self.model.optimizer.iterations.numpy())

    def on_epoch_end(self, epoch, logs=None):
        self.per_epoch[epoch] = int(self.model.optimizer.iterations.numpy()) - self._start


def unknown_cardinality(data):
    """The same batches as `fit(model, data)`, from a dataset whose length Keras cannot know."""
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(data).batch(BATCH).filter(lambda x, y: True)
    assert dataset.cardinality() == tf.data.UNKNOWN_CARDINALITY
    return (dataset,)


@pytest.mark.slow
@pytest.mark.parametrize("topk", [False, True], ids=["dense", "topk"])
@pytest.mark.parametrize("steps", ["known", "unknown"])
def test_a_backup_at_an_epochs_last_batch_resumes_at_the_next_epoch(steps, topk, digits, tmp_path):
    # Every 4 of 8 batches: a backup at batch 4 and at the last batch of each epoch.
    # Killed before the first batch of epoch 3 (index 2): the last backup came at
    # the last batch of epoch 2, that is, at its end.
    data = digits if steps == "known" else unknown_cardinality(digits)
    epochs = 4
    with pytest.raises(RuntimeError, match="crash"):
        fit(make_model(topk), data, BackupAndRestore(tmp_path / "backup", save_freq=4), FailAt(2, 0), epochs=epochs)

    model, backup = make_model(topk), BackupAndRestore(tmp_path / "backup", save_freq=4)
    begun, trained = Epochs(), TrainedBatches()
    history = fit(model, data, backup, begun, trained, epochs=epochs)
    assert (backup.restored_epoch, backup.restored_batch) == (2, 0)
    assert begun.begun == [2, 3]  # not epoch index 1 again, made only of skipped batches
    assert len(history.history["loss"]) == len(history.epoch) == 2

    reference, reference_trained = make_model(topk), TrainedBatches()
    fit(reference, data, reference_trained, epochs=epochs)
    assert trained.per_epoch == {epoch: reference_trained.per_epoch[epoch] for epoch in (2, 3)}
    assert min(trained.per_epoch.values()) >= SAMPLES // BATCH
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    assert_same_weights(model, reference)


def test_residuals_are_in_the_backup_and_come_back(digits, tmp_path):
    import h5py

    model = make_model(topk=True)
    fit(model, digits, BackupAndRestore(tmp_path, delete_checkpoint=False), epochs=2)
    optimizer = model.optimizer
    assert optimizer.residuals
    weights_file = tmp_path / load_json(tmp_path / METADATA_NAME)["weights"]
    with h5py.File(weights_file, "r") as f:
        saved = f["optimizer/vars"]
        assert len(saved) == len(optimizer.variables)  # Keras stores them by position
        for residual in optimizer.residuals:
            index = next(i for i, v in enumerate(optimizer.variables) if v is residual)
            value = residual.numpy()
            assert np.abs(value).sum() > 0
            np.testing.assert_array_equal(saved[str(index)][()], value)

    restored = make_model(topk=True)
    fit(restored, digits, BackupAndRestore(tmp_path, delete_checkpoint=False), epochs=2)  # nothing left to train
    assert int(restored.optimizer.iterations.numpy()) == int(optimizer.iterations.numpy()) == 16
    for before, after in zip(optimizer.residuals, restored.optimizer.residuals, strict=True):
        np.testing.assert_array_equal(before.numpy(), after.numpy())
    assert_same_weights(model, restored)


def test_leftovers_of_a_killed_save_are_ignored_then_removed(digits, tmp_path):
    tmp_path.mkdir(exist_ok=True)
    # What a save killed half-way leaves: a partial temporary weights file and metadata.
    (tmp_path / ".tmp-0123.weights.h5").write_bytes(b"\x89HDF half a file")
    (tmp_path / ".tmp-4567.json").write_text('{"epoch": 9')
    model = make_model(topk=False)
    backup = BackupAndRestore(tmp_path, delete_checkpoint=False)
    fit(model, digits, backup, epochs=1)
    assert backup.restored_epoch is None  # no committed backup: a fresh start
    assert sorted(os.listdir(tmp_path)) == ["backup-epoch1-batch0.weights.h5", METADATA_NAME]


def test_a_save_killed_before_its_commit_leaves_the_previous_backup(digits, tmp_path, monkeypatch):
    model = make_model(topk=False)
    fit(model, digits, BackupAndRestore(tmp_path, delete_checkpoint=False), epochs=2)
    after_epoch_2 = model.get_weights()

    real_replace = os.replace

    def die_at_commit(src, dst):  # the process "dies" between the weights rename and the metadata rename
        if str(dst).endswith(METADATA_NAME):
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", die_at_commit)
    with pytest.raises(KeyboardInterrupt):
        fit(model, digits, BackupAndRestore(tmp_path, delete_checkpoint=False), epochs=3)
    monkeypatch.undo()
    assert load_json(tmp_path / METADATA_NAME)["epoch"] == 2

    restored = make_model(topk=False)
    backup = BackupAndRestore(tmp_path, delete_checkpoint=False)
    fit(restored, digits, backup, epochs=2)  # restore only
    assert backup.restored_epoch == 2
    for x, y in zip(restored.get_weights(), after_epoch_2, strict=True):
        np.testing.assert_array_equal(x, y)


def _record_file_operations(monkeypatch):
    """Wrap os.fsync, os.replace and os.remove to log, in order, what each one touched:
    ("fsync", "dir" or "file", inode), ("replace", inode of the source, name of the target), ("remove", name)."""
    events, real_fsync, real_replace, real_remove = [], os.fsync, os.replace, os.remove

    def fsync(fd):
        info = os.fstat(fd)
        events.append(("fsync", "dir" if stat.S_ISDIR(info.st_mode) else "file", info.st_ino))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino, os.path.basename(dst)))
        return real_replace(src, dst)

    def remove(path):
        events.append(("remove", os.path.basename(path)))
        return real_remove(path)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "remove", remove)
    return events


def test_a_commit_syncs_each_file_before_its_rename_and_the_directory_after(digits, tmp_path, monkeypatch):
    # A rename is on disk only once its directory is synced: the weights' rename
    # must be before the metadata that names them, and the commit before the
    # previous weights are deleted.
    events = _record_file_operations(monkeypatch)
    fit(make_model(topk=False), digits, BackupAndRestore(tmp_path, delete_checkpoint=False), epochs=2)
    monkeypatch.undo()
    directory = os.stat(tmp_path).st_ino
    weights = os.stat(tmp_path / "backup-epoch2-batch0.weights.h5").st_ino  # a rename keeps the inode
    metadata = os.stat(tmp_path / METADATA_NAME).st_ino
    assert len(events) == 13  # the first commit, as the second
    assert events[-7:] == [
        ("fsync", "file", weights), ("replace", weights, "backup-epoch2-batch0.weights.h5"),
        ("fsync", "dir", directory),
        ("fsync", "file", metadata), ("replace", metadata, METADATA_NAME),
        ("fsync", "dir", directory),
        ("remove", "backup-epoch1-batch0.weights.h5"),
    ]


def test_a_directory_that_cannot_be_synced_still_gets_the_backup(digits, tmp_path, monkeypatch):
    real_fsync = os.fsync

    def fsync(fd):  # as on file systems whose directories refuse fsync
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(22, "Invalid argument")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    fit(make_model(topk=False), digits, BackupAndRestore(tmp_path, delete_checkpoint=False), epochs=1)
    assert sorted(os.listdir(tmp_path)) == ["backup-epoch1-batch0.weights.h5", METADATA_NAME]
    assert load_json(tmp_path / METADATA_NAME)["epoch"] == 1


def test_delete_checkpoint_keeps_files_that_are_not_its_own(digits, tmp_path):
    kept, deleted = tmp_path / "kept", tmp_path / "deleted"
    fit(make_model(topk=False), digits, BackupAndRestore(kept, delete_checkpoint=False), epochs=3)
    assert sorted(os.listdir(kept)) == ["backup-epoch3-batch0.weights.h5", METADATA_NAME]  # older ones removed
    deleted.mkdir()
    (deleted / "notes.txt").write_text("not a backup")
    fit(make_model(topk=False), digits, BackupAndRestore(deleted), epochs=2)
    assert os.listdir(deleted) == ["notes.txt"]


@pytest.mark.slow
def test_digits_example_backs_up_and_cleans_up(tmp_path):
    backup_dir = tmp_path / "backup"
    env = {**os.environ, **worker_env()}
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([*PYTHON, str(REPO_ROOT / "examples" / "digits_fit.py"), "--dense", "--epochs", "2",
                           "--verbose", "0", "--backup-dir", str(backup_dir), "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test accuracy" in proc.stdout
    assert not backup_dir.exists()


# -- two workers ---------------------------------------------------------------


def _attempt(out, attempt, worker):
    return load_json(out / f"attempt{attempt}_worker{worker}.json")


def _kill_worker_1_mid_epoch_3(tmp_path, *options):
    """2 workers, one shared backup dir, --restarts 1; worker 1 SIGKILLed before
    batch 4 of epoch 3 (index 2). Returns (launcher stdout, out dir)."""
    out, backup_dir, worker_tmp = tmp_path / "out", tmp_path / "backup", tmp_path / "worker_tmp"
    out.mkdir()
    worker_tmp.mkdir()
    proc = subprocess.Popen(
        [*LAUNCH_CLI, "--workers", "2", "--restarts", "1", "--timeout", "110",
         str(FORKSERVER), str(REPO_ROOT / "tests" / "workers" / "backup_fit.py"), "--backup-dir", str(backup_dir), "--out", str(out),
         "--epochs", str(EPOCHS), "--pause-at", "2:4", *options],
        cwd=REPO_ROOT, env={**os.environ, **worker_env(TMPDIR=str(worker_tmp))}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 100
        while not (out / "paused").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "worker 1 never reached epoch 3"
            time.sleep(0.05)
        os.kill(int((out / "paused").read_text()), signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=110)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_recorded_workers(out)
    assert proc.returncode == 0, stdout[-5000:]
    assert not backup_dir.exists()  # deleted after the successful attempt
    assert [n for n in os.listdir(worker_tmp) if n.startswith("tf_topk_backup_")] == []  # worker 1 removed its own
    return stdout, out




_KILLED_RUNS = {  # options of backup_fit.py, and the (epoch, batch) the restarted workers resume at
    "dense-every-3-batches": (("--dense", "--save-freq", "3"), (2, 2)),
    "topk-every-epoch": (("--save-freq", "epoch"), (2, 0)),
    "momentum-correction-every-3-batches": (("--momentum-correction", "--save-freq", "3"), (2, 2)),
}


@pytest.mark.slow  # 2 TensorFlow workers, twice, plus an uninterrupted run: ~65 s on 2 cores
@pytest.mark.parametrize("run", list(_KILLED_RUNS))
def test_worker_killed_mid_epoch_resumes_from_the_shared_backup(run, tmp_path):
    options, resume_at = _KILLED_RUNS[run]
    stdout, out = _kill_worker_1_mid_epoch_3(tmp_path, *options)
    assert "[launch] worker 1 exited with -9 (SIGKILL); restarting all workers, attempt 2 of 2" in stdout
    for worker in (0, 1):
        first, second = _attempt(out, 0, worker), _attempt(out, 1, worker)
        assert first["restored_epoch"] is None and first["epochs"] == [0, 1, 2]
        # Resumed from the last backup: the end of epoch 2 (index 1), or batch 2 of
        # epoch 3 (every 3 batches: 3, 6 | 1, 4, 7 | 2); nothing before it is redone.
        assert (second["restored_epoch"], second["restored_batch"]) == resume_at
        assert second["epochs"] == [2, 3, 4, 5]
        assert second["iterations"] == EPOCHS * SAMPLES // BATCH
        assert not launch.pid_alive(first["pid"]) and not launch.pid_alive(second["pid"])
    resumed = [load_weights(out / f"worker{i}.npz") for i in (0, 1)]
    for a, b in zip(*resumed, strict=True):
        np.testing.assert_array_equal(a, b)  # the workers agree, bitwise

    reference_out, reference_backup = tmp_path / "reference", tmp_path / "reference_backup"
    reference_out.mkdir()
    assert_ok(run_script("backup_fit.py", "--backup-dir", reference_backup, "--out", reference_out,
                         "--epochs", EPOCHS, "--keep", *options, stream=io.StringIO()))
    # Bitwise the uninterrupted run: the weights and, with TopKOptimizer, each
    # worker's own residuals (and velocities), which the backup gave back to it.
    for a, b in zip(resumed[0], load_weights(reference_out / "worker0.npz"), strict=True):
        np.testing.assert_array_equal(a, b)
    if "--dense" in options:
        return
    states = [load_weights(out / f"worker{i}_state.npz") for i in (0, 1)]
    reference_states = [load_weights(reference_out / f"worker{i}_state.npz") for i in (0, 1)]
    assert len(states[0]) == (5 if "--momentum-correction" in options else 1)  # residual (+ 4 velocities)
    assert not np.array_equal(states[0][0], states[1][0])  # residuals differ between the workers
    for resumed_state, reference_state in zip(states, reference_states, strict=True):
        for a, b in zip(resumed_state, reference_state, strict=True):
            np.testing.assert_array_equal(a, b)
    _assert_backup_holds_each_workers_state(reference_backup, reference_states)


def _assert_backup_holds_each_workers_state(backup_dir, states):
    """The kept backup (taken after the last batch) stores each per-replica
    state variable as [worker 0's value, worker 1's value]."""
    import h5py

    with h5py.File(backup_dir / load_json(backup_dir / METADATA_NAME)["weights"], "r") as f:
        saved = [f["optimizer/vars"][key][()] for key in f["optimizer/vars"]]
    for worker0, worker1 in zip(*states, strict=True):
        stacked = np.stack([worker0, worker1])
        assert any(a.shape == stacked.shape and np.array_equal(a, stacked) for a in saved), stacked.shape


@pytest.mark.slow  # a 1-process run, then 2 TensorFlow workers: ~20 s on 2 cores
def test_workers_that_see_different_backups_refuse_to_train(tmp_path):
    env = {**os.environ, **worker_env()}
    env.pop("TF_CONFIG", None)
    seeded = subprocess.run([*PYTHON, str(REPO_ROOT / "tests" / "workers" / "backup_fit.py"), "--dense",
                             "--backup-dir", str(tmp_path / "chief"), "--out", str(tmp_path), "--fail-at", "1:0"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert seeded.returncode != 0 and "failing on purpose" in seeded.stderr
    assert load_json(tmp_path / "chief" / METADATA_NAME)["epoch"] == 1
    # Worker 1 is given a directory of its own: it cannot see the chief's backup.
    result = run_script("backup_fit.py", "--dense", "--backup-dir", tmp_path / "chief",
                        "--backup-dir-worker1", tmp_path / "elsewhere", "--out", tmp_path, stream=io.StringIO())
    assert not result.ok and not result.timed_out
    outputs = "".join(result.outputs)  # the first worker to fail stops the other, perhaps before it prints
    assert "the workers did not restore the same backup" in outputs, result.format_failure()
    assert "replica 0: epoch 1 batch 0, replica 1: no backup" in outputs
