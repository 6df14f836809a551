"""How checkpoint files are written and checked: state files without pickle, and the manifest.

A state file pair `<stem>.json` + `<stem>.safetensors` holds a nested Python value (optimizer,
scheduler, dataloader, RNG, replay buffer state): the tensors go to safetensors, everything
else to JSON, where a tensor is `{"__tensor__": key}`. Tuples, dicts with non-string keys
(optimizer states are keyed by parameter index) and dataclasses are tagged so they come back
as they went in. Loading runs no code from the file: a dataclass is rebuilt only if the caller
names its class in `types`, and nothing else is ever constructed.

The manifest (`manifest.json`) records a content hash and size of every file of a checkpoint,
written by `CheckpointManager.save` before the folder is published; `verify_manifest` says
what is wrong with a folder, or None when every listed file is there and intact.

Boundary: plain files and values; this module knows nothing of models, runs or Ray.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from grpo_train.errors import StateFileError  # re-exported: its old home

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
HASH_ALGORITHM = "sha256"  # measured faster than blake2b here (SHA-NI): benchmarks/results/checkpoint_hash_cpu.md
_CHUNK = 1 << 22  # 4 MiB reads while hashing

_TENSOR, _TUPLE, _ITEMS, _DATACLASS = "__tensor__", "__tuple__", "__items__", "__dataclass__"
_TAGS = (_TENSOR, _TUPLE, _ITEMS, _DATACLASS)


# ----------------------------------------------------------------------------- state files
def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _encode(value: Any, tensors: dict, where: str) -> Any:
    import numpy as np
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):  # a numpy scalar in env metadata: stored as the Python number
        return value.item()
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        # A private contiguous CPU copy: safetensors refuses tensors that share storage.
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {_TENSOR: key}
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
            return {k: _encode(v, tensors, f"{where}.{k}") for k, v in value.items()}
        return {
            _ITEMS: [[_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()]
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: _encode(getattr(value, f.name), tensors, f"{where}.{f.name}") for f in dataclasses.fields(value)
        }
        return {_DATACLASS: _type_name(type(value)), "fields": fields}
    raise TypeError(
        f"{where}: cannot store a {type(value).__name__} in a state file (tensors, numbers, "
        "strings, lists, tuples, dicts and allow-listed dataclasses only)"
    )


def _decode(value: Any, tensors: dict, types: dict[str, type], where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, types, where) for v in value]
    if not isinstance(value, dict):
        return value
    if _TENSOR in value:
        if value[_TENSOR] not in tensors:
            raise StateFileError(f"{where}: tensor {value[_TENSOR]!r} is missing from the safetensors file")
        return tensors[value[_TENSOR]]
    if _TUPLE in value:
        return tuple(_decode(v, tensors, types, where) for v in value[_TUPLE])
    if _ITEMS in value:
        return {
            _hashable(_decode(k, tensors, types, where)): _decode(v, tensors, types, where) for k, v in value[_ITEMS]
        }
    if _DATACLASS in value:
        cls = types.get(value[_DATACLASS])
        if cls is None:
            raise StateFileError(f"{where}: {value[_DATACLASS]!r} is not a type this state file may hold")
        return cls(**{k: _decode(v, tensors, types, where) for k, v in value["fields"].items()})
    return {k: _decode(v, tensors, types, where) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def save_state(value: Any, folder: Path, stem: str) -> None:
    """Write `value` as `folder/<stem>.json` and `folder/<stem>.safetensors` (no pickle)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict = {}
    tree = _encode(value, tensors, stem)
    save_file(tensors, str(folder / f"{stem}.safetensors"))
    (folder / f"{stem}.json").write_text(json.dumps({"format": MANIFEST_FORMAT, "value": tree}), encoding="utf-8")


def load_state(folder: Path, stem: str, types: tuple[type, ...] = ()) -> Any:
    """The value saved by `save_state`; dataclasses are rebuilt only for the classes in `types`.

    Raises StateFileError for a file pair that is missing, not JSON/safetensors, or names a
    type outside `types`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    json_path, tensor_path = folder / f"{stem}.json", folder / f"{stem}.safetensors"
    try:
        tree = json.loads(json_path.read_text(encoding="utf-8"))["value"]
        tensors = load_file(str(tensor_path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, SafetensorError) as err:
        raise StateFileError(f"{folder / stem}.{{json,safetensors}} is not a readable state file: {err}") from None
    return _decode(tree, tensors, {_type_name(cls): cls for cls in types}, stem)


# -------------------------------------------------------------------------------- manifest
def file_hash(path: Path, algorithm: str = HASH_ALGORITHM) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    out = []
    for dirpath, _dirnames, filenames in os.walk(folder):
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(folder).as_posix()
            if rel != MANIFEST_FILE:
                out.append(rel)
    return sorted(out)


def write_manifest(folder: Path) -> None:
    """Hash every file under `folder` into `folder/manifest.json`."""
    folder = Path(folder)
    files = {
        rel: {"size": (folder / rel).stat().st_size, HASH_ALGORITHM: file_hash(folder / rel)} for rel in _files(folder)
    }
    manifest = {"format": MANIFEST_FORMAT, "algorithm": HASH_ALGORITHM, "files": files}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")


def verify_manifest(folder: Path) -> str | None:
    """What is wrong with checkpoint `folder` (its first problem, in words), or None if intact."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
        algorithm, files = manifest["algorithm"], manifest["files"]
        if algorithm not in hashlib.algorithms_guaranteed or not isinstance(files, dict) or not files:
            return f"{MANIFEST_FILE} is not a manifest"
    except FileNotFoundError:
        return f"no {MANIFEST_FILE} (written by a grpo older than checksummed checkpoints, or not a checkpoint)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        return f"{MANIFEST_FILE} is unreadable ({type(err).__name__})"
    for rel, entry in sorted(files.items()):
        path = folder / rel
        try:
            if path.stat().st_size != entry["size"]:
                return f"{rel}: size {path.stat().st_size}, manifest says {entry['size']}"
            if file_hash(path, algorithm) != entry[algorithm]:
                return f"{rel}: content hash mismatch"
        except FileNotFoundError:
            return f"{rel} is missing"
        except (OSError, KeyError, TypeError) as err:
            return f"{rel} is unreadable ({type(err).__name__}: {err})"
    return None
