"""The command line's --tp end to end on host devices, run by test_cli.py in a subprocess (the
device count must be set before JAX starts): `generate`, `eval` and `calibrate` on the
embedded model at --tp 1 and --tp N, on the mesh --tp builds (explicit axes) and on an
auto-axes one. Usage: cli_tp_checks.py DEVICES OUT_JSON. Writes {run name: what it printed or
wrote}; test_cli.py compares each --tp N run with the --tp 1 one.
"""
import contextlib
import io
import json
import os
import sys
import tempfile

DEVICES = int(sys.argv[1])
# host devices; and cheaper CPU code generation (the runs compared are compiled alike)
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={DEVICES}",
    "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]).strip()

import jax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from sparsejax import cli, sharding  # noqa: E402

PROMPT = ("the special magic number for orca 39 20 34 . leave bird again soon now . the special "
          "magic number for tapir 5 61 17 . what is the special magic number for orca ? answer : "
          "the special magic number for orca")
MESHES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def run(*argv) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    if rc != 0:
        raise SystemExit(f"sparsejax {' '.join(map(str, argv))} exited {rc}:\n"
                         f"{err.getvalue()[-3000:]}")
    return out.getvalue()


def commands(tp: int, tmp: str, tag: str) -> dict:
    # DELTA reads the calibration shipped beside the model: the fingerprint of the sharded
    # weights is checked against the file's
    got = {"generate": {"delta": run("generate", "--tp", tp, "--prompt", PROMPT,
                                     "--max-new-tokens", 4, "--method", "delta")}}
    run("eval", "--tp", tp, "--task", "niah", "--context", 64, "--samples", 1, "--repeats", 1,
        "--methods", "delta", "--json", f"{tmp}/{tag}-eval.json")
    got["eval"] = [{k: r[k] for k in ("method", "task", "accuracy", "mean_recall",
                                      "mean_attn_error")}
                   for r in json.load(open(f"{tmp}/{tag}-eval.json"))["results"]]
    run("calibrate", "--tp", tp, "--method", "delta", "--task", "niah", "--samples", 2,
        "--context", 64, "--decode-steps", 2, "--out", f"{tmp}/{tag}-calib.json")
    calib = json.load(open(f"{tmp}/{tag}-calib.json"))
    got["calibrate"] = {"layers": calib["layers"], "curves": calib["curves"],
                        "model": calib["model"]}
    return got


def main() -> None:
    assert jax.device_count() == DEVICES, jax.devices()
    results = {"devices": jax.device_count()}
    build = sharding.tensor_parallel_mesh
    with tempfile.TemporaryDirectory() as tmp:
        if DEVICES == 2:
            results["tp1"] = commands(1, tmp, "tp1")
        for name, axis_type in MESHES.items():
            if DEVICES != 2 and name != "explicit":
                continue
            sharding.tensor_parallel_mesh = lambda size, t=axis_type: None if size == 1 else (
                jax.make_mesh((size,), (sharding.MODEL,), axis_types=(t,),
                              devices=jax.devices()[:size]))
            results[f"tp{DEVICES}/{name}"] = commands(DEVICES, tmp, name)
            mesh = sharding.tensor_parallel_mesh(DEVICES)
            results[f"tp{DEVICES}/{name}/axis_types"] = [t.name for t in mesh.axis_types]
        sharding.tensor_parallel_mesh = build
        results["cli_mesh_axis_types"] = [t.name for t in build(DEVICES).axis_types]
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
