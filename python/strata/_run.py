"""strata.train and strata.estimate: the CLI's runs from Python, on a config file's path or a
dict, with overrides as `strata train --set` takes them (dotted keys through a dict:
strata.train(cfg, max_steps=10, **{"optimizer.lr": 1e-4}))."""

import json
import os
import queue
import threading

from . import _core


def _config(config):
    if isinstance(config, dict):
        return json.dumps(config), False
    if isinstance(config, (str, os.PathLike)):
        return os.fspath(config), True
    raise TypeError(f"config: expected a path or a dict, got {type(config).__name__}")


def _overrides(overrides):
    return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]


def train(config, *, resume=None, progress=True, on_step=None, **overrides):
    """Trains as `strata train CONFIG --set key=value ...` does and returns every step's
    metrics record (the dicts metrics_file holds). on_step(record), when given, sees each step's
    record as it ends; returning True stops the run there, which saves a checkpoint first.
    Ctrl-C does the same, then raises KeyboardInterrupt. Errors: ValueError for a config
    Strata refuses (the message names the key), RuntimeError for a run that fails."""
    text, is_path = _config(config)
    hook = None
    if on_step is not None:
        hook = lambda record: bool(on_step(json.loads(record)))  # noqa: E731
    records = _core.train(config=text, is_path=is_path, overrides=_overrides(overrides),
                          resume=os.fspath(resume) if resume else "", progress=progress,
                          on_step=hook)
    return [json.loads(r) for r in records]


def train_steps(config, *, resume=None, progress=False, **overrides):
    """train() as a generator: yields each step's metrics record as the step ends (the run goes
    on in a thread meanwhile). Leaving the loop early (break, an exception, Ctrl-C) stops the
    run after its current step, with a checkpoint, before the generator closes."""
    records = queue.Queue()
    stop = threading.Event()
    failure = []
    done = object()

    def hook(record):
        records.put(record)
        return stop.is_set()

    def run():
        try:
            train(config, resume=resume, progress=progress, on_step=hook, **overrides)
        except BaseException as e:  # handed to the consumer
            failure.append(e)
        finally:
            records.put(done)

    thread = threading.Thread(target=run, name="strata.train", daemon=True)
    thread.start()
    try:
        while True:
            record = records.get()
            if record is done:
                break
            yield record
    finally:
        stop.set()
        while thread.is_alive():
            thread.join(0.1)
    if failure:
        raise failure[0]


def estimate(config, *, ranks=1, gpu=None, **overrides):
    """`strata estimate CONFIG --json` as a dict: the plan, the budgets ("fits": true), the
    predicted step and the rates; a plan that cannot run is {"fits": false, "error": ...}.
    ValueError for a config Strata refuses."""
    text, is_path = _config(config)
    return json.loads(_core.estimate(config=text, is_path=is_path, overrides=_overrides(overrides),
                                     ranks=ranks, gpu=gpu or ""))
