"""An optimizer step that an out-of-memory error cannot leave half-done (used by memfit.fit.FitLoop)."""

from __future__ import annotations

import copy

from typing import Any

_OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory", "alloc_failed")


def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError, or a RuntimeError whose message says the allocator failed (CPU, cuBLAS, MPS)."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error).lower() for m in _OOM_MESSAGES)


class TransactionalStep:
    """optimizer.step(), one parameter at a time, each update undoable.

    How: the gradients of all parameters are set aside; each parameter in turn gets its gradient back, its value and
    optimizer state are copied (the undo record), `optimizer.step()` runs (every torch optimizer, bitsandbytes' and
    HF's skip parameters without a gradient) and the gradient is released. An OOM inside one parameter's update
    restores that parameter and its state from the record and puts the gradients of it and of every later parameter
    back; the parameters before it have finished and hold no gradient. So "holds a gradient" always means "still to
    step", and a resumed step picks up exactly the unfinished parameters: each parameter is updated once, with its
    full gradient. For optimizers whose update of a parameter reads only that parameter's gradient and state (SGD,
    Adam/AdamW single-tensor, foreach or fused, Adafactor, 8-bit Adam), the result equals one uninterrupted
    optimizer.step() bit for bit; optimizers that couple parameters (a global gradient norm inside the step, LBFGS)
    are not supported. Step hooks (`register_step_pre_hook` / `_post_hook`) run once per parameter.

    Cost: memory for one parameter's record at a time -- its value plus its state (3x the largest parameter for
    AdamW), on the device or, with undo='host', in host memory. If the record itself does not fit on the device it is
    kept in host memory for that parameter (nothing has changed yet when it is made). Against that, each gradient is
    released as soon as its parameter is done and foreach temporaries shrink to one parameter, so the step's peak
    rarely rises. Time: one optimizer.step() call per parameter and one extra copy of every parameter and state per
    step (the step is memory-bound, so roughly twice its plain time; small next to forward and backward). memfit's
    bf16 master-weights wrapper is stepped through its inner optimizer, one master copy at a time.
    """

    def __init__(self, model, optimizer, undo: str) -> None:
        self.optimizer = optimizer
        self.undo = None if undo == "none" else undo
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.master = all(hasattr(optimizer, a) for a in ("inner", "model_params", "master_params"))

    @property
    def units(self) -> list[tuple[Any, Any]]:
        """(tensor holding the gradient, optimizer.state key) per parameter, in the optimizer's order."""
        if self.master:
            return list(zip(self.optimizer.model_params, self.optimizer.master_params))
        return [(p, p) for group in self.optimizer.param_groups for p in group["params"]]

    @property
    def remaining(self) -> int:
        """Parameters still to step in this step: those holding a gradient."""
        return sum(holder.grad is not None for holder, _ in self.units)

    def next_name(self) -> str:
        return next((self.names.get(id(h), "?") for h, _ in self.units if h.grad is not None), "?")

    def step(self) -> None:
        if self.undo is None:
            self.optimizer.step()
            return
        import torch

        pending = [(holder, key) for holder, key in self.units if holder.grad is not None]
        grads = [holder.grad for holder, _ in pending]
        for holder, _ in pending:
            holder.grad = None
        done = 0
        try:
            with torch.no_grad():
                for holder, key in pending:
                    record = self._save(holder, key)
                    try:
                        self._step_one(holder, key, grads[done])
                    except BaseException:
                        self._restore(holder, key, record)
                        raise
                    grads[done] = None  # released as soon as its parameter is done
                    done += 1
        finally:
            for (holder, _), grad in zip(pending[done:], grads[done:]):
                holder.grad = grad

    def _step_one(self, holder, key, grad) -> None:
        if self.master:
            key.grad = grad.to(key.dtype)
            try:
                self.optimizer.inner.step()
            finally:
                key.grad = None
            holder.copy_(key)
        else:
            holder.grad = grad
            try:
                self.optimizer.step()
            finally:
                holder.grad = None

    def _state(self):
        return self.optimizer.inner.state if self.master else self.optimizer.state

    def _save(self, holder, key) -> dict[str, Any]:
        """Copies of everything this parameter's update may change in place, made before it starts."""
        state = self._state().get(key)
        tensors = {"key": key, "holder": holder} if holder is not key else {"key": key}
        if state is not None:
            tensors.update({f"state/{k}": v for k, v in state.items() if _is_tensor(v)})
        try:
            copies = _copies(tensors, host=self.undo == "host")
        except RuntimeError as error:
            if not is_out_of_memory(error) or self.undo == "host":
                raise
            del error
            copies = _copies(tensors, host=True)  # nothing has changed yet: keep this record in host memory
        plain = None if state is None else {k: copy.deepcopy(v) for k, v in state.items() if not _is_tensor(v)}
        devices = None if state is None else {k: v.device for k, v in state.items() if _is_tensor(v)}
        return {"copies": copies, "plain": plain, "devices": devices}

    def _restore(self, holder, key, record: dict[str, Any]) -> None:
        copies = record["copies"]
        key.detach().copy_(copies["key"])
        if "holder" in copies:
            holder.detach().copy_(copies["holder"])
        state = self._state()
        if record["plain"] is None:
            state.pop(key, None)  # created by the failed update
            return
        restored = {k: copies[f"state/{k}"].to(device) for k, device in record["devices"].items()}
        state[key] = {**record["plain"], **restored}


def _copies(tensors: dict, *, host: bool) -> dict:
    return {name: t.detach().to("cpu", copy=True) if host else t.detach().clone() for name, t in tensors.items()}


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


# ------------------------------------------------------------------------------------------------ setups, batches
