"""Callbacks with Hugging Face's event names, and the handler that dispatches them."""

from __future__ import annotations

import logging
from typing import Any

from trainer_runtime.state import TrainerControl, TrainerState

__all__ = [
    "CallbackHandler",
    "DefaultFlowCallback",
    "PrinterCallback",
    "TrainerCallback",
]

logger = logging.getLogger(__name__)

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_substep_end",
    "on_step_end",
    "on_evaluate",
    "on_prediction_step",
    "on_predict",
    "on_save",
    "on_log",
    "on_push_begin",
)


class TrainerCallback:
    """Override the events you need. Each gets ``(args, state, control, **kwargs)``; kwargs hold
    ``model``, ``optimizer``, ``lr_scheduler``, ``train_dataloader`` and event-specific values
    (``logs`` for on_log, ``metrics`` for on_evaluate/on_predict, ``checkpoint`` for on_save).
    Returning a TrainerControl replaces the control object; returning None keeps it."""

    def on_init_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        pass

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        pass

    def on_train_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        pass

    def on_epoch_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        pass

    def on_epoch_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        pass

    def on_step_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        pass

    def on_pre_optimizer_step(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        pass

    def on_optimizer_step(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        pass

    def on_substep_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        pass

    def on_step_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        pass

    def on_evaluate(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        pass

    def on_predict(self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        pass

    def on_prediction_step(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        pass

    def on_save(self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        pass

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        pass

    def on_push_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        pass


class DefaultFlowCallback(TrainerCallback):
    """Decides when to log, save and stop from the arguments (always installed first)."""

    def on_step_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        step = state.global_step
        if step == 1 and args.logging_first_step:
            control.should_log = True
        if (
            args.logging_strategy == "steps"
            and state.logging_steps > 0
            and step % state.logging_steps == 0
        ):
            control.should_log = True
        if args.save_strategy == "steps" and state.save_steps > 0 and step % state.save_steps == 0:
            control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            # The final weights are always saved when periodic saving is on.
            if args.save_strategy == "steps":
                control.should_save = True
        return control

    def on_epoch_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control


class PrinterCallback(TrainerCallback):
    """Prints every log entry (the toy script and demos use it)."""

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        logs = kw.get("logs") or {}
        if state.is_local_process_zero:
            print({k: v for k, v in logs.items() if k != "total_flos"}, flush=True)


def _same_class(ours: type, given: type) -> bool:
    """``given`` names ``ours``: the class itself, or transformers' class of the same name for one
    of our built-in callbacks (scripts written for transformers pop ``transformers.PrinterCallback``
    to silence the Trainer's printing)."""
    if ours is given:
        return True
    return (
        given.__module__.split(".")[0] == "transformers"
        and ours.__module__.split(".")[0] == "trainer_runtime"
        and ours.__name__ == given.__name__
    )


class CallbackHandler(TrainerCallback):
    """Calls every registered callback for each event, in order."""

    def __init__(self, callbacks: list[Any] | None = None, **objects: Any) -> None:
        self.callbacks: list[TrainerCallback] = []
        for cb in callbacks or []:
            self.add_callback(cb)
        # model, optimizer, lr_scheduler, train_dataloader, processing_class...
        self.objects: dict[str, Any] = dict(objects)

    def add_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> None:
        cb = callback() if isinstance(callback, type) else callback
        cb_class = type(cb)
        if any(type(c) is cb_class for c in self.callbacks):
            logger.warning(
                "adding callback %s although one of that class is already registered",
                cb_class.__name__,
            )
        self.callbacks.append(cb)

    def pop_callback(
        self, callback: type[TrainerCallback] | TrainerCallback
    ) -> TrainerCallback | None:
        for cb in self.callbacks:
            if (isinstance(callback, type) and _same_class(type(cb), callback)) or cb is callback:
                self.callbacks.remove(cb)
                return cb
        return None

    def remove_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> None:
        self.pop_callback(callback)

    @property
    def callback_list(self) -> str:
        return "\n".join(type(cb).__name__ for cb in self.callbacks)

    def call_event(
        self, event: str, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        for cb in self.callbacks:
            result = getattr(cb, event)(args, state, control, **self.objects, **kw)
            if result is not None:
                control = result
        return control


# Flags an event consumes, cleared before the callbacks run, as transformers' CallbackHandler
# does: a flag saved in trainer_state.json (TrainerControl) then reads as in transformers (e.g.
# should_log is false in a checkpoint written after the step's log). The training and epoch
# stops are reset by the loop itself (TrainerControl._new_training/_new_epoch).
_CLEARS: dict[str, tuple[str, ...]] = {
    "on_step_begin": ("should_log", "should_evaluate", "should_save"),
    "on_log": ("should_log",),
    "on_evaluate": ("should_evaluate",),
    "on_save": ("should_save",),
}


# Give the handler one method per event: handler.on_step_end(args, state, control, **kw).
def _dispatcher(event: str) -> Any:
    clears = _CLEARS.get(event, ())

    def dispatch(
        self: CallbackHandler, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        for flag in clears:
            setattr(control, flag, False)
        return self.call_event(event, args, state, control, **kw)

    dispatch.__name__ = event
    return dispatch


for _event in EVENTS:
    setattr(CallbackHandler, _event, _dispatcher(_event))
