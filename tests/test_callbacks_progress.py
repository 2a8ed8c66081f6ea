"""Callbacks (Keras semantics) and progress bars (terminal vs captured output)."""

import io

import jax.numpy as jnp
import numpy as np
import pytest

from jstrategy import callbacks
from jstrategy import metrics
from jstrategy._src.training.callbacks.progress import Progbar
from jstrategy._src.training.callbacks.progress import resolve_verbose


class FakeModel:
    """What the callbacks need from jstrategy.Model: weights, a learning rate, a stop flag."""

    def __init__(self, learning_rate=0.1, metrics_=()):
        self.stop_training = False
        self.weights = [np.zeros(2)]
        self._lr = learning_rate
        self.metrics = list(metrics_)

    def get_weights(self):
        return [w.copy() for w in self.weights]

    def set_weights(self, weights):
        self.weights = [np.array(w) for w in weights]

    @property
    def learning_rate(self):
        return self._lr

    @learning_rate.setter
    def learning_rate(self, value):
        self._lr = value


class Terminal(io.StringIO):
    def isatty(self):
        return True


class Recorder(callbacks.Callback):
    def __init__(self, tag, journal):
        super().__init__()
        self.tag = tag
        self.journal = journal

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name.startswith("on_") and name not in ("on_batch_begin", "on_batch_end"):

            def record(*args):
                self.journal.append((self.tag, name, args))
                return attr(*args)

            return record
        return attr


HOOK_CALLS = [
    ("on_train_begin", ()),
    ("on_epoch_begin", (0,)),
    ("on_train_batch_begin", (0,)),
    ("on_train_batch_end", (0,)),
    ("on_test_begin", ()),
    ("on_test_batch_begin", (0,)),
    ("on_test_batch_end", (0,)),
    ("on_test_end", ()),
    ("on_epoch_end", (0,)),
    ("on_train_end", ()),
    ("on_predict_begin", ()),
    ("on_predict_batch_begin", (0,)),
    ("on_predict_batch_end", (0,)),
    ("on_predict_end", ()),
]


def _run_epochs(cbs, values, monitor="val_loss"):
    """Drives the epoch hooks as fit does, stopping when a callback asks to."""
    cbs.on_train_begin()
    epoch = -1
    for epoch, value in enumerate(values):
        cbs.on_epoch_begin(epoch)
        cbs.model.weights = [np.full(2, float(epoch))]
        cbs.on_epoch_end(epoch, {monitor: value})
        if cbs.model.stop_training:
            break
    cbs.on_train_end()
    return epoch


# --------------------------------------------------------------------------- CallbackList


def test_callback_list_dispatches_every_hook_in_order_with_one_logs_dict():
    journal = []
    cbs = callbacks.CallbackList([Recorder("a", journal), Recorder("b", journal)])
    for hook, args in HOOK_CALLS:
        logs = {"loss": 1.0}
        getattr(cbs, hook)(*args, logs)
        a, b = journal[-2:]
        assert (a[0], a[1], b[0], b[1]) == ("a", hook, "b", hook)
        assert a[2][:-1] == args and a[2][-1] is logs and b[2][-1] is logs
    assert len(journal) == 2 * len(HOOK_CALLS)


def test_batch_aliases_reach_on_batch_hooks():
    seen = []
    cb = callbacks.LambdaCallback(on_batch_end=lambda batch, logs: seen.append(batch))
    cbs = callbacks.CallbackList([cb])
    cbs.on_train_batch_end(3, {})
    cbs.on_batch_end(4, {})
    assert seen == [3, 4]


def test_callback_list_adds_history_and_progbar_last_and_sets_model_and_params():
    model = FakeModel()
    user = callbacks.LambdaCallback()
    cbs = callbacks.CallbackList(
        [user], model=model, add_history=True, add_progbar=True, verbose=0, epochs=3, steps=7
    )
    kinds = [type(cb) for cb in cbs]
    assert kinds == [callbacks.LambdaCallback, callbacks.History, callbacks.ProgbarLogger]
    assert cbs.history is cbs.callbacks[1]
    for cb in cbs:
        assert cb.model is model
        assert cb.params == {"verbose": 0, "epochs": 3, "steps": 7}

    history = callbacks.History()
    again = callbacks.CallbackList([history], add_history=True, add_progbar=False)
    assert again.callbacks == [history] and again.history is history


