"""State formats and master policies by name: what ``state_format``/``master_format`` may say.

Why a registry: the settings check, ``StateFormat`` and checkpoints look a name up here, so adding a
format never edits them. The built-in ones are registered in ``formats/__init__.py``.
"""

from __future__ import annotations

from lightning_nvme.optim.formats.codec import MasterPolicy, StateCodec, StateFormatError

_CODECS: dict[str, StateCodec] = {}
_MASTERS: dict[str, MasterPolicy] = {}


def register(codec: StateCodec) -> StateCodec:
    """Make ``codec`` available as ``state_format=codec.name``."""
    _CODECS[codec.name] = codec
    return codec


def register_master(policy: MasterPolicy) -> MasterPolicy:
    """Make ``policy`` available as ``master_format=policy.name``."""
    _MASTERS[policy.name] = policy
    return policy


def state_format_names() -> tuple[str, ...]:
    return tuple(_CODECS)


def master_format_names() -> tuple[str, ...]:
    return tuple(_MASTERS)


def state_codec(name: str) -> StateCodec:
    if name not in _CODECS:
        raise StateFormatError(f"invalid state_format={name!r}: must be one of {state_format_names()}")
    return _CODECS[name]


def master_policy(name: str) -> MasterPolicy:
    if name not in _MASTERS:
        raise StateFormatError(f"invalid master_format={name!r}: must be one of {master_format_names()}")
    return _MASTERS[name]
