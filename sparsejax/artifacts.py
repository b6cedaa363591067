"""Files that fitting jobs write and methods read: calibration files (DELTA's Δ-layers, Kascade's
anchors and head map) and gate files (LycheeDecode's retrieval heads).

Both name the model they were made for with one `Fingerprint`; a method built from a file keeps
it (`Origin`) and checks it against the model whenever the model is known.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from sparsejax.files import write_text_atomic
from sparsejax.models import layer_params, split_layer

CALIBRATION_FORMAT = "sparsejax-calibration"
CALIBRATION_VERSION = 1
CALIBRATED_METHODS = ("delta", "kascade")
GATES_FORMAT = "sparsejax-gates/2"
_GATES_FORMAT_V1 = "sparsejax-gates/1"   # its fingerprint was another hash: read, not checked
GATES_FILE = "gates.json"

_HASHED_PARAMS = ("embed", "wq", "wk", "wv", "wo", "w_down")
_HASHED_VALUES = 1024
# a layer's arrays that hold the hashed weights, fused ("wqkv") or not
_HASHED_LAYER_ARRAYS = ("wq", "wk", "wv", "wqkv", "wo", "w_down")


def _host_rows(x, start: int, stop: int) -> np.ndarray:
    """x[start:stop] (leading axis) as a host array, copied from each device's shard: no
    operation runs on the array itself, whose sharding (an explicit-axes mesh refuses an
    index that would need collectives) then does not matter, and only those rows move."""
    if not hasattr(x, "addressable_shards"):
        return np.asarray(x[start:stop])
    out = np.empty((stop - start,) + tuple(x.shape[1:]), x.dtype)
    filled = np.zeros(out.shape, bool)
    for shard in x.addressable_shards:
        lo, hi, _ = shard.index[0].indices(x.shape[0])
        a, b = max(lo, start), min(hi, stop)
        if a >= b:
            continue
        at = (slice(a - start, b - start),) + tuple(shard.index[1:])
        out[at] = np.asarray(shard.data[a - lo:b - lo])
        filled[at] = True
    if not filled.all():
        raise ValueError(f"an array of shape {x.shape} is not all held by this process: its "
                         "fingerprint needs rows it cannot read")
    return out


# ---- the model a file was made for ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """The model's shapes and a short hash of a few of its weights (None when only the config
    is known). Hashable: methods that carry one stay valid jit static arguments."""
    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    params_hash: str | None = None

    @classmethod
    def of_config(cls, config) -> "Fingerprint":
        c = config
        return cls(c.model_type, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                   c.hidden_size, c.vocab_size)

    @classmethod
    def of_model(cls, model) -> "Fingerprint":
        """The hash reads the first and last `_HASHED_VALUES` values of the embedding and of
        the stacked attention and MLP-down weights (so the first and last layers), rounded to
        bfloat16, so one checkpoint loaded in float32 or bfloat16 hashes alike. The values are
        read shard by shard (`_host_rows`), so a model placed on a mesh hashes as it does on
        one device."""
        digest = hashlib.sha256()
        p, c = model.params, model.config
        n = _HASHED_VALUES
        layers = [layer_params(p, i) for i in (0, c.num_layers - 1)]
        ends = [{name: (_host_rows(x, 0, min(n, x.shape[0])),
                        _host_rows(x, x.shape[0] - min(n, x.shape[0]), x.shape[0]))
                 for name, x in lp.items() if name in _HASHED_LAYER_ARRAYS} for lp in layers]
        # each weight's leading and trailing rows, split as `split_layer` splits the fused ones
        first = split_layer({name: head for name, (head, _) in ends[0].items()}, c)
        last = split_layer({name: tail for name, (_, tail) in ends[1].items()}, c)
        for name in _HASHED_PARAMS:
            if name in p:
                x = p[name]
                rows = min(n, x.shape[0])
                head, tail = _host_rows(x, 0, rows), _host_rows(x, x.shape[0] - rows, x.shape[0])
            else:
                head, tail = first[name], last[name]
            part = np.concatenate([np.asarray(head).reshape(-1)[:n],
                                   np.asarray(tail).reshape(-1)[-n:]])
            digest.update(np.asarray(jnp.asarray(part).astype(jnp.bfloat16)).tobytes())
        return dataclasses.replace(cls.of_config(model.config),
                                   params_hash=digest.hexdigest()[:16])

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d) -> "Fingerprint | None":
        """None for a record without a readable fingerprint (nothing to check against)."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or not names - {"params_hash"} <= set(d):
            return None
        return cls(**{k: v for k, v in d.items() if k in names})

    def differences(self, other: "Fingerprint") -> list[str]:
        """'field: file X, model Y' for every field both know and disagree on."""
        return [f"{f.name}: file {mine!r}, model {theirs!r}" for f in dataclasses.fields(self)
                if (mine := getattr(self, f.name)) is not None
                and (theirs := getattr(other, f.name)) is not None and mine != theirs]