def test_keys_added_to_epoch_logs_reach_history():
    model = FakeModel(learning_rate=0.5)
    sched = callbacks.LearningRateScheduler(lambda epoch: 0.5 / (epoch + 1))
    cbs = callbacks.CallbackList([sched], model=model, add_history=True, epochs=2)
    cbs.on_train_begin()
    for epoch in range(2):
        cbs.on_epoch_begin(epoch)
        cbs.on_epoch_end(epoch, {"loss": 1.0 - epoch})
    assert cbs.history.history == {"loss": [1.0, 0.0], "learning_rate": [0.5, 0.25]}
    assert cbs.history.epoch == [0, 1]
    assert model.history is cbs.history


def test_callback_list_rejects_non_callbacks():
    with pytest.raises(ValueError, match="must be a jstrategy.callbacks.Callback"):
        callbacks.CallbackList([lambda epoch, logs: None])


def test_lambda_callback_validates_hook_names():
    with pytest.raises(ValueError, match="Unknown hook 'on_epoch_finish'"):
        callbacks.LambdaCallback(on_epoch_finish=print)
    with pytest.raises(ValueError, match="must be callable"):
        callbacks.LambdaCallback(on_train_end=3)


# --------------------------------------------------------------------------- EarlyStopping


@pytest.mark.parametrize(
    "patience,values,stopped",
    [
        (0, [1.0, 0.9, 0.95, 0.8], 2),
        (1, [1.0, 0.9, 0.95, 0.96, 0.5], 2),
        (2, [1.0, 0.9, 0.95, 0.85, 0.9, 0.91, 0.92], 5),
        (1, [1.0, 0.9, 0.8, 0.7], 3),  # never stops
    ],
)
def test_early_stopping_waits_patience_epochs_without_improvement(patience, values, stopped):
    model = FakeModel()
    stopper = callbacks.EarlyStopping(patience=patience)
    cbs = callbacks.CallbackList([stopper], model=model)
    assert _run_epochs(cbs, values) == stopped
    assert model.stop_training is (stopped < len(values) - 1)
    assert stopper.best == min(values[: stopped + 1])


def test_early_stopping_min_delta_and_max_mode_from_accuracy_name():
    stopper = callbacks.EarlyStopping(monitor="val_accuracy", min_delta=0.05, patience=2)
    cbs = callbacks.CallbackList([stopper], model=FakeModel())
    # +0.01 and +0.02 are below min_delta, so they do not count as improvements.
    assert _run_epochs(cbs, [0.5, 0.51, 0.52, 0.9], monitor="val_accuracy") == 2
    assert stopper.best == 0.5


def test_early_stopping_auto_mode_reads_metric_direction_from_the_model():
    score = metrics.MeanMetricWrapper(lambda y, p: p, name="score", direction="up")
    stopper = callbacks.EarlyStopping(monitor="val_score")
    cbs = callbacks.CallbackList([stopper], model=FakeModel(metrics_=[score]))
    assert _run_epochs(cbs, [1.0, 2.0, 1.5], monitor="val_score") == 2

    unknown = callbacks.EarlyStopping(monitor="val_score")
    cbs = callbacks.CallbackList([unknown], model=FakeModel())
    with pytest.raises(ValueError, match="mode='max'"):
        _run_epochs(cbs, [1.0], monitor="val_score")


def test_early_stopping_baseline_keeps_patience_running_until_beaten():
    values = [0.9, 0.8, 0.85, 0.86, 0.87]
    plain = callbacks.EarlyStopping(monitor="loss", patience=2)
    cbs = callbacks.CallbackList([plain], model=FakeModel())
    assert _run_epochs(cbs, values, monitor="loss") == 3
    # Improvements that do not beat the baseline do not reset the wait.
    stopper = callbacks.EarlyStopping(monitor="loss", patience=2, baseline=0.5)
    cbs = callbacks.CallbackList([stopper], model=FakeModel())
    assert _run_epochs(cbs, values, monitor="loss") == 2


