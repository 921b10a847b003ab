"""BackupAndRestore for `model.fit` that works under MultiWorkerMirroredStrategy.

Keras 3's `keras.callbacks.BackupAndRestore` is written for one process: every
worker saves `latest.weights.h5` and `training_metadata.json` into
`backup_dir` and deletes the whole directory at the end. Under
MultiWorkerMirroredStrategy (MWMS) with one shared directory, as in
TensorFlow's multi-worker tutorial, the workers write the same HDF5 file at
once, the file lock fails and the job dies; with one directory per worker,
each worker would restore its own copy. It also writes the weights and the
epoch number as two plain files, so a process killed between the two (or in
the middle of the HDF5 file) leaves a backup that resumes at the wrong epoch
or does not load. And with `save_freq=<batches>` it resumes at the start of
the interrupted epoch, training again on batches whose updates the restored
weights already hold.

This callback keeps Keras's behaviour and arguments (`backup_dir`,
`save_freq`, `delete_checkpoint`) and changes what is needed:

* one `backup_dir`, the same on every worker, on a file system all workers
  see. The chief (worker 0 of TF_CONFIG, the "chief" task if there is one, or
  the only process) writes the backup there. The other workers save too,
  since reading per-replica (ON_READ) state such as TopKOptimizer's residuals
  is a collective that every worker must join, into a temporary directory of
  their own that they delete at once.
* at train begin every worker restores the chief's backup, and the workers
  check with one collective that they all restored the same one (a worker
  that cannot see the chief's files would otherwise train from scratch
  beside the others).
* a backup is committed atomically: the weights go to a temporary file that
  is renamed to its final name, then `training_metadata.json`, which names
  the weights file and the epoch and batch to resume at, is written the same
  way. A worker killed at any moment leaves the previous backup or the new
  one, never a mix; the previous weights file is deleted only after.
  Each file is synced to disk before its rename and the directory after it,
  so a power loss cannot undo a commit or leave metadata naming lost weights.
* with `save_freq=N` batches, training resumes at the batch after the backup:
  the batches of the interrupted epoch that were already trained on are
  drawn from the dataset and skipped, not trained on again. A backup at an
  epoch's last batch resumes at the next epoch; when the epoch's length is
  unknown (a generator, `dataset.filter`), only the epoch's end shows that the
  batch was its last, and the backup is taken again there.

The saved state is Keras's `model.save_weights` file: the model's weights
and every optimizer variable, TopKOptimizer's residuals and velocities
included. Those are per-replica (ON_READ) variables; TopKOptimizer stores
every replica's value of them (`tf_topk.replica_state`), so a job restarted
with the same number of workers gives each worker its own state back and
resumes bitwise as if never stopped; with another number, each gets
sum / replicas.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid

import keras
import tensorflow as tf

__all__ = ["BackupAndRestore"]

METADATA_NAME = "training_metadata.json"  # the commit point of a backup (Keras's name)
_WEIGHTS_PREFIX = "backup-"
_TEMP_PREFIX = ".tmp-"


def _replace_durably(src: str, dst: str) -> None:
    """os.replace that survives a power loss: the file's data is synced before
    the rename, and the directory, which holds the rename, after it.

    A directory that cannot be opened or synced (Windows, some network file
    systems) is skipped: the rename is still atomic, only not known to be on disk.
    """
    with open(src, "r+b") as f:
        os.fsync(f.fileno())
    os.replace(src, dst)
    try:
        fd = os.open(os.path.dirname(dst) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_multi_worker(strategy) -> bool:
    """MWMS spanning more than one worker (the test Keras and MWMS use themselves)."""
    in_multi_worker_mode = getattr(strategy.extended, "_in_multi_worker_mode", None)
    return bool(in_multi_worker_mode and in_multi_worker_mode())


def _worker_name(strategy) -> str:
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is not None and resolver.task_type:
        return f"{resolver.task_type}{resolver.task_id}"
    return "worker"


class BackupAndRestore(keras.callbacks.Callback):
    """Back up the training state, and resume from it after a failure, on one or many workers.

    Args:
      backup_dir: a directory only this training run uses, the same path on
        every worker, on a file system that every worker sees (local disk for
        one machine, NFS or another shared mount for several). Files are
        renamed into place, so object stores without an atomic rename
        (`gs://`, `s3://`) are refused.
      save_freq: "epoch" (default): back up at the end of each epoch. An int
        N: back up every N batches; training then resumes at the batch after
        the last backup (the next epoch's first, for a backup at an epoch's
        last batch), skipping the batches of that epoch already trained
        on (they are drawn from the dataset, so use a dataset that yields
        the same batches in the same order on every pass, e.g.
        `shuffle=False`, or the skipped batches differ from the trained ones).
        The metrics of a resumed epoch cover only the batches trained after
        the resume.
      delete_checkpoint: delete the backup when `fit` ends normally
        (default True, as Keras). A job restarted after that starts afresh.

    Keras's `double_checkpoint` has no counterpart: a backup replaces the
    previous one only once it is complete, so there is always one to load.

    Attributes, after train begin:
      restored_epoch, restored_batch: where training resumed (the epoch
        index `fit` starts at, and the batches of it that are skipped), or
        None when there was no backup.

    Example, the pattern of TensorFlow's multi-worker tutorial, run with
    ``python -m tf_topk.launch --workers 2 --restarts 3 train.py``::

        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = make_model()
            model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1)), loss=...)
        backup = tf_topk.keras.BackupAndRestore("/shared/run7/backup")
        model.fit(x, y, epochs=10, callbacks=[backup])  # a restarted job resumes here
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True):
        super().__init__()
        if not backup_dir or not isinstance(backup_dir, (str, os.PathLike)):
            raise ValueError(f"backup_dir must be a non-empty path, got {backup_dir!r}")
        backup_dir = os.fspath(backup_dir)
        if "://" in backup_dir:
            raise ValueError(
                f"backup_dir must be a path on a mounted file system, got {backup_dir!r}: backups are "
                "committed by an atomic rename, which object stores do not offer")
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int)
                                     or save_freq < 1):
            raise ValueError(f"save_freq must be 'epoch' or an int >= 1 (batches), got {save_freq!r}")
        self.backup_dir = backup_dir
        self.save_freq = save_freq
        self.delete_checkpoint = bool(delete_checkpoint)
        self.restored_epoch = None
        self.restored_batch = None
        self._epoch = 0
        self._batches_done = 0  # in the current epoch
        self._since_save = 0
        self._skip_until = 0  # batches of the resumed epoch already trained on
        self._skip_now = 0
        self._saved_at = None  # (epoch, batch) of this run's last backup
        self._original_train_function = None

    # -- where this worker stands ---------------------------------------------

    @property
    def _strategy(self):
        return self.model.distribute_strategy

    @property
    def _is_chief(self) -> bool:
        return bool(self._strategy.extended.should_checkpoint)

    @property
    def _metadata_path(self) -> str:
        return os.path.join(self.backup_dir, METADATA_NAME)

    # -- restore --------------------------------------------------------------

    def on_train_begin(self, logs=None):
        if not self.model.built:
            raise ValueError(
                "BackupAndRestore needs a built model before fit() (give it an Input, or call it on a "
                f"batch): {self.model.name} is not built")
        self._epoch = self._batches_done = self._since_save = 0
        self._saved_at = None
        metadata = self._read_metadata()
        epoch, batch = 0, 0
        if metadata is not None:
            epoch, batch = self._restore(metadata)
        if _is_multi_worker(self._strategy):
            self._check_workers_agree(metadata is not None, epoch, batch)
        if metadata is None:
            self.restored_epoch = self.restored_batch = None
            return
        self.restored_epoch, self.restored_batch = epoch, batch
        self.model._initial_epoch = epoch  # read by fit() right after on_train_begin
        self._skip_until = batch
        if batch:
            self._skip_trained_batches()

    def _read_metadata(self):
        try:
            with open(self._metadata_path) as f:
                metadata = json.load(f)
        except FileNotFoundError:
            return None
        missing = {"epoch", "batch", "weights"} - set(metadata)
        if missing:
            raise ValueError(f"{self._metadata_path} lacks {sorted(missing)}: it was not written by "
                             "tf_topk.keras.BackupAndRestore; backup_dir must be used by nothing else")
        return metadata

    def _restore(self, metadata):
        """Load the backup's weights and optimizer state; return (epoch, batch) to resume at."""
        path = os.path.join(self.backup_dir, metadata["weights"])
        if not os.path.exists(path):
            raise FileNotFoundError(f"{self._metadata_path} names {path}, which does not exist: was the "
                                    "backup directory changed by hand?")
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with self._strategy.scope():  # its variables must be mirrored like the model's
                optimizer.build(self.model.trainable_variables)
        self.model.load_weights(path)
        epoch, batch = int(metadata["epoch"]), int(metadata["batch"])
        steps = self.params.get("steps") if self.params else None
        if batch and steps and batch >= steps:  # the backup came at the epoch's last batch
            epoch, batch = epoch + 1, 0
        return epoch, batch

    def _check_workers_agree(self, restored, epoch, batch):
        """Every worker must resume from the same backup; a collective compares them."""
        strategy = self._strategy
        mine = tf.constant([[int(restored), epoch, batch]], dtype=tf.int64)

        @tf.function  # eager collectives under MWMS are slow and warn about it
        def gather_all():
            return strategy.gather(strategy.run(lambda: tf.identity(mine)), axis=0)

        everyone = gather_all().numpy()
        if (everyone != everyone[0]).any():
            seen = ", ".join(
                f"replica {i}: " + (f"epoch {e} batch {b}" if r else "no backup")
                for i, (r, e, b) in enumerate(everyone.tolist()))
            raise RuntimeError(
                f"the workers did not restore the same backup from backup_dir={self.backup_dir!r} ({seen}). "
                "backup_dir must be one directory that every worker sees (a shared file system), "
                "given identically to every worker")

    def _skip_trained_batches(self):
        """Wrap fit's train function so the resumed epoch's first `_skip_until`
        batches are drawn from the iterator but not trained on.

        fit() made the train function before on_train_begin and calls it with
        the epoch's iterator once per `steps_per_execution` batches; our
        on_train_batch_begin says how many batches the next call would take.
        """
        original = self.model.train_function
        self._original_train_function = original

        def train_function(iterator):
            if not self._skip_now:
                return original(iterator)
            for _ in range(self._skip_now):
                next(iterator)
            return {}

        self.model.train_function = train_function

    def on_train_batch_begin(self, batch, logs=None):
        if self._skip_until and batch < self._skip_until:
            steps_per_call = max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))
            self._skip_now = min(steps_per_call, self._skip_until - batch)
        else:
            self._skip_now = 0

    # -- save -----------------------------------------------------------------

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._batches_done = 0

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1  # `batch` is the last batch of this call (steps_per_execution)
        if done <= self._skip_until:  # a skipped call: already counted by the backup
            self._batches_done = done
            return
        self._since_save += done - self._batches_done
        self._batches_done = done
        if self.save_freq != "epoch" and self._since_save >= self.save_freq:
            self._save(self._epoch, done)

    def on_epoch_end(self, epoch, logs=None):
        if self._original_train_function is not None:  # the resumed epoch is over
            self.model.train_function = self._original_train_function
            self._original_train_function = None
        self._skip_until = 0
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)
        elif (self._saved_at == (epoch, self._batches_done) and not (self.params and self.params.get("steps"))
              and not self.model.stop_training):
            # The last backup came at this epoch's last batch, which the epoch's
            # length did not tell (_restore moves such a backup to the next epoch
            # when it does): without this, a resume would skip every batch of this
            # epoch and run it empty. Saved again rather than relabelled: a train
            # function that finds the data exhausted still counts an optimizer step.
            self._save(epoch + 1, 0)

    def _save(self, epoch, batch):
        """Save on every worker (a collective); only the chief's files are kept."""
        self._since_save = 0
        self._saved_at = (epoch, batch)
        chief = self._is_chief
        if chief:
            directory = self.backup_dir
            os.makedirs(directory, exist_ok=True)
        else:
            directory = tempfile.mkdtemp(prefix=f"tf_topk_backup_{_worker_name(self._strategy)}_")
        temp_path = os.path.join(directory, f"{_TEMP_PREFIX}{uuid.uuid4().hex}.weights.h5")
        try:
            self.model.save_weights(temp_path)
            if chief:
                self._commit(temp_path, epoch, batch)
        finally:
            if not chief:
                shutil.rmtree(directory, ignore_errors=True)
            elif os.path.exists(temp_path):  # the save failed before the rename
                os.remove(temp_path)

    def _commit(self, temp_path, epoch, batch):
        """Rename the weights into place, then point the metadata at them (the commit).

        Each rename is on disk before the next step: metadata must never name
        weights that a power loss could take back, and the previous weights
        are deleted only once the metadata that replaces them is.
        """
        name = f"{_WEIGHTS_PREFIX}epoch{epoch}-batch{batch}.weights.h5"
        _replace_durably(temp_path, os.path.join(self.backup_dir, name))
        metadata_temp = os.path.join(self.backup_dir, f"{_TEMP_PREFIX}{uuid.uuid4().hex}.json")
        with open(metadata_temp, "w") as f:
            json.dump({"epoch": epoch, "batch": batch, "weights": name}, f)
        _replace_durably(metadata_temp, self._metadata_path)
        self._remove_files(keep=name)

    def _remove_files(self, keep=None):
        """Delete this callback's files in backup_dir but `keep`: older weights, leftovers of killed saves."""
        for name in os.listdir(self.backup_dir):
            ours = name.startswith(_TEMP_PREFIX) or (name.startswith(_WEIGHTS_PREFIX) and name.endswith(".weights.h5"))
            if ours and name != keep:
                try:
                    os.remove(os.path.join(self.backup_dir, name))
                except FileNotFoundError:
                    pass

    # -- end --------------------------------------------------------------------

    def on_train_end(self, logs=None):
        if self._original_train_function is not None:
            self.model.train_function = self._original_train_function
            self._original_train_function = None
        self.model._initial_epoch = None  # a later fit() on this model starts where it is asked to
        if self.delete_checkpoint and self._is_chief and os.path.isdir(self.backup_dir):
            try:
                os.remove(self._metadata_path)  # first: without it, nothing is restored
            except FileNotFoundError:
                pass
            self._remove_files()
            try:
                os.rmdir(self.backup_dir)
            except OSError:  # not empty: files that are not ours stay
                pass