def fingerprint(model_or_config) -> Fingerprint:
    """A `Model`'s full fingerprint, or a `ModelConfig`'s (shapes only)."""
    if hasattr(model_or_config, "params"):
        return Fingerprint.of_model(model_or_config)
    return Fingerprint.of_config(model_or_config)


@dataclasses.dataclass(frozen=True)
class Origin:
    """The file a method's fitted choices were read from, and the model it was made for."""
    path: str
    fingerprint: Fingerprint | None

    def check(self, model_or_config, what: str = "file") -> None:
        """ValueError naming the file and both fingerprints when they disagree."""
        if self.fingerprint is None:
            return
        have = fingerprint(model_or_config)
        diff = self.fingerprint.differences(have)
        if diff:
            raise ValueError(f"{what} {self.path} was made for another model ({'; '.join(diff)}):"
                             f" file fingerprint {self.fingerprint.to_json()}, model "
                             f"{have.to_json()}")


# ---- calibration files ----------------------------------------------------------------------
def _json_ready(x):
    """Arrays -> nested lists, NaN -> null (JSON has no NaN)."""
    if isinstance(x, dict):
        return {k: _json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_json_ready(v) for v in (x.tolist() if isinstance(x, np.ndarray) else x)]
    if isinstance(x, (float, np.floating)):
        return None if math.isnan(x) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    return x


def save_calibration(path, model, *, method: str, layers, curves: dict, settings: dict,
                     head_map=None) -> dict:
    """Write a calibration file (JSON) and return its contents.

    method: "delta" (layers = Δ-layers) or "kascade" (layers = anchors with 0, and head_map
    [L, HK]). curves: the measurements behind the choice; settings: how they were measured.
    The model's fingerprint and the date are added.
    """
    if method not in CALIBRATED_METHODS:
        raise ValueError(f"method={method!r}: expected one of {CALIBRATED_METHODS}")
    c = model.config
    layers = tuple(sorted(int(i) for i in layers))
    if not layers or len(set(layers)) != len(layers) or layers[0] < 0 or layers[-1] >= c.num_layers:
        raise ValueError(f"layers={layers}: expected distinct layers in [0, {c.num_layers})")
    doc = {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "method": method,
           "model": fingerprint(model).to_json(), "layers": list(layers)}
    if method == "kascade":
        if layers[0] != 0:
            raise ValueError(f"anchors={layers}: expected distinct layers in [0, {c.num_layers}) "
                             "including layer 0")
        hm = np.asarray(head_map)
        if hm.shape != (c.num_layers, c.num_kv_heads) or hm.min() < 0 or hm.max() >= c.num_kv_heads:
            raise ValueError(f"head_map has shape {hm.shape}: expected KV head indices in "
                             f"[0, {c.num_kv_heads}) of shape [{c.num_layers}, {c.num_kv_heads}]")
        doc["head_map"] = hm.astype(int).tolist()
    elif head_map is not None:
        raise ValueError("head_map is for method='kascade'; DELTA shares one page set")
    doc.update(curves=_json_ready(curves), settings=_json_ready(settings),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    # one line per list of numbers (a curve, a matrix row) keeps the file readable
    text = re.sub(r"\[[\s\d.eE+\-,nul]*\]",
                  lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "),
                  json.dumps(doc, indent=1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text + "\n")
    return doc


def load_calibration(path, kind: str, model=None) -> dict:
    """Read a calibration file of method `kind` ("delta" | "kascade"); with `model`, also check
    that it was made for this model. The result's "origin" is its `Origin`."""
    if kind not in CALIBRATED_METHODS:
        raise ValueError(f"kind={kind!r}: expected one of {CALIBRATED_METHODS}")
    try:
        calib = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"calibration file {path} cannot be read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration file {path} is not JSON: {e}") from None
    if not isinstance(calib, dict) or calib.get("format") != CALIBRATION_FORMAT:
        raise ValueError(f"{path} is not a sparsejax calibration file "
                         f"(format {CALIBRATION_FORMAT!r})")
    if calib.get("method") != kind:
        raise ValueError(f"calibration file {path} is for method {calib.get('method')!r}: "
                         f"expected {kind!r}")
    found = Fingerprint.from_json(calib.get("model"))
    if found is None:     # every file `save_calibration` writes has one
        raise ValueError(f"calibration file {path} has no readable model fingerprint (field "
                         "'model'): it cannot be checked against the model; run `sparsejax "
                         "calibrate` again for this model")
    calib["origin"] = Origin(str(path), found)
    if model is not None:
        calib["origin"].check(model, "calibration file")
    return calib


# ---- gate files -----------------------------------------------------------------------------
def save_gates(path, record: dict) -> Path:
    """Write a gate record as JSON (to a temporary file first, then renamed into place):
    retrieval_heads [layers][kv_heads], the model's fingerprint (`Fingerprint.to_json`) and
    whatever else the trainer records."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, json.dumps({"format": GATES_FORMAT, **record}, indent=1)
                             + "\n")


def load_gates(path, *, threshold: float = 0.5) -> tuple[np.ndarray, Origin]:
    """([layers, kv_heads] bool retrieval heads with layer 0 True, Origin) from any gate file:

      * a `save_gates` JSON, or a directory holding gates.json;
      * a `train_gates` checkpoint directory (Orbax; its latest step);
      * the reference code's output directory: full_head.pt when present (what its inference
        loads), else a.pt / b.pt thresholded at HardKuma mean > 0.5 (needs torch);
      * DuoAttention's full_attention_heads.tsv (or its directory): per layer a row of
        per-KV-head full-attention scores, clipped to [0, 1]; retrieval where score >=
        `threshold` (0.5, DuoAttention's default --threshold).
    Only this project's files carry a fingerprint; the others' Origin has none.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"gates path {str(path)!r} does not exist")
    record = None
    if path.is_dir():
        for name, reader in ((GATES_FILE, _from_json), ("full_attention_heads.tsv", _from_tsv),
                             ("full_head.pt", _from_reference), ("a.pt", _from_reference)):
            if (path / name).exists():
                record = reader(path / name, threshold)
                break
        else:
            record = _from_checkpoint(path)
            if record is None:
                raise ValueError(
                    f"gates directory {str(path)!r} holds none of {GATES_FILE}, "
                    "full_attention_heads.tsv, full_head.pt, a.pt/b.pt, nor an Orbax gate "
                    "checkpoint")
    elif path.suffix in (".json", ".tsv", ".pt"):
        reader = {".json": _from_json, ".tsv": _from_tsv, ".pt": _from_reference}[path.suffix]
        record = reader(path, threshold)
    else:
        raise ValueError(f"gates path {str(path)!r}: expected a .json, .tsv or .pt file, or a "
                         "directory of gates")
    heads = np.asarray(record["retrieval_heads"], bool)
    if heads.ndim != 2 or heads.shape[0] < 1:
        raise ValueError(f"gates {str(path)!r} hold shape {heads.shape}: expected "
                         "[layers, kv_heads]")
    heads = heads.copy()
    heads[0] = True
    return heads, Origin(str(path), Fingerprint.from_json(record.get("fingerprint")))