def test_early_stopping_start_from_epoch_ignores_warmup():
    stopper = callbacks.EarlyStopping(monitor="loss", start_from_epoch=2)
    cbs = callbacks.CallbackList([stopper], model=FakeModel())
    assert _run_epochs(cbs, [0.1, 5.0, 1.0, 0.9, 2.0], monitor="loss") == 4
    assert stopper.best == 0.9


def test_early_stopping_restores_best_weights_and_reports(capsys):
    model = FakeModel()
    stopper = callbacks.EarlyStopping(patience=1, restore_best_weights=True, verbose=1)
    cbs = callbacks.CallbackList([stopper], model=model)
    assert _run_epochs(cbs, [1.0, 0.7, 0.8, 0.9]) == 2
    np.testing.assert_array_equal(model.weights[0], np.full(2, 1.0))
    out = capsys.readouterr().out
    assert "Epoch 3: early stopping" in out
    assert "best epoch: 2." in out


def test_early_stopping_restores_best_weights_even_without_stopping():
    model = FakeModel()
    stopper = callbacks.EarlyStopping(patience=5, restore_best_weights=True)
    cbs = callbacks.CallbackList([stopper], model=model)
    _run_epochs(cbs, [1.0, 0.5, 0.9])
    assert not model.stop_training
    np.testing.assert_array_equal(model.weights[0], np.full(2, 1.0))


def test_early_stopping_accepts_device_scalars_and_warns_on_missing_key():
    stopper = callbacks.EarlyStopping(monitor="loss")
    stopper.set_model(FakeModel())
    stopper.on_train_begin()
    stopper.on_epoch_end(0, {"loss": jnp.float32(0.25)})
    assert stopper.best == 0.25
    with pytest.warns(RuntimeWarning, match=r"'val_loss', which is not in the logs.*\['loss'\]"):
        callbacks.EarlyStopping().on_epoch_end(0, {"loss": 1.0})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mode": "maximum"}, "`mode` must be one of"),
        ({"patience": -1}, "`patience` must be a non-negative int"),
        ({"monitor": ""}, "`monitor`"),
        ({"baseline": "low"}, "`baseline`"),
    ],
)
def test_early_stopping_validates_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        callbacks.EarlyStopping(**kwargs)


def test_early_stopping_mode_enum_is_accepted():
    stopper = callbacks.EarlyStopping(monitor="val_score", mode=callbacks.Mode.MAX, patience=0)
    cbs = callbacks.CallbackList([stopper], model=FakeModel())
    assert _run_epochs(cbs, [1.0, 0.5], monitor="val_score") == 1


# --------------------------------------------------------------------------- LearningRateScheduler


def test_learning_rate_scheduler_one_and_two_argument_schedules(capsys):
    model = FakeModel(learning_rate=1.0)
    seen = []

    def halve(epoch, lr):
        seen.append((epoch, lr))
        return lr / 2

    for sched, expected in (
        (callbacks.LearningRateScheduler(halve, verbose=1), [0.5, 0.25, 0.125]),
        (callbacks.LearningRateScheduler(lambda epoch: 0.1 * (epoch + 1)), [0.1, 0.2, 0.3]),
    ):
        model.learning_rate = 1.0
        sched.set_model(model)
        rates = []
        for epoch in range(3):
            logs = {}
            sched.on_epoch_begin(epoch, logs)
            sched.on_epoch_end(epoch, logs)
            rates.append(logs["learning_rate"])
        np.testing.assert_allclose(rates, expected)
    assert seen == [(0, 1.0), (1, 0.5), (2, 0.25)]
    assert (
        "Epoch 2: LearningRateScheduler setting learning rate to 0.25." in capsys.readouterr().out
    )


