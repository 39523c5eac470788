"""Models in and out of the store: ``raftps export`` and ``raftps import``.

A model is the tensors under a prefix ``P``: the names ``P/<name>`` (what raftps.torch writes,
``PREFIX/<parameter name>``). An exported file holds them under ``<name>``, the prefix stripped,
so its keys match ``model.named_parameters()`` / ``state_dict()`` and a PyTorch user loads it with
``model.load_state_dict(safetensors.torch.load_file(FILE))``. raftps.torch's own bookkeeping
(``P/_raftps/...``, the per-rank step counters) is left out. The file's metadata names the
store version of the one linearizable read it came from and the store's digest at that version.

Files are read without pickle (``np.load(allow_pickle=False)``, safetensors), checked whole
before anything is written to the store, and refused with a message that names the problem.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from raftps import optim
from raftps.client.client import Client
from raftps.errors import InvalidOptimizer, RaftpsError, UsageError
from raftps.jobs import INTERNAL, prefix_root
from raftps.tensor import NAME_RE, check_finite

FORMATS = ("safetensors", "npz", "torch")     # torch: {"model", "optimizer"} state_dicts (raftps.torch.checkpoint)
NPZ_METADATA = "__metadata__"          # the npz member holding the metadata (JSON in a 0-d str array)
STORED = (np.dtype(np.float32), np.dtype(np.float64))
# Like raftps.torch: half precision is kept in float32 in the store (its optimizers need the range).
UPCAST = {np.dtype(np.float16): np.dtype(np.float32)}
# One create per batch, well below max_tensors_per_push (1024) and small enough to replicate within
# a node's request timeout (3 s) on a busy machine: a 256 MiB create never did here (load 5-10).
BATCH_TENSORS, BATCH_BYTES = 256, 32 << 20


def parse_optimizer(text: str) -> dict:
    """An optimizer spec from the command line: JSON (``'{"name": "adam", "lr": 0.001}'``) or
    ``name,key=value,...`` (``adam,lr=0.001``), validated like a create would."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--optimizer {text!r} is not valid JSON: {exc}") from None
    else:
        name, *pairs = [p.strip() for p in text.split(",")]
        spec = {"name": name}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise UsageError(f"--optimizer: {pair!r} is not key=value (e.g. adam,lr=0.001)")
            spec[key.strip()] = _value(value.strip())
    return _checked_spec(spec)


def _checked_spec(spec: Any) -> dict:
    try:
        return optim.normalize(spec, "--optimizer")
    except InvalidOptimizer as exc:
        raise UsageError(str(exc)) from None


def _value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"--optimizer: {text!r} is not a number or true/false") from None


# ---- export ------------------------------------------------------------------------------