def load_retrieval_heads(path, *, threshold: float = 0.5) -> np.ndarray:
    """[layers, kv_heads] bool retrieval heads (layer 0 True) from any gate file (`load_gates`)."""
    return load_gates(path, threshold=threshold)[0]


def _from_json(path: Path, threshold: float) -> dict:
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"gate file {path} is not valid JSON: {e}") from None
    if not isinstance(record, dict) or record.get("format") not in (GATES_FORMAT,
                                                                     _GATES_FORMAT_V1):
        raise ValueError(f"{path} is not a gate file (expected format {GATES_FORMAT!r})")
    rows = record.get("retrieval_heads")
    if not (isinstance(rows, list) and rows and all(
            isinstance(r, list) and len(r) == len(rows[0]) and all(isinstance(x, bool) for x in r)
            for r in rows)):
        raise ValueError(f"{path} field retrieval_heads={str(rows):.80}: expected "
                         "[layers][kv_heads] booleans, every row as long")
    if record["format"] == GATES_FORMAT and Fingerprint.from_json(record.get("fingerprint")) \
            is None:    # every file `save_gates` writes has one
        raise ValueError(f"gate file {path} has no readable model fingerprint (field "
                         "'fingerprint'): it cannot be checked against the model; train the "
                         "gates again (`sparsejax train-gates`)")
    return record


def _from_tsv(path: Path, threshold: float) -> dict:
    try:
        scores = np.loadtxt(path, dtype=np.float64, delimiter="\t", ndmin=2)
    except ValueError as e:   # ragged rows, or cells that are not numbers
        raise ValueError(f"gate file {path} is not a table of scores: {e}") from None
    bad = np.argwhere(~np.isfinite(scores))
    if bad.size:
        raise ValueError(f"gate file {path} holds {len(bad)} NaN or infinite scores (first at "
                         f"layer {bad[0][0]}, KV head {bad[0][1]}): expected a score in [0, 1] "
                         "for every head")
    return {"retrieval_heads": np.clip(scores, 0, 1) >= threshold}