def test_learning_rate_scheduler_errors():
    with pytest.raises(ValueError, match="`schedule` must be callable"):
        callbacks.LearningRateScheduler(0.1)
    sched = callbacks.LearningRateScheduler(lambda epoch: "fast")
    sched.set_model(FakeModel())
    with pytest.raises(ValueError, match="non-negative finite float; at epoch 0"):
        sched.on_epoch_begin(0)
    sched.set_model(object())
    with pytest.raises(ValueError, match=r"needs `model.learning_rate`"):
        sched.on_epoch_begin(0)

    def broken(epoch, lr):
        raise TypeError("bug inside the schedule")

    # Unlike Keras's try/except fallback, a TypeError raised by the schedule is not masked.
    sched = callbacks.LearningRateScheduler(broken)
    sched.set_model(FakeModel())
    with pytest.raises(TypeError, match="bug inside the schedule"):
        sched.on_epoch_begin(0)


# --------------------------------------------------------------------------- Progbar


def test_resolve_verbose():
    assert resolve_verbose("auto", Terminal()) == 1
    assert resolve_verbose("auto", io.StringIO()) == 2
    assert [resolve_verbose(v) for v in (0, 1, 2)] == [0, 1, 2]
    with pytest.raises(ValueError, match='must be 0, 1, 2 or "auto"'):
        resolve_verbose(3)


def test_progbar_in_a_terminal_redraws_in_place_with_eta():
    out = Terminal()
    bar = Progbar(4, file=out, interval=0)
    for step in range(1, 5):
        bar.update(step, [("loss", float(step))])
    text = out.getvalue()
    frames = text.split("\r")[1:]
    assert len(frames) == 4 and text.count("\n") == 1 and text.endswith("\n")
    assert frames[0].startswith("1/4 [" + "=" * 6 + ">" + "." * 23 + "] - ETA: ")
    assert frames[-1].startswith("4/4 [==============================] - ")
    assert "step - loss: 2.5000" in frames[-1]  # mean of 1, 2, 3, 4


def test_progbar_throttles_redraws_by_interval():
    out = Terminal()
    bar = Progbar(50, file=out, interval=3600)
    for step in range(1, 51):
        bar.update(step)
    assert out.getvalue().count("\r") == 2  # the first draw and the final one


def test_progbar_outside_a_terminal_prints_one_line_without_carriage_returns():
    out = io.StringIO()
    bar = Progbar(20, file=out, interval=0)
    for step in range(1, 21):
        bar.update(step, {"loss": 0.5})
    text = out.getvalue()
    assert "\r" not in text
    assert text.count("\n") == 1
    assert text.startswith("20/20 [==============================] - ")


def test_progbar_outside_a_terminal_prints_periodic_lines_for_long_runs():
    out = io.StringIO()
    bar = Progbar(3, file=out)
    bar.non_tty_interval = 0.0
    for step in range(1, 4):
        bar.update(step)
    lines = out.getvalue().splitlines()
    assert [line.split(" ")[0] for line in lines] == ["1/3", "2/3", "3/3"]
    assert "\r" not in out.getvalue()


def test_progbar_verbose_two_prints_a_summary_line_and_zero_is_silent():
    out = io.StringIO()
    bar = Progbar(5, file=out, verbose=2)
    bar.add(2, [("acc", 0.5)])
    bar.add(3, [("acc", 1.0)])
    line = out.getvalue()
    assert line.count("\n") == 1 and "[" not in line
    assert line.startswith("5/5 - ") and "/step - acc: 0.8000" in line  # (2*.5 + 3*1) / 5

    quiet = io.StringIO()
    bar = Progbar(5, file=quiet, verbose=0)
    bar.update(5, [("acc", 1.0)])
    assert quiet.getvalue() == ""


def test_progbar_stateful_metrics_are_shown_as_given_and_may_be_device_values():
    out = io.StringIO()
    bar = Progbar(2, file=out, stateful_metrics=["loss"])
    bar.update(1, [("loss", jnp.float32(4.0)), ("lr", 1e-5)])
    bar.update(2, [("loss", jnp.float32(2.0)), ("lr", 1e-5), ("note", "ok")])
    assert out.getvalue().rstrip().endswith("loss: 2.0000 - lr: 1.0000e-05 - note: ok")


