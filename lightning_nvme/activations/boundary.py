"""Is the tensor being saved right now an input of a ``torch.utils.checkpoint`` region?

Why look at the Python stack: the pack hook receives only the tensor, not the op that saves it. The
tensors worth sending to disk are the inputs a checkpoint keeps for recomputation (everything saved
*inside* a non-reentrant region is caught by checkpoint's own, innermost hooks and never reaches
ours). Those inputs are saved from known places in torch: ``_CheckpointFrame.save_inputs`` (non-reentrant,
recent torch), ``_NoopSaveInputs.apply`` (non-reentrant, torch up to at least 2.11: a no-op autograd Function
that saves the inputs) and ``CheckpointFunction.apply`` (reentrant). Walking a few frames up from the hook
finds them at a cost of a few attribute reads per saved tensor. (Why the second: the first GPU run of
``benchmarks/gpu_check.py``, on torch 2.11, offloaded nothing: only the first and third were known.)
"""

from __future__ import annotations

import sys
import types

import torch.utils.checkpoint as _ckpt

_MAX_DEPTH = 8


def _code_objects(fn: object) -> set[types.CodeType]:
    """The code of ``fn`` and of the comprehensions nested in it (they run in their own frame on 3.11)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return set()
    found = {code}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.add(const)
    return found


_frame_cls = getattr(_ckpt, "_CheckpointFrame", None)
_SAVE_INPUTS_CODE = _code_objects(getattr(_frame_cls, "save_inputs", None))
#: autograd Functions whose ``apply`` saves a checkpoint region's inputs: the reentrant checkpoint, and the
#: non-reentrant one's input saver where this torch has it (``_CheckpointFrame.save_inputs`` replaced it).
_INPUT_SAVERS = tuple(c for c in (getattr(_ckpt, "CheckpointFunction", None), getattr(_ckpt, "_NoopSaveInputs", None))
                      if c is not None)
_APPLY_CODE = _code_objects(getattr(__import__("torch").autograd.Function, "apply", None))

#: False when this torch has no hook point; the offloader then warns that scope="checkpoint" sees nothing.
DETECTION_AVAILABLE = bool(_SAVE_INPUTS_CODE) or bool(_INPUT_SAVERS)


def saved_at_checkpoint_boundary() -> bool:
    """True when called (from a pack hook) while torch.utils.checkpoint saves a region's inputs."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return False
        code = frame.f_code
        if code in _SAVE_INPUTS_CODE:
            return True
        if code in _APPLY_CODE:
            return frame.f_locals.get("cls") in _INPUT_SAVERS
        frame = frame.f_back
    return False


_GENERATOR_CODE = getattr(getattr(_ckpt, "_checkpoint_without_reentrant_generator", None), "__code__", None)


def close_abandoned_checkpoints(exc: BaseException | None) -> int:
    """Close the non-reentrant checkpoint generators an exception left suspended; returns how many.

    Why: ``torch.utils.checkpoint`` enters its saved-tensor hooks inside a generator and exits them when
    the generator resumes. If the checkpointed function raises, the generator stays suspended (kept
    alive by the traceback) with its hooks still on top of ours, and pops "the top" whenever it is
    garbage-collected. Closing these generators innermost first restores the stack in order, so our
    own hooks can then be removed.
    """
    if exc is None or _GENERATOR_CODE is None:
        return 0
    found = []
    tb = exc.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if (isinstance(value, types.GeneratorType) and value.gi_code is _GENERATOR_CODE
                    and value.gi_frame is not None and value not in found):
                found.append(value)
        tb = tb.tb_next
    for gen in reversed(found):
        gen.close()
    return len(found)