def _from_reference(path: Path, threshold: float) -> dict:
    """The reference code's gates in the directory of `path`: full_head.pt ([layers, kv_heads],
    1.0 = retrieval) when present, else a.pt and b.pt."""
    try:
        import torch
    except ImportError:
        raise ValueError(f"reading {path} (the reference code's torch gates) needs torch: "
                         "pip install torch --index-url "
                         "https://download.pytorch.org/whl/cpu") from None

    directory = path.parent

    def read(name):
        if not (directory / name).exists():
            raise ValueError(f"{directory} has no {name}: expected full_head.pt, or a.pt and b.pt")
        try:
            tensor = torch.load(directory / name, map_location="cpu", weights_only=True)
        except Exception as e:    # noqa: BLE001 (torch's unpickling errors share no base)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"gate file {directory / name} is not a plain tensor file torch "
                             f"loads with weights_only=True ({first[:120]})") from None
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"gate file {directory / name} holds a {type(tensor).__name__}: "
                             "expected one tensor")
        return tensor.detach().float().numpy()

    if (directory / "full_head.pt").exists():
        return {"retrieval_heads": read("full_head.pt") > 0.5}
    from sparsejax import hardkuma

    a, b = read("a.pt"), read("b.pt")
    return {"retrieval_heads": np.asarray(hardkuma.mean(jnp.asarray(a), jnp.asarray(b))) > 0.5}


def latest_checkpoint_record(directory) -> dict | None:
    """The JSON record of a `train_gates` checkpoint directory's latest step (its "gates" the
    gate record), or None without checkpoints. Reads through Orbax, imported only here."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(create=False)
    manager = ocp.CheckpointManager(Path(directory).resolve(), options=options)
    if manager.latest_step() is None:
        return None
    meta = manager.restore(manager.latest_step(),
                           args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    if not isinstance(meta, dict) or "gates" not in meta:
        raise ValueError(f"{directory} holds Orbax checkpoints, but not of train_gates")
    return meta


def _from_checkpoint(directory: Path) -> dict | None:
    meta = latest_checkpoint_record(directory)
    return None if meta is None else meta["gates"]


# ---- where fitted files live ----------------------------------------------------------------
CALIBRATION_DIR = "calibration"    # <home>/calibration/<method>.json
GATES_DIR = "gates"                # <home>/gates/*.json (the first by name)
# Models that ship by package (a GGUF inside a pip package) have no writable directory of their
# own: their fitted files ship in this repository under models/assets/<name>/, and are found by
# the fingerprint inside them, whatever path or name the model was loaded from.
_PACKAGED = ("smollm2",)          # models.loading.REAL_MODEL


def assets_root() -> Path:
    from sparsejax import models

    return Path(models.__file__).resolve().parent / "assets"


def fitted_directory(source) -> Path:
    """The directory whose calibration/ and gates/ hold the files fitted to the model loaded
    from `source`: a checkpoint directory itself; a packaged model's name (or its file) ->
    models/assets/<name>/; any other model file (a .gguf) -> <file>.fitted/ beside it."""
    text = str(source)
    if text in _PACKAGED:
        return assets_root() / text
    path = Path(source)
    if path.is_dir():
        return path
    if path.is_file():
        for name in _PACKAGED:
            if _packaged_file(name) == path.resolve():
                return assets_root() / name
        return path.with_name(path.name + ".fitted")
    raise ValueError(f"model {text!r}: expected a checkpoint directory, a model file or one of "
                     f"{_PACKAGED}")


def _packaged_file(name: str) -> Path | None:
    from sparsejax.models.loading import REAL_MODEL, real_model_path

    try:
        return Path(real_model_path()).resolve() if name == REAL_MODEL else None
    except ValueError:   # the package is not installed
        return None


def fitted_files(home, model) -> tuple[dict[str, Path], list[Path]]:
    """({"delta"/"kascade": calibration file}, [gate files, by name]) under `home`, not read."""
    home = Path(home)
    calibration = {kind: home / CALIBRATION_DIR / f"{kind}.json" for kind in CALIBRATED_METHODS}
    return ({k: p for k, p in calibration.items() if p.is_file()},
            sorted((home / GATES_DIR).glob("*.json")))


def shipped_for(model) -> Path | None:
    """The models/assets/<name>/ directory whose files carry exactly `model`'s fingerprint
    (weights' hash included), or None: how a packaged model finds what was fitted to it."""
    want = fingerprint(model)
    for home in sorted(p for p in assets_root().iterdir() if p.is_dir()):
        calibration, gates = fitted_files(home, model)
        for path in [*calibration.values(), *gates]:
            try:
                doc = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            found = Fingerprint.from_json(doc.get("model", doc.get("fingerprint")))
            if found is not None and found.params_hash is not None and found == want:
                return home
    return None