def _text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def export_model(client: Client, prefix: str, fmt: str, path: str) -> dict:
    """Write every tensor under ``prefix`` at one store version to ``path``; returns a summary
    (version, digest, tensors, bytes). The file appears whole or not at all."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    if fmt == "torch":
        return _torch_checkpoint().export_torch(client, prefix, path)
    root = prefix_root(prefix)
    out = client.export(root)
    tensors = {name[len(root):]: arr for name, arr in out["tensors"].items()
               if not name[len(root):].startswith(INTERNAL)}
    if not tensors:
        raise UsageError(f"no tensor named {root}... in the store at version {out['version']}; nothing written")
    metadata = {
        "format": "pt",                  # what Hugging Face loaders expect of a state_dict file
        "raftps.prefix": root,
        # with several Raft groups both are {group: value} maps: kept as JSON
        "raftps.version": _text(out["version"]),
        "raftps.store_digest": _text(out["digest"]),
        "raftps.tensor_versions": json.dumps({n: out["tensor_versions"][root + n] for n in sorted(tensors)}),
        "raftps.optimizers": json.dumps({n: out["optimizers"][root + n] for n in sorted(tensors)}),
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        if fmt == "safetensors":
            save_file = _safetensors().numpy.save_file
            save_file({n: np.asarray(a, order="C") for n, a in tensors.items()}, tmp, metadata=metadata)
        else:
            with open(tmp, "wb") as f:
                np.savez(f, **tensors, **{NPZ_METADATA: np.array(json.dumps(metadata))})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"version": out["version"], "digest": out["digest"], "tensors": len(tensors),
            "bytes": sum(a.nbytes for a in tensors.values()), "path": path, "format": fmt}


# ---- import ------------------------------------------------------------------------------

def read_model(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors and metadata of a safetensors file or an npz archive (told apart by content)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    if head[:2] == b"PK":                      # a zip archive (an empty one starts PK\x05\x06)
        tensors, metadata = _read_npz(path)
    else:
        tensors, metadata = _read_safetensors(path)
    if not tensors:
        raise UsageError(f"{path} holds no tensors")
    return tensors, metadata


def _read_npz(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    try:
        with np.load(path, allow_pickle=False) as z:          # never unpickle a file's bytes
            members = {name: z[name] for name in z.files}
    except Exception as exc:                                   # zipfile, numpy format, object arrays
        raise UsageError(f"{path} is not a readable npz archive: {exc}") from None
    raw = members.pop(NPZ_METADATA, None)
    metadata: dict[str, str] = {}
    if raw is not None:
        try:
            metadata = json.loads(str(raw))
        except (json.JSONDecodeError, TypeError):
            raise UsageError(f"{path}: its {NPZ_METADATA} member is not JSON") from None
    return members, metadata


def _safetensors() -> Any:
    try:
        import safetensors.numpy
    except ImportError:
        raise UsageError("the safetensors package is missing: pip install 'raftps[ops]' (cluster/setup.sh "
                             "installs it), or use --format npz") from None
    return safetensors


def _read_safetensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    safe_open = _safetensors().safe_open
    try:
        with safe_open(path, "np") as f:
            # bfloat16 has no numpy dtype: refuse it by name before numpy is asked to load it
            bf16 = [n for n in f.keys() if f.get_slice(n).get_dtype() == "BF16"]
            if bf16:
                raise UsageError(f"{path}: tensor(s) {bf16[:5]} are bfloat16, which numpy cannot hold; "
                                     "save them as float32 (tensor.float()) and import again")
            return {n: f.get_tensor(n) for n in f.keys()}, dict(f.metadata() or {})
    except UsageError:
        raise
    except Exception as exc:                                   # SafetensorError and friends
        raise UsageError(f"{path} is neither an npz archive nor a readable safetensors file: {exc}") from None


def _torch_checkpoint() -> Any:
    try:
        from raftps.torch import checkpoint
    except ImportError:
        raise UsageError("the torch format needs PyTorch: bash cluster/setup.sh --torch") from None
    return checkpoint


def _is_torch_file(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            if f.read(2) != b"PK":
                return False
    except OSError:
        return False
    import zipfile
    try:
        with zipfile.ZipFile(path) as z:
            return any(n == "data.pkl" or n.endswith("/data.pkl") for n in z.namelist())
    except zipfile.BadZipFile:
        return False


def import_model(client: Client, path: str, prefix: str, optimizer: dict | None) -> dict:
    """Create ``P/<name>`` for every tensor in ``path`` with ``optimizer``. Checked whole first
    (names, dtypes, NaN/Inf, spec); like create, tensors that exist with the same shape, dtype
    and optimizer are left as they are, so running it again is a no-op. Returns a summary.
    A torch checkpoint (``export --format torch``) also brings its optimizer state, and the
    store specs it names (``optimizer`` may then be None)."""
    if _is_torch_file(path):
        return _torch_checkpoint().import_torch(client, path, prefix,
                                                _checked_spec(optimizer) if optimizer is not None else None)
    if optimizer is None:
        raise UsageError(f"{path}: give --optimizer (only a torch checkpoint from raftps export names its own)")
    root = prefix_root(prefix)
    spec = _checked_spec(optimizer)
    tensors, metadata = read_model(path)
    bad = {n: str(a.dtype) for n, a in tensors.items() if a.dtype not in STORED and a.dtype not in UPCAST}
    if bad:
        raise UsageError(f"{path}: the store holds float32/float64 tensors (float16 is widened to float32); "
                             f"refusing {dict(list(bad.items())[:5])}{' ...' if len(bad) > 5 else ''}")
    values: dict[str, np.ndarray] = {}
    for name, arr in sorted(tensors.items()):
        full = root + name
        if not NAME_RE.fullmatch(full):
            raise UsageError(f"{path}: tensor {name!r} would be {full!r}, not a valid tensor name "
                                 "(1-200 characters from [A-Za-z0-9_.:/-])")
        arr = np.asarray(arr, dtype=UPCAST.get(arr.dtype, arr.dtype), order="C")   # 0-d stays 0-d
        try:
            check_finite(full, arr, "value")
        except RaftpsError as exc:
            raise UsageError(f"{path}: {exc}") from None
        values[full] = arr
    created: list[str] = []
    version = 0
    for batch in _batches(values):
        result = client.create_result(batch, {n: spec for n in batch})
        created += result.get("created", [])
        version = result["version"]
    return {"version": version, "tensors": len(values), "created": len(created),
            "existing": len(values) - len(created), "bytes": sum(a.nbytes for a in values.values()),
            "source_version": metadata.get("raftps.version"), "source_digest": metadata.get("raftps.store_digest")}


def _batches(values: dict[str, np.ndarray]):
    batch: dict[str, np.ndarray] = {}
    size = 0
    for name, arr in values.items():
        if batch and (len(batch) >= BATCH_TENSORS or size + arr.nbytes > BATCH_BYTES):
            yield batch
            batch, size = {}, 0
        batch[name] = arr
        size += arr.nbytes
    if batch:
        yield batch