def test_progbar_with_unknown_target():
    out = Terminal()
    bar = Progbar(None, file=out, interval=0)
    bar.update(3)
    bar.update(5, finalize=True)
    frames = out.getvalue().split("\r")[1:]
    assert frames[0].startswith("      3/Unknown")
    assert frames[1].startswith("      5/Unknown") and frames[1].endswith("\n")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"target": -1}, "`target`"),
        ({"target": 3, "width": 0}, "`width`"),
        ({"target": 3, "interval": -1.0}, "`interval`"),
        ({"target": 3, "verbose": "loud"}, "`verbose`"),
    ],
)
def test_progbar_validates_arguments(kwargs, match):
    target = kwargs.pop("target")
    with pytest.raises(ValueError, match=match):
        Progbar(target, **kwargs)


# --------------------------------------------------------------------------- ProgbarLogger


def _fit_like(cbs, epochs, steps, validate=True):
    cbs.on_train_begin()
    for epoch in range(epochs):
        cbs.on_epoch_begin(epoch)
        for batch in range(steps):
            cbs.on_train_batch_begin(batch)
            cbs.on_train_batch_end(batch, {"loss": 1.0 / (batch + 1)})
        logs = {"loss": 0.5}
        if validate:
            cbs.on_test_begin()
            for batch in range(2):
                cbs.on_test_batch_end(batch, {"loss": 9.0})
            cbs.on_test_end({"loss": 0.25})
            logs["val_loss"] = 0.25
        cbs.on_epoch_end(epoch, logs)
    cbs.on_train_end(logs)


@pytest.mark.parametrize("verbose", [1, 2, "auto"])
def test_progbar_logger_in_captured_output_prints_one_line_per_epoch(verbose):
    out = io.StringIO()
    logger = callbacks.ProgbarLogger(file=out)
    cbs = callbacks.CallbackList([logger], verbose=verbose, epochs=2, steps=3)
    _fit_like(cbs, epochs=2, steps=3)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0] == "Epoch 1/2" and lines[2] == "Epoch 2/2" and len(lines) == 4
    for line in lines[1::2]:
        assert line.startswith("3/3")
        assert line.endswith(" - loss: 0.5000 - val_loss: 0.2500")
        assert ("[" in line) is (verbose == 1)


def test_progbar_logger_in_a_terminal_shows_running_logs_per_batch():
    out = Terminal()
    logger = callbacks.ProgbarLogger(file=out)
    cbs = callbacks.CallbackList([logger], verbose=1, epochs=1, steps=3)
    _fit_like(cbs, epochs=1, steps=3, validate=False)
    text = out.getvalue()
    assert "Epoch" not in text  # Keras prints no header for a single epoch
    assert text.count("\n") == 1
    # Batch logs are running averages already: shown as given, not re-averaged.
    assert "\r1/3 [" in text and "loss: 1.0000" in text


def test_progbar_logger_silent_with_verbose_zero():
    out = io.StringIO()
    cbs = callbacks.CallbackList([callbacks.ProgbarLogger(file=out)], verbose=0, epochs=2, steps=3)
    _fit_like(cbs, epochs=2, steps=3)
    assert out.getvalue() == ""


def test_progbar_logger_for_evaluate_and_predict_with_unknown_steps():
    out = io.StringIO()
    cbs = callbacks.CallbackList([callbacks.ProgbarLogger(file=out)], verbose=1, steps=None)
    cbs.on_test_begin()
    for batch in range(4):
        cbs.on_test_batch_end(batch, {"loss": 2.0})
    cbs.on_test_end({"loss": 2.0, "accuracy": 0.75})
    cbs.on_predict_begin()
    for batch in range(2):
        cbs.on_predict_batch_end(batch, {"outputs": np.zeros(3)})
    cbs.on_predict_end()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("4/4 [====") and lines[0].endswith("loss: 2.0000 - accuracy: 0.7500")
    assert lines[1].startswith("2/2 [====") and "outputs" not in lines[1]
