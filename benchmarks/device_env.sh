# Sourced by the device scripts: makes `import sparsejax` work on the device image's python
# (jax with CUDA, no network). The package maps models/, pallas_kernels/, train/ to
# sparsejax.*: install it editable (offline, no build isolation), or fall back to an assembled
# copy on PYTHONPATH. Expects PY, LOG and the repository root as the working directory.
if ! $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$LOG" 2>&1; then
  site=$(mktemp -d)
  cp -r sparsejax "$site/sparsejax"
  cp -r models "$site/sparsejax/models"
  cp -r pallas_kernels "$site/sparsejax/pallas_kernels"
  cp -r train "$site/sparsejax/train"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
